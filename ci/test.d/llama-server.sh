#!/usr/bin/env bash
# llama-server with libmarconi, side by side with stock llama-server
# (examples/llama-server): builds llama.cpp's server from the pinned sources
# of ci/test.d/llama-engine.sh (same source tree and cmake build directory
# under $CARGO_TARGET_DIR/llama.cpp, so the llama + ggml libraries are
# shared) with server.patch applied, CPU only, -j2; writes the random-weight
# hybrid GGUF; then runs examples/llama-server/side_by_side.py on a short
# workload: servers with prompt caching off, stock and libmarconi, greedy
# replies compared with `off` (tokens and logprobs), prompt tokens from the
# servers' own timings, then a concurrent phase (several clients, a request
# cancelled mid-prompt, a client disconnecting) after which libmarconi must
# hold no lease and no stray state. Fails unless libmarconi processes fewer
# prompt tokens than stock with replies identical to `off`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS="${CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS:-true}"
start=$SECONDS
echo "--- examples/llama-server/build.sh"
examples/llama-server/build.sh >/dev/null
echo "built in $((SECONDS - start)) s"
echo "--- side by side: off, stock, libmarconi (short workload)"
python3 examples/llama-server/side_by_side.py --requests 16 --sessions 5 --mib 4 --parallel 3 --clients 4
echo "llama-server step: $((SECONDS - start)) s"
