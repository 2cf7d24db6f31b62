"""scripts/publisher-startup.py (MARCONI_LIBRARY=LIB): median ms to start a publisher (CacheEvents with a PUB and a replay
ROUTER on 127.0.0.1 free ports) and to close it, over 30 rounds."""
import statistics, time, marconi
c = marconi.PrefixCache(capacity_bytes=1 << 30, model="paper-7b", page_size=4)
start, stop = [], []
for _ in range(30):
    t0 = time.perf_counter()
    ev = marconi.CacheEvents(c, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    t1 = time.perf_counter()
    ev.close()
    t2 = time.perf_counter()
    start.append(t1 - t0); stop.append(t2 - t1)
print(f"publisher start median {statistics.median(start)*1e3:.2f} ms, close median {statistics.median(stop)*1e3:.2f} ms")
c.close()
