# Sourced by ci/test.d/vllm.sh (from the repository root, with `target` and
# `python` set): makes sure the venv with the pinned vLLM wheel exists and
# sets `vllm_venv` to its absolute path.
#
# vLLM 0.33.0 pins torch 2.14.0 and transformers < 5.21 (with their CUDA
# wheels, ~8.6 GB); the torch engine's venv (ci/torch-engine-venv.sh) has
# torch 2.15.0 and transformers 5.23.0. The scheduler-side code this project
# drives (Scheduler, KVCacheManager, OffloadingConnector, the CPU tier's
# manager and policies) is Python and imports and runs with those, so this
# venv does not install vLLM's dependencies: it is an overlay, a venv whose
# .pth file adds the torch venv's site-packages, with the vLLM wheel
# installed --no-deps (pinned by version and sha256, the file
# ci/test.d/consumers.sh downloads and checks) and only the pure-Python or
# small packages vLLM imports on that path, pinned to versions vLLM accepts.
# Measured on this 2-core machine with the torch venv present and a warm pip
# cache: about 40 s. The check and the install hold a lock, so two starts at
# once do not race.

VLLM_VERSION=0.33.0
VLLM_WHEEL=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
# What vLLM's scheduler path imports beyond torch and transformers.
VLLM_IMPORTS=(
  "cbor2==6.3.0" "msgspec==0.22.0" "pyzmq==27.3.0" "cachetools==8.0.2" "psutil==7.2.2"
  "blake3==1.0.11" "pydantic==2.13.5" "cloudpickle==3.1.3" "py-cpuinfo==9.0.0"
  "prometheus_client==0.26.0" "urllib3==2.8.0" "aiohttp==3.14.5" "requests==2.34.2"
  "openai-harmony==0.0.8" "openai==3.57.0" "pillow==13.0.0" "pybase64==1.5.1" "uvloop==0.23.0"
  "xgrammar==0.2.8" "fastapi==0.136.3" "partial-json-parser==0.2.1.1.post7"
  "llguidance==1.7.6" "einops==0.8.2" "pytest"
)

source ci/torch-engine-venv.sh  # sets venv (the torch venv)
torch_site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"

cache="$target/vllm"
mkdir -p "$cache/wheels"
cache="$(cd "$cache" && pwd)"
vllm_venv="$cache/venv"
exec {vllm_lock}>"$cache/venv.lock"
flock "$vllm_lock"
wheel="$cache/wheels/$VLLM_WHEEL"
if ! echo "$VLLM_SHA256  $wheel" | sha256sum -c --status 2>/dev/null; then
  shared="$target/consumers/wheels/$VLLM_WHEEL"
  if echo "$VLLM_SHA256  $shared" | sha256sum -c --status 2>/dev/null; then
    cp "$shared" "$wheel"
  else
    echo "--- pip download vllm==$VLLM_VERSION --no-deps"
    rm -f "$wheel"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux_2_28_x86_64 --python-version 3.11 "vllm==$VLLM_VERSION" -d "$cache/wheels"
  fi
  echo "$VLLM_SHA256  $wheel" | sha256sum -c --quiet
fi
want="$VLLM_VERSION $VLLM_SHA256 ${VLLM_IMPORTS[*]} $torch_site"
if [ "$(cat "$vllm_venv/.marconi-installed" 2>/dev/null)" != "$want" ]; then
  echo "--- $vllm_venv: vllm==$VLLM_VERSION --no-deps over $venv"
  start=$SECONDS
  rm -rf "$vllm_venv"
  "$python" -m venv "$vllm_venv"
  vsite="$("$vllm_venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
  echo "$torch_site" >"$vsite/_marconi_torch_venv.pth"
  "$vllm_venv/bin/python" -m pip install --quiet --no-deps "$wheel"
  # pip's resolver warns that torch and transformers differ from vLLM's pins
  # (on purpose, see above); the import check below is what counts.
  "$vllm_venv/bin/python" -m pip install --quiet "${VLLM_IMPORTS[@]}" 2>&1 \
    | grep -v "^vllm $VLLM_VERSION requires\|dependency resolver\|dependency conflicts" || true
  "$vllm_venv/bin/python" -c '
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.config import ModelConfig'
  echo "$want" >"$vllm_venv/.marconi-installed"
  echo "installed in $((SECONDS - start)) s"
fi
flock -u "$vllm_lock"
exec {vllm_lock}>&-
