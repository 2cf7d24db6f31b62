#!/usr/bin/env bash
# Runs llama-server (llama.cpp's, patched by server.patch) on a small
# random-weight hybrid model (default Nemotron-H: Mamba-2 + attention layers;
# --model granite-hybrid, falcon-h1 or qwen35 for those families' layouts),
# in the
# foreground on 127.0.0.1:PORT; /health answers when it is ready. Builds what
# is missing first (examples/llama-server/build.sh, cached under the target
# dir).
#
#   serve.sh --port P --cache marconi|stock|off [--parallel N] [--mib M]
#            [--model nemotron-h|granite-hybrid|falcon-h1|qwen35] [-- extra llama-server args]
#
# With --cache marconi the extra arguments may give libmarconi's options,
# e.g. -- --marconi-store DIR|redis://127.0.0.1:PORT (docs/llama-server.md).
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

port="" cache="" parallel=1 mib=8 model=nemotron-h extra=()
usage() { echo "usage: serve.sh --port P --cache marconi|stock|off [--parallel N] [--mib M] [--model nemotron-h|granite-hybrid|falcon-h1|qwen35] [-- llama-server args]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="${2:-}"; shift 2 ;;
    --cache) cache="${2:-}"; shift 2 ;;
    --parallel) parallel="${2:-}"; shift 2 ;;
    --mib) mib="${2:-}"; shift 2 ;;
    --model) model="${2:-}"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) usage ;;
  esac
done
[[ "$port" =~ ^[0-9]+$ ]] && [[ "$parallel" =~ ^[1-9][0-9]*$ ]] && [[ "$mib" =~ ^[0-9]+$ ]] || usage
case "$cache" in marconi|stock|off) ;; *) usage ;; esac
# One recurrent state (llama_state_seq_get_size_ext with
# LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, as stock's checkpoints store it), in
# KiB: per Mamba-2 layer 4 B x (512 x 64 SSM + 768 x 3 conv) = 137 KiB.
case "$model" in
  nemotron-h) CKPT_KIB=412 ;;      # 3 Mamba-2 layers
  granite-hybrid) CKPT_KIB=824 ;;  # 6
  falcon-h1) CKPT_KIB=549 ;;       # 4
  qwen35) CKPT_KIB=421 ;;          # 6 gated delta net layers, 4 B x (256 x 64 + 512 x 3) = 70 KiB each
  *) usage ;;
esac

out="$("$here/build.sh" | tail -1)"

# Stock's 32 checkpoints per slot may hold 32 x CKPT_KIB.
ckpts=32

args=(--model "$out/tiny-$model.gguf" --host 127.0.0.1 --port "$port" --parallel "$parallel"
      --ctx-size $((4096 * parallel)) --threads 2 --seed 0 --no-warmup --metrics --flash-attn off)
case "$cache" in
  marconi) args+=(--marconi --marconi-mib $((mib + (ckpts * parallel * CKPT_KIB + 1023) / 1024))) ;;
  stock)   args+=(--cache-ram "$mib" --ctx-checkpoints "$ckpts") ;;
  off)     args+=(--cache-ram 0 --ctx-checkpoints 0 --no-cache-prompt) ;;
esac
exec "$out/llama-server" "${args[@]}" "${extra[@]}"
