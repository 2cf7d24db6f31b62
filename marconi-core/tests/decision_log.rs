//! The decision log of small scripted traces, rendered as text. Each
//! snapshot was read line by line against the rules of paper §4.

use insta::assert_snapshot;
use marconi_core::{AlphaMode, CacheConfig, ModelSpec, PrefixCache, TunerConfig};

const KV: u64 = 65_536;
const STATE: u64 = 26_787_840;

fn render(c: &mut PrefixCache, reqs: &[(Vec<u32>, Vec<u32>)]) -> String {
    let mut out = String::new();
    for (i, o) in reqs {
        c.serve(0, i, o).unwrap();
        c.check_invariants();
        for d in c.drain_log() {
            out += &d.to_string();
            out.push('\n');
        }
    }
    out
}

fn r(parts: &[(u32, u32)]) -> Vec<u32> {
    parts.iter().flat_map(|&(a, b)| a..b).collect()
}

#[test]
fn branch_checkpoint_multi_turn_and_eviction() {
    // A system prompt (0..64) shared by two sessions; the second session's
    // first request plans the branch at 64; the third request hits it; the
    // first session's next turn extends its leaf; the cache holds 5 states
    // and 400 tokens, so the last request evicts.
    let cfg = CacheConfig {
        alpha: AlphaMode::Fixed(1.0),
        decision_log: true,
        ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 5 * STATE + 400 * KV)
    };
    let mut c = PrefixCache::new(cfg).unwrap();
    let reqs = vec![
        (r(&[(0, 64), (100, 120)]), r(&[(200, 210)])),
        (r(&[(0, 64), (300, 330)]), r(&[(400, 405)])),
        (r(&[(0, 64), (500, 540)]), r(&[(600, 610)])),
        (
            r(&[(0, 64), (100, 120), (200, 210), (700, 720)]),
            r(&[(800, 805)]),
        ),
        (r(&[(1000, 1150)]), r(&[])),
    ];
    assert_snapshot!(render(&mut c, &reqs));
}

#[test]
fn alpha_tuning_rounds_are_logged() {
    // A tiny window (4 requests after the first eviction) so that the log
    // shows a tuning round, with where it lands among the other decisions;
    // the tuner keeps α = 0 unless another α beats it.
    let cfg = CacheConfig {
        decision_log: true,
        alpha: AlphaMode::Auto(TunerConfig {
            grid: vec![0.0, 1.0, 4.0],
            bootstrap_factor: 1,
            min_window: 4,
            threads: 2,
            // Adopted two requests after the window closes.
            apply_after: 2,
            ..TunerConfig::default()
        }),
        ..CacheConfig::marconi(
            ModelSpec::preset("paper-7b").unwrap(),
            3 * STATE + 3000 * KV,
        )
    };
    let mut c = PrefixCache::new(cfg).unwrap();
    // A long document asked about repeatedly, interleaved with one-off requests.
    let mut reqs = Vec::new();
    for q in 0..6u32 {
        reqs.push((
            r(&[(0, 2000), (10_000 + q * 100, 10_000 + q * 100 + 20)]),
            vec![],
        ));
        reqs.push((r(&[(50_000 + q * 1000, 50_000 + q * 1000 + 300)]), vec![]));
    }
    let log = render(&mut c, &reqs);
    let shown: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("alpha") || l.starts_with("evict") || l.starts_with("lookup"))
        .collect();
    assert_snapshot!(shown.join("\n"));
}
