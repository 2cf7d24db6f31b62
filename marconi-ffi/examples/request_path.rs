//! The request path through the C ABI, as SGLang's tree cache drives it:
//! `marconi_cache_lookup_i64_flags` (MARCONI_LOOKUP_NO_KV_PAGES),
//! `marconi_cache_lease_kv_pages`, `marconi_cache_admit_i64` with one page
//! id per token, `marconi_cache_release`, `marconi_cache_drain_freed`, on
//! marconi-core's `request_path` workload (8 interleaved conversations whose
//! inputs reach about 10,000 tokens, 100-token messages and replies, 200
//! requests, 100 GB: no evictions). A plain cache (no tiers) by default;
//! `--tiers` adds a host tier of the same size (nothing is demoted: no
//! evictions). New pages are numbered in order by default; `--free-list`
//! draws them from a shuffled free list of 2^21 pages instead, as an
//! engine's allocator hands pages out after frees (a request's pages then
//! are in no order).
//!
//! `cargo run --release -p marconi-ffi --example request_path [-- --repeat N]
//! [--tokens T] [--tiers] [--free-list]`. Prints wall µs per request, best and median of
//! the runs (a fresh cache each run).

use std::mem::{size_of, MaybeUninit};
use std::ptr;
use std::time::Instant;

use marconi::cache::*;
use marconi::config::*;
use marconi::status::marconi_status;
use marconi::tiered::*;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }

    fn tokens(&mut self, n: u32) -> Vec<i64> {
        (0..n).map(|_| i64::from(self.next() % 100_000)).collect()
    }
}

/// (input, input + output) per request, conversations interleaved (the
/// workload of marconi-core/benches/request_path.rs).
fn requests(tokens: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    let (conversations, turns, turn) = (8usize, 25usize, 100u32);
    let start = tokens
        .saturating_sub(turn as usize * turns)
        .max(turn as usize) as u32;
    let mut rng = Lcg(1);
    let mut history: Vec<Vec<i64>> = (0..conversations).map(|_| rng.tokens(start)).collect();
    let mut out = Vec::new();
    for _ in 0..turns {
        for h in &mut history {
            let mut input = h.clone();
            input.extend(rng.tokens(turn));
            let mut full = input.clone();
            full.extend(rng.tokens(turn));
            h.clone_from(&full);
            out.push((input, full));
        }
    }
    out
}

fn ok(s: marconi_status) {
    assert_eq!(s, marconi_status::Ok);
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
    let tiers = args.iter().any(|a| a == "--tiers");
    let free_list: Option<Vec<i64>> = args.iter().any(|a| a == "--free-list").then(|| {
        let mut ids: Vec<i64> = (1..=1i64 << 21).collect();
        let mut rng = Lcg(7);
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.next() as usize % (i + 1));
        }
        ids
    });
    let reqs = requests(arg("--tokens", 10_000));
    let repeat = arg("--repeat", 20).max(1);
    let mean_input = reqs.iter().map(|r| r.0.len()).sum::<usize>() / reqs.len();
    let mut runs: Vec<f64> = (0..repeat)
        .map(|_| {
            let mut cfg = MaybeUninit::<marconi_cache_config>::uninit();
            // SAFETY: cfg has its size in writable bytes.
            ok(unsafe {
                marconi_cache_config_init(cfg.as_mut_ptr(), size_of::<marconi_cache_config>())
            });
            // SAFETY: initialised above.
            let mut cfg = unsafe { cfg.assume_init() };
            cfg.capacity_bytes = 100 << 30;
            let mut o = MaybeUninit::<marconi_tier_options>::uninit();
            if tiers {
                // SAFETY: o has its size in writable bytes.
                ok(unsafe {
                    marconi_tier_options_init(o.as_mut_ptr(), size_of::<marconi_tier_options>())
                });
                // SAFETY: initialised above.
                let o = unsafe { o.assume_init_mut() };
                o.host.capacity_bytes = 100 << 30;
                cfg.tiers = o;
            }
            let mut c = ptr::null_mut();
            // SAFETY: a valid config and out.
            ok(unsafe { marconi_cache_new(&cfg, &mut c) });
            let mut pages: Vec<i64> = Vec::new();
            let mut next_page = 0usize;
            let mut buf = vec![0u32; 1 << 16];
            let (mut freed_p, mut freed_s) = (vec![0u32; 1 << 16], vec![0u32; 1 << 10]);
            let t = Instant::now();
            for (k, (input, full)) in reqs.iter().enumerate() {
                let mut l = marconi_lookup::default();
                // SAFETY: valid handle, ids and out.
                ok(unsafe {
                    marconi_cache_lookup_i64_flags(
                        c,
                        0,
                        input.as_ptr(),
                        input.len(),
                        MARCONI_NO_SLOT,
                        MARCONI_LOOKUP_NO_KV_PAGES,
                        &mut l,
                    )
                });
                let mut n = 0usize;
                // SAFETY: buf has its length in elements.
                ok(unsafe {
                    marconi_cache_lease_kv_pages(c, l.lease, buf.as_mut_ptr(), buf.len(), &mut n)
                });
                pages.clear();
                pages.extend(buf[..n].iter().map(|&p| i64::from(p)));
                while pages.len() < full.len() {
                    next_page += 1;
                    pages.push(
                        free_list
                            .as_ref()
                            .map_or(next_page as i64, |f| f[next_page]),
                    );
                }
                let state = marconi_saved_state {
                    position: full.len() as u32,
                    slot: k as u32 + 1,
                };
                let mut r = marconi_admit_result::default();
                // SAFETY: valid handle, lease, arrays and out.
                ok(unsafe {
                    marconi_cache_admit_i64(
                        c,
                        l.lease,
                        full.as_ptr(),
                        full.len(),
                        &state,
                        1,
                        pages.as_ptr(),
                        pages.len(),
                        ptr::null_mut(),
                        &mut r,
                    )
                });
                // SAFETY: valid handle and lease.
                ok(unsafe { marconi_cache_release(c, l.lease) });
                let (mut np, mut ns) = (0usize, 0usize);
                // SAFETY: buffers of the sizes given.
                ok(unsafe {
                    marconi_cache_drain_freed(
                        c,
                        freed_p.as_mut_ptr(),
                        freed_p.len(),
                        &mut np,
                        freed_s.as_mut_ptr(),
                        freed_s.len(),
                        &mut ns,
                    )
                });
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / reqs.len() as f64;
            // SAFETY: from marconi_cache_new, freed once.
            unsafe { marconi_cache_free(c) };
            us
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    println!(
        "C ABI request path (lookup_i64_flags + lease_kv_pages + admit_i64 + release + \
         drain_freed){}{}, {} requests, {mean_input} input tokens on average, paper-7b, {repeat} \
         runs: best {:.2} µs, median {:.2} µs per request",
        if tiers { ", host tier" } else { "" },
        if free_list.is_some() {
            ", pages from a free list"
        } else {
            ""
        },
        reqs.len(),
        runs[0],
        runs[runs.len() / 2],
    );
}
