//! The library's own work per engine request on long inputs: `lookup`,
//! `admit` (input + output, the final state) and `release` through
//! `PrefixCache`, as the C ABI calls them, on the workload of
//! `python-shim/bench/bench_adapter.py` (8 interleaved conversations whose
//! inputs reach about 10,000 tokens, 100-token messages and replies,
//! 200 requests, 100 GB of capacity: no evictions).
//!
//! `cargo bench -p marconi-core --bench request_path` (seconds;
//! `-- --tokens T` for T-token inputs, `-- --repeat N` for N runs). Prints
//! wall µs per request, the best and the median of the runs (a fresh cache
//! each run; on a busy machine the median includes time other processes
//! took, the best is the library's cost). What ctypes and the Python
//! wrappers add comes on top (the adapter bench's "C ABI alone").

use std::time::Instant;

use marconi_core::{CacheConfig, ModelSpec, PrefixCache, SavedState};

mod common;
use common::Lcg;

/// (input, input + output) per request, conversations interleaved.
fn requests(tokens: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    let (conversations, turns, turn) = (8usize, 25usize, 100u32);
    let start = tokens
        .saturating_sub(turn as usize * turns)
        .max(turn as usize) as u32;
    let mut rng = Lcg(1);
    let mut history: Vec<Vec<u32>> = (0..conversations).map(|_| rng.tokens(start)).collect();
    let mut out = Vec::new();
    for _ in 0..turns {
        for h in &mut history {
            let mut input = h.clone();
            input.extend(rng.tokens(turn));
            let mut full = input.clone();
            full.extend(rng.tokens(turn));
            *h = full.clone();
            out.push((input, full));
        }
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(default)
    };
    let reqs = requests(arg("--tokens", 10_000));
    let repeat = arg("--repeat", 20).max(1);
    let mean_input = reqs.iter().map(|r| r.0.len()).sum::<usize>() / reqs.len();
    let model = ModelSpec::preset("paper-7b").expect("preset");
    let mut runs: Vec<f64> = (0..repeat)
        .map(|_| {
            let mut c =
                PrefixCache::new(CacheConfig::marconi(model.clone(), 100 << 30)).expect("config");
            let t = Instant::now();
            for (k, (input, full)) in reqs.iter().enumerate() {
                let l = c.lookup(0, input).expect("lookup");
                let state = SavedState {
                    position: full.len() as u32,
                    slot: Some(k as u32 + 1),
                };
                c.admit(l.lease, full, &[state], &[]).expect("admit");
                c.release(l.lease).expect("release");
            }
            t.elapsed().as_secs_f64() * 1e6 / reqs.len() as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    println!(
        "request path (lookup + admit + release), {} requests, {mean_input} input tokens on \
         average, paper-7b, {repeat} runs: best {:.2} µs, median {:.2} µs per request",
        reqs.len(),
        runs[0],
        runs[runs.len() / 2],
    );
}
