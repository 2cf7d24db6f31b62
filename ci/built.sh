#!/usr/bin/env bash
# ci/built.sh KIND NAME [PACKAGE]: the path of the executable KIND (bin,
# example or test) NAME (of PACKAGE, where two packages have one) as the
# test run's build makes it; `ci/built.sh tests PACKAGE`: every test harness
# of PACKAGE (its lib's unit tests and each integration test), one a line: `cargo test --workspace --release --features
# marconi-core/strict-checks` with overflow checks on (ci/test.sh's "rust
# tests"), built now if it is not yet (then this costs that build).
#
# Why: `cargo run -p CRATE` resolves features for CRATE alone, which differ
# from the workspace's (serde, regex, zeromq, ...), so a step that runs it
# after the test step compiles the workspace's crates and part of their
# dependencies a second time (about a minute per crate on 2 cores, cold).
# Asking the test build for its own executable costs a no-op build.
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: ci/built.sh bin|example|test NAME [PACKAGE] | tests PACKAGE" >&2; exit 2; }
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
cargo test --workspace --release --features marconi-core/strict-checks --no-run \
  --message-format=json-render-diagnostics 2>/dev/null |
  python3 -c '
import json, sys
kind, name = sys.argv[1], sys.argv[2]
package = sys.argv[3] if len(sys.argv) > 3 else None
def of_package(m, package):
    pid = m["package_id"]
    return pid.split("#")[0].rstrip("/").endswith("/" + package) \
        or "/" + package + "#" in pid or package + "@" in pid
if kind == "tests":
    found = set()
    for line in sys.stdin:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") == "compiler-artifact" and m.get("executable") \
                and m["profile"]["test"] and of_package(m, name):
            found.add(m["executable"])
    if not found:
        sys.exit("ci/built.sh: no test harness of package %s" % name)
    print("\n".join(sorted(found)))
    sys.exit(0)
found = []
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    if t["name"] != name or kind not in t["kind"]:
        continue
    # A bin also builds as its unit-test harness: kind "test" wants the
    # harness, the others the program.
    if (kind == "test") != m["profile"]["test"]:
        continue
    if package and not of_package(m, package):
        continue
    found.append(m["executable"])
found = sorted(set(found))
if len(found) != 1:
    sys.exit("ci/built.sh: %d executables for %s %s%s: %s"
             % (len(found), kind, name, " of " + package if package else "", found))
print(found[0])
' "$@"
