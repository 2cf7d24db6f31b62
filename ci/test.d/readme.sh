#!/usr/bin/env bash
# The README's commands, run as a new user runs them, from a fresh clone of
# HEAD (`git clone` of this repository into a temporary directory; no
# network: cargo runs offline), with CARGO_TARGET_DIR at this repository's
# target dir and the clone's files given the mtimes of this tree's, so the
# test run's release build is reused, never rebuilt from scratch:
#   - the main job, `cargo run --release -p marconi-sim -- compare`, as
#     written: its printed table must equal the README's headline table (the
#     figures are deterministic; the speed columns are not shown) and it must
#     write the four SVG figures the README names into the clone's out/;
#   - `cargo install --locked --path marconi-sim --target-dir target` with
#     the target dir replaced by this repository's (the README's `target` is
#     the clone's own, which would compile everything again) and
#     CARGO_INSTALL_ROOT in the temporary directory; then `marconi-sim
#     --help` (every `marconi-sim CMD` the README names must be listed);
#   - the examples table's tiers row, its command as written with the
#     installed binary: the row's figures are recomputed from its 5 % rows;
#   - the router one-liner, started on a free 127.0.0.1 port instead of
#     8090, probed (GET /health, GET /workers, bounded) and stopped;
#   - docs/routing.md's `marconi-sim route` command and its table.
# The examples rows measured by heavy steps (llama-engine.sh,
# llama-server.sh, consumers.sh, which run before this one in ci/test.sh)
# are compared with the figures those steps wrote into
# $CARGO_TARGET_DIR/readme-figures/ (ci/readme_check.py: only the
# deterministic ones; the output says which rows were checked and which not).
# The C, Python and Rust snippets are checked where they build (the list at
# the end says where). MARCONI_BLESS=1 rewrites the README's figures (and
# docs/routing.md's table) from what the commands printed.
# Measured on 2 shared cores, the test run's build present: warm 13 s
# quiet (the main job 7 s), 1 min 28 s beside a llama.cpp build; cold, add
# the default-feature build of marconi-sim (marconi-core, marconi-gpu,
# marconi-sim: 2 min 16 s under load; the router's comes from consumers.sh).
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo="$(pwd)"
# The test run's profile (ci/test.sh sets it): another would rebuild every dependency.
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS="${CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS:-true}"
target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
export CARGO_TARGET_DIR="$target" CARGO_NET_OFFLINE=true
python="${PYTHON:-python3}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/marconi-readme.XXXXXX")"
out="$tmp/out"
mkdir -p "$out"
router_pid=""
cleanup() {
  if [ -n "$router_pid" ]; then
    kill -TERM -- "-$router_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$router_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$router_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# readme_cmd PATTERN: the README's command (inline code or a ```sh line)
# matching PATTERN, its line breaks joined as a shell would read it.
readme_cmd() {
  "$python" - "$1" <<'PY'
import re, sys
text = open("README.md").read()
cands, prose = [], []
for k, part in enumerate(re.split(r"^```[a-z]*\n", text, flags=re.M)):
    if k % 2:  # a fenced block: one command a line, comments cut
        cands += [re.sub(r"\s+#.*", "", l).strip() for l in part.split("\n")]
    else:
        prose.append(part)
cands += [re.sub(r"\s+", " ", c).strip() for c in re.findall(r"`([^`]+)`", "\n".join(prose))]
for c in cands:
    if re.fullmatch(sys.argv[1], c):
        print(c)
        break
else:
    sys.exit(f"README.md lost its command matching {sys.argv[1]!r}")
PY
}
main_cmd="$(readme_cmd 'cargo run --release -p marconi-sim -- compare')"
install_cmd="$(readme_cmd 'cargo install --locked --path marconi-sim --target-dir target')"
router_cmd="$(readme_cmd 'cargo run --release -p marconi-router -- serve --http 127\.0\.0\.1:[0-9]+')"
tiers_cmd="$(readme_cmd 'marconi-sim tiers [-a-z0-9, ]+')"
route_cmd="$(sed -n 's/^\(cargo run --release -p marconi-sim -- route .*\)/\1/p' docs/routing.md | head -n1)"
[ -n "$route_cmd" ] || { echo "docs/routing.md lost its route command" >&2; exit 1; }

echo "--- a fresh clone of HEAD ($(git rev-parse --short HEAD)) in $tmp/libmarconi"
git clone --no-hardlinks -q "$repo" "$tmp/libmarconi"
dirty="$(git status --porcelain --untracked-files=no)"
[ -z "$dirty" ] || printf 'note: the working tree differs from HEAD (the clone runs HEAD; cargo rebuilds the crates of these files):\n%s\n' "$dirty"
# This tree's mtimes on the clone's unchanged files: cargo then finds the
# release build it made for them fresh (a clone's new mtimes would make it
# recompile every workspace crate, twice: here and back in this tree).
git ls-files -z | "$python" -c '
import os, subprocess, sys
src, dst = sys.argv[1], sys.argv[2]
changed = set(subprocess.run(["git", "diff", "--name-only", "HEAD"], capture_output=True, text=True).stdout.split())
for f in sys.stdin.read().split("\0"):
    if f and f not in changed and os.path.isfile(os.path.join(dst, f)) and os.path.isfile(f):
        st = os.stat(f)
        os.utime(os.path.join(dst, f), ns=(st.st_atime_ns, st.st_mtime_ns))
' "$repo" "$tmp/libmarconi"
clone="$tmp/libmarconi"

echo "--- $main_cmd   (the main job, as written)"
t0=$SECONDS
(cd "$clone" && bash -euo pipefail -c "$main_cmd") >"$out/compare.txt"
cat "$out/compare.txt"
for svg in hit_rate ttft_cdf hit_by_length hit_diff_by_length; do
  [ -s "$clone/out/$svg.svg" ] || { echo "the main job wrote no out/$svg.svg" >&2; exit 1; }
done
echo "(main job: $((SECONDS - t0)) s; out/ holds the four figures the README names)"

echo "--- ${install_cmd/--target-dir target/--target-dir $target}   (CARGO_INSTALL_ROOT=$tmp/cargo)"
install_run="${install_cmd/--target-dir target/--target-dir $target}"
(cd "$clone" && CARGO_INSTALL_ROOT="$tmp/cargo" bash -euo pipefail -c "$install_run") 2>&1 | tail -n 2
export PATH="$tmp/cargo/bin:$PATH"
[ "$(command -v marconi-sim)" = "$tmp/cargo/bin/marconi-sim" ] || { echo "cargo install gave no marconi-sim" >&2; exit 1; }
(cd "$clone" && marconi-sim --help) >"$out/help.txt"
grep -q '^  compare ' "$out/help.txt" || { cat "$out/help.txt"; echo "marconi-sim --help lists no compare" >&2; exit 1; }

echo "--- $tiers_cmd   (the examples table's tiers row, as written)"
t0=$SECONDS
(cd "$clone" && bash -euo pipefail -c "$tiers_cmd") >"$out/tiers.txt"
cat "$out/tiers.txt"
echo "(tiers: $((SECONDS - t0)) s)"

echo "--- $route_cmd -q --out-dir ...   (docs/routing.md's command)"
# shellcheck disable=SC2086  # the documented arguments, split as a shell would
(cd "$clone" && $route_cmd -q --out-dir "$tmp/route") >"$out/route.txt"

dep_line="$(readme_cmd 'marconi-core = \{ path = "\.\./libmarconi/marconi-core" \}')"
echo "--- $dep_line   (the Rust dependency line: a crate beside the clone, resolved offline)"
mkdir -p "$tmp/app/src"
printf '[package]\nname = "app"\nversion = "0.1.0"\nedition = "2021"\n\n[dependencies]\n%s\n' "$dep_line" \
  >"$tmp/app/Cargo.toml"
echo 'fn main() {}' >"$tmp/app/src/main.rs"
(cd "$tmp/app" && cargo metadata --format-version 1 >"$out/metadata.json")
"$python" -c '
import json, sys
m = json.load(open(sys.argv[1]))
assert any(p["name"] == "marconi-core" and p["source"] is None for p in m["packages"]), "no path marconi-core"
print("resolved: marconi-core from the clone, %d packages" % len(m["packages"]))' "$out/metadata.json"

port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
router_run="$(printf '%s' "$router_cmd" | sed "s/127\.0\.0\.1:[0-9]*/127.0.0.1:$port/")"
echo "--- $router_run   (the router one-liner, on a free port)"
(cd "$clone" && exec setsid bash -c "exec $router_run") >"$out/router.log" 2>&1 &
router_pid=$!
"$python" - "$port" "$router_pid" <<'PY' || { cat "$out/router.log"; exit 1; }
import json, os, sys, time, urllib.request
port, pid = int(sys.argv[1]), int(sys.argv[2])
end = time.monotonic() + 900  # the router compiles first when the test run has not built it
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            assert r.status == 200, r.status
            break
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the router exited before answering /health")
    if time.monotonic() > end:
        sys.exit("the router did not answer /health in 900 s")
    time.sleep(0.5)
with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=10) as r:
    assert r.status == 200 and r.headers.get_content_type() == "application/json", (r.status, r.headers)
    workers = json.loads(r.read())
print(f"router: GET /health 200, GET /workers 200 JSON ({len(workers)} entries)")
PY
kill -TERM -- "-$router_pid"
wait "$router_pid" 2>/dev/null || true
router_pid=""

# Where each README command is run or checked (printed at the end).
"$python" - "$out/commands.json" "$main_cmd" "$install_cmd" "$tiers_cmd" "$router_cmd" "$dep_line" <<'PY'
import json, sys
main, install, tiers, router, dep = sys.argv[2:7]
json.dump([
    (main, "ci/test.d/readme.sh, fresh clone, as written: table == README's headline table, four SVGs"),
    ("bash ci/test.sh", "is the CI itself"),
    (install, "ci/test.d/readme.sh, fresh clone, --target-dir = the test run's (CARGO_INSTALL_ROOT temporary)"),
    ("marconi-sim --help", "ci/test.d/readme.sh: lists every `marconi-sim CMD` the README names"),
    ("marconi-sim compare", "the main job's command, installed (not run twice)"),
    (tiers, "ci/test.d/readme.sh, fresh clone, as written: the tiers row's figures"),
    ("bash ci/test.d/llama-engine.sh", "its step; ci/test.d/readme.sh compares the row with its readme-figures"),
    ("python3 examples/llama-server/side_by_side.py --requests 16 --sessions 5 --mib 4 (and --stores --requests 8 --sessions 2)",
     "ci/test.d/llama-server.sh (adds --parallel 3 --clients 4, which size a later phase only); "
     "ci/test.d/readme.sh compares the row with its readme-figures"),
    ("bash ci/test.d/consumers.sh", "its step; ci/test.d/readme.sh compares the row with its readme-figures"),
    (router, "ci/test.d/readme.sh, fresh clone, on a free port: GET /health, GET /workers"),
    ("the Rust snippet", "cargo test -p marconi-core --doc (rust tests step; marconi-core includes README.md)"),
    (dep, "ci/test.d/readme.sh: a crate beside the fresh clone resolves it (cargo metadata, offline); "
     "not compiled there (another workspace root: marconi-core would compile again)"),
    ("cargo doc -p marconi-core --open", "the docs step runs cargo doc --workspace (without --open)"),
    ('scripts/install.sh --prefix "$HOME/.local"', "ci/test.d/c-install.sh (a temporary prefix)"),
    ("the two cc lines and the C snippet", "ci/test.d/c-install.sh, extracted from README.md, output compared"),
    ("pip install ./python-shim", "ci/test.d/python.sh and ci/test.d/consumers.sh"),
    ("the Python snippet", "python-shim/tests/test_readme.py (ci/test.d/python.sh), extracted from README.md, "
     "output compared"),
    ("python -m sglang.launch_server ... --radix-cache-backend marconi", "not run (a GPU and a model); "
     "ci/test.d/sglang.sh drives the cache the flag selects"),
    ("vllm serve ... OffloadingConnector ... MarconiCachePolicy", "not run (a model); ci/test.d/vllm.sh runs the "
     "policy inside vLLM's scheduler and connector"),
], open(sys.argv[1], "w"), indent=1)
PY

"$python" ci/readme_check.py "$out" "$target/readme-figures"
