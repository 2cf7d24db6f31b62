#!/usr/bin/env bash
# llama-server with libmarconi, side by side with stock llama-server
# (examples/llama-server), on the tiny random-weight hybrid model:
#  1. three `serve.sh --cache marconi|stock|off` started at once, as a user
#     runs the side by side: on a fresh machine the first builds (the
#     pinned llama.cpp sources via `pip download`, shared with
#     ci/test.d/llama-engine.sh under $CARGO_TARGET_DIR/llama.cpp, patched
#     with server.patch, CPU, -j2) and the others wait on build.sh's lock;
#     all three must answer a chat request;
#  2. side_by_side.py, chat workload: replies of libmarconi equal to `off`
#     (tokens and logprobs), fewer prompt tokens than stock, a regenerate
#     resumed at its end and an edit at the deepest state before it, then a
#     concurrent phase (a request cancelled mid-prompt, a client
#     disconnecting) that must leave no lease and no stray state;
#  3. the agent workload (tool calls, thinking stripped, timestamps):
#     fewer prompt tokens than stock, replies equal `off`, no resume past
#     an edit;
#  4. the negative control: every restored state corrupted (zeroed SSM
#     state) must change the logprobs;
#  5. the store: a server restarted on a directory store, a second server
#     on the first's Redis (redis-server started here on 127.0.0.1),
#     corrupted/truncated/swapped objects, another model's identity, Redis
#     killed: misses and replies equal to `off`;
#  6. the Granite 4.0 hybrid, Falcon-H1 and Qwen3.5 (gated delta net)
#     layouts: a short side by side each.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS="${CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS:-true}"
target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
logs="$target/llama-server/ci"
mkdir -p "$logs"
python="${PYTHON:-python3}"
start=$SECONDS

if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  echo "--- apt-get install redis-server"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi

echo "--- three serve.sh at once: marconi, stock, off (the first builds what is missing, the others wait)"
pids=()
stop_all() {
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$p" 2>/dev/null || true
  done
  pids=()
}
trap stop_all EXIT
ports=()
for cache in marconi stock off; do
  port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  ports+=("$port")
  setsid examples/llama-server/serve.sh --port "$port" --cache "$cache" >"$logs/serve-$cache.log" 2>&1 &
  pids+=($!)
done
"$python" - "${ports[@]}" <<'PY'
import json, sys, time, urllib.request
ports = [int(p) for p in sys.argv[1:]]
end = time.monotonic() + 3600  # a cold build of llama.cpp's server on 2 cores
t0 = time.monotonic()
for port in ports:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        if time.monotonic() > end:
            sys.exit(f"server on port {port} not ready in an hour")
        time.sleep(0.5)
for port in ports:
    body = json.dumps({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["choices"][0]["message"]["content"] is not None, out
print(f"all three answered, {time.monotonic() - t0:.0f} s after their start")
PY
stop_all
grep -h -e "--- waiting for another" -e "llama-server built in" "$logs"/serve-*.log || true
echo "three servers: $((SECONDS - start)) s"

sbs=(examples/llama-server/side_by_side.py --logdir "$logs")
echo "--- side by side, chat workload: off, stock, libmarconi"
"$python" "${sbs[@]}" --requests 16 --sessions 5 --mib 4 --parallel 3 --clients 4 | tee "$logs/readme-chat.txt"
echo "--- side by side, agent workload (tool calls, thinking stripped, timestamps)"
"$python" "${sbs[@]}" --workload agent --requests 12 --sessions 2 --mib 8 --clients 0
echo "--- negative control: every restored state's SSM state zeroed"
"$python" "${sbs[@]}" --requests 8 --sessions 2 --negative zero-ssm
echo "--- the store: restart, sharing, bad objects, another model, a dead Redis"
"$python" "${sbs[@]}" --stores --requests 8 --sessions 2 | tee "$logs/readme-stores.txt"
# The README's figures of these two runs (its examples table; ci/test.d/readme.sh
# compares them): the sequential phase's prompt tokens (1 slot, greedy: the
# same on every run) and the share of the hit tokens resumed from a store.
mkdir -p "$target/readme-figures"
"$python" - "$logs/readme-chat.txt" "$logs/readme-stores.txt" "$target/readme-figures/llama-server.json" \
  "${MARCONI_CI_RUN:-}" "$(git rev-parse HEAD 2>/dev/null || true)" <<'PY'
import json, re, sys, time
chat, stores = open(sys.argv[1]).read(), open(sys.argv[2]).read()
seq = chat.split("\nsequential, 1 slot", 1)[1].split("\n\n", 1)[0]
prompt_n = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(off|stock|marconi) +(\d+) +(\d+) ", seq, re.M)}
n = re.search(r": (\d+) requests over (\d+) sessions", chat)
pct = lambda name: re.search(r"^%s .*?hit tokens +\d+ \(([\d.]+)%% of \d+\)" % re.escape(name), stores, re.M)
restart, redis = pct("restarted on the directory store (phase 2)"), pct("second server on the first's Redis (phase 2)")
assert set(prompt_n) == {"off", "stock", "marconi"} and n and restart and redis, \
    "side_by_side.py's output lost a line readme-figures reads"
json.dump({"step": "ci/test.d/llama-server.sh", "run": sys.argv[4], "commit": sys.argv[5],
           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "figures": {"requests": int(n.group(1)), "prompt_n_marconi": prompt_n["marconi"],
                       "prompt_n_stock": prompt_n["stock"],
                       "restart_pct": round(float(restart.group(1))), "redis_pct": round(float(redis.group(1)))}},
          open(sys.argv[3], "w"), indent=1)
PY
for model in granite-hybrid falcon-h1 qwen35; do
  echo "--- side by side on the $model layout (chat workload, short)"
  "$python" "${sbs[@]}" --model "$model" --requests 10 --sessions 3 --mib 4 --clients 0
done
echo "llama-server step: $((SECONDS - start)) s"
