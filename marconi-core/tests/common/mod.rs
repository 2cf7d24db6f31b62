//! Helpers shared by the tuning and shadow tests.

/// KV bytes per token of paper-7b.
pub(crate) const KV: u64 = 65_536;
/// State bytes of paper-7b.
pub(crate) const STATE: u64 = 26_787_840;

/// Long documents asked about again and again, interleaved with bursts of
/// short one-off requests that push them out of an LRU cache (FLOP-aware
/// eviction with a large α keeps the documents).
pub(crate) fn workload() -> Vec<Vec<u32>> {
    let mut reqs = Vec::new();
    let mut q = 0u32;
    for round in 0..40u32 {
        for doc in 0..3u32 {
            let mut r: Vec<u32> = (doc * 100_000..doc * 100_000 + 3000).collect();
            r.extend(1_000_000 + q * 50..1_000_000 + q * 50 + 30);
            q += 1;
            reqs.push(r);
        }
        for k in 0..8u32 {
            let base = 5_000_000 + (round * 8 + k) * 1000;
            reqs.push((base..base + 300).collect());
        }
    }
    reqs
}
