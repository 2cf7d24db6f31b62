#!/usr/bin/env bash
# Runs llama-server (llama.cpp's, patched by server.patch) on a small
# random-weight hybrid model (Nemotron-H: Mamba-2 + attention layers), in the
# foreground on 127.0.0.1:PORT; /health answers when it is ready. Builds what
# is missing first (examples/llama-server/build.sh, cached under the target
# dir).
#
#   serve.sh --port P --cache marconi|stock|off [--parallel N] [--mib M] [-- extra llama-server args]
#
#   marconi  the prompt cache delegated to libmarconi (--marconi): one cache
#            for all slots, states saved where libmarconi plans them
#   stock    llama-server's own: per-slot context checkpoints (default 32)
#            and the host prompt cache (--cache-ram)
#   off      no prompt caching at all (cache_prompt off: every prompt from 0)
#
# Memory for saved states (same by default on both caching sides): stock
# gets --cache-ram M MiB plus its default 32 recurrent checkpoints per slot;
# marconi gets M MiB plus the bytes of those checkpoints (32 x N x one
# recurrent state, CKPT_KIB below), as whole sequence states.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

port="" cache="" parallel=1 mib=8 extra=()
usage() { echo "usage: serve.sh --port P --cache marconi|stock|off [--parallel N] [--mib M] [-- llama-server args]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="${2:-}"; shift 2 ;;
    --cache) cache="${2:-}"; shift 2 ;;
    --parallel) parallel="${2:-}"; shift 2 ;;
    --mib) mib="${2:-}"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) usage ;;
  esac
done
[[ "$port" =~ ^[0-9]+$ ]] && [[ "$parallel" =~ ^[1-9][0-9]*$ ]] && [[ "$mib" =~ ^[0-9]+$ ]] || usage
case "$cache" in marconi|stock|off) ;; *) usage ;; esac

out="$("$here/build.sh" | tail -1)"

# One recurrent state of tiny-nemotron-h.gguf (llama_state_seq_get_size_ext
# with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, as stock's checkpoints store it),
# in KiB: the bytes stock's 32 checkpoints per slot may hold.
CKPT_KIB=412
ckpts=32

args=(--model "$out/tiny-nemotron-h.gguf" --host 127.0.0.1 --port "$port" --parallel "$parallel"
      --ctx-size $((4096 * parallel)) --threads 2 --seed 0 --no-warmup --metrics --flash-attn off)
case "$cache" in
  marconi) args+=(--marconi --marconi-mib $((mib + (ckpts * parallel * CKPT_KIB + 1023) / 1024))) ;;
  stock)   args+=(--cache-ram "$mib" --ctx-checkpoints "$ckpts") ;;
  off)     args+=(--cache-ram 0 --ctx-checkpoints 0 --no-cache-prompt) ;;
esac
exec "$out/llama-server" "${args[@]}" "${extra[@]}"
