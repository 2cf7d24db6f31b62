#!/usr/bin/env bash
# libmarconi's cache events read by the real consumers (docs/events.md,
# "Checked against the real consumers"): vLLM's own event classes, msgspec
# decoder and block hashing (three files of the pinned vLLM wheel, loaded
# without torch), and NVIDIA Dynamo's standalone KV indexer
# (`python -m dynamo.indexer` from the pinned ai-dynamo wheels, CPU only)
# subscribed over loopback ZeroMQ, beside `marconi-router serve` on the same
# streams (scores against each engine's own lookup), and the same HTTP
# requests sent to both answered alike (docs/routing.md's API table). Then `pip install
# ./python-shim` and `import marconi` must publish (the default build has
# the publisher).
#
# Downloads, pinned by version and sha256, cached under $target/consumers:
# vllm 0.33.0 (336 MB; only vllm/distributed/kv_events.py,
# vllm/v1/core/kv_cache_utils.py and vllm/utils/hashing.py are unpacked),
# ai-dynamo 1.6.1 (4.0 MB), ai-dynamo-runtime 1.6.1 (74.7 MB); PyPI: pytest,
# msgspec, pyzmq, cbor2, pydantic 2.13.5 (Dynamo's runtime imports it).
# MARCONI_EVENTS_STRICT=1: a missing piece fails instead of skipping.
# Dynamo's indexer listens on 0.0.0.0 (it has no address option); the test
# talks to it on 127.0.0.1 and stops it. Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
cache="$target/consumers"
mkdir -p "$cache/wheels"
cache="$(cd "$cache" && pwd)"

# name version file sha256
wheels=(
  "vllm 0.33.0 vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
  "ai-dynamo 1.6.1 ai_dynamo-1.6.1-py3-none-any.whl 83f768730104cbbc84029bf436025706632735173933adbb650b99c746517b70"
  "ai-dynamo-runtime 1.6.1 ai_dynamo_runtime-1.6.1-cp310-abi3-manylinux_2_28_x86_64.whl 3683cafe88ededdff29c9ae6f651367eac33153487ff84e205082483cd6b3095"
)
for w in "${wheels[@]}"; do
  read -r name version file sha <<<"$w"
  f="$cache/wheels/$file"
  if ! { [ -f "$f" ] && echo "$sha  $f" | sha256sum -c --quiet 2>/dev/null; }; then
    echo "--- pip download $name==$version"
    rm -f "$f"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux_2_28_x86_64 --python-version 3.11 "$name==$version" -d "$cache/wheels"
    echo "$sha  $f" | sha256sum -c --quiet
  fi
done

vllm_dir="$cache/vllm-0.33.0"
if [ ! -f "$vllm_dir/.done" ]; then
  rm -rf "$vllm_dir"
  "$python" - "$cache/wheels/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl" "$vllm_dir" <<'PY'
import sys, zipfile
files = ["vllm/distributed/kv_events.py", "vllm/v1/core/kv_cache_utils.py", "vllm/utils/hashing.py"]
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], files)
PY
  touch "$vllm_dir/.done"
fi
dyn_dir="$cache/dynamo-1.6.1"
if [ ! -f "$dyn_dir/.done" ]; then
  rm -rf "$dyn_dir"
  for f in ai_dynamo-1.6.1-py3-none-any.whl ai_dynamo_runtime-1.6.1-cp310-abi3-manylinux_2_28_x86_64.whl; do
    "$python" -m zipfile -e "$cache/wheels/$f" "$dyn_dir"
  done
  touch "$dyn_dir/.done"
fi

venv="$cache/venv"
echo "--- $venv: pip install pytest msgspec pyzmq cbor2 pydantic==2.13.5"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet pytest msgspec pyzmq cbor2 "pydantic==2.13.5"

echo "--- cargo build --release -p marconi-ffi (default features: the publisher)"
cargo build --release -p marconi-ffi
# The router as the test run built it (ci/built.sh): `-p marconi-router` alone
# resolves other features of tokio and serde and compiles them again.
router="$(bash ci/built.sh bin marconi-router)"
lib="$(pwd)/$target/release/libmarconi.so"
readelf -d "$lib" | grep -q 'NEEDED.*libstdc++' && { echo "libmarconi.so needs libstdc++" >&2; exit 1; }

echo "--- pytest test_consumers.py test_events.py test_events_zmq.py"
repo="$(pwd)"
mkdir -p "$cache/out"
(cd python-shim/tests && MARCONI_LIBRARY="$lib" MARCONI_EVENTS_STRICT=1 \
  MARCONI_VLLM_DIR="$vllm_dir" MARCONI_DYNAMO_DIR="$dyn_dir" \
  MARCONI_ROUTER_BIN="$router" MARCONI_CONSUMERS_OUT="$cache/out" \
  PYTHONPATH="$repo/python-shim" "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs \
  test_consumers.py test_events.py test_events_zmq.py)
cat "$cache/out/consumers.json"
# The README's figures of this run (its examples table; ci/test.d/readme.sh
# compares them): scores over-reported, HTTP requests answered alike.
mkdir -p "$target/readme-figures"
"$python" - "$cache/out" "$target/readme-figures/consumers.json" "${MARCONI_CI_RUN:-}" \
  "$(git rev-parse HEAD 2>/dev/null || true)" <<'PY'
import json, os, sys, time
c = json.load(open(os.path.join(sys.argv[1], "consumers.json")))["rows"]
api = json.load(open(os.path.join(sys.argv[1], "api.json")))
alike = sum(1 for r in api if not r["documented"])  # same status and content type, asserted
json.dump({"step": "ci/test.d/consumers.sh", "run": sys.argv[3], "commit": sys.argv[4],
           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "figures": {"pairs": c["marconi-router"]["pairs"], "over_router": c["marconi-router"]["over_pairs"],
                       "over_dynamo": c["dynamo-indexer"]["over_pairs"], "api_alike": alike,
                       "api_differences": len(api) - alike}},
          open(sys.argv[2], "w"), indent=1)
PY

echo "--- pip install ./python-shim: import marconi publishes"
"$venv/bin/python" -m pip install --quiet ./python-shim
(cd / && "$venv/bin/python" - <<'PY'
import marconi
assert marconi.has_publisher(), "the installed package has no publisher"
c = marconi.PrefixCache(capacity_bytes=1 << 30, model="paper-7b", page_size=4)
ev = marconi.CacheEvents(c, endpoint="tcp://127.0.0.1:*")
c.serve(list(range(16)), [1, 2])
assert ev.publish() == 0
print("installed marconi publishes on", ev.endpoint)
ev.close(); c.close()
PY
)
"$venv/bin/python" -m pip uninstall --quiet -y marconi
