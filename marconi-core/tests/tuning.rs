//! α tuning: deterministic whatever the thread count, never adopts an α that
//! did worse than α = 0 on its window, and finds a useful α when FLOP
//! efficiency matters.

use marconi_core::{
    AlphaAdoption, AlphaMode, CacheConfig, Decision, ModelSpec, PrefixCache, Stats, TunerConfig,
};

mod common;
use common::{workload, KV, STATE};

fn run(cfg: CacheConfig) -> (Stats, Vec<Decision>) {
    let mut c = PrefixCache::new(CacheConfig {
        decision_log: true,
        ..cfg
    })
    .unwrap();
    let mut log = Vec::new();
    for r in workload() {
        c.serve(0, &r, &[]).unwrap();
        log.extend(c.drain_log());
    }
    c.check_invariants();
    (c.stats(), log)
}

fn cfg(alpha: AlphaMode) -> CacheConfig {
    CacheConfig {
        alpha,
        ..CacheConfig::marconi(
            ModelSpec::preset("paper-7b").unwrap(),
            10 * STATE + 9_500 * KV,
        )
    }
}

fn tuned(threads: u32) -> CacheConfig {
    cfg(AlphaMode::Auto(TunerConfig {
        threads,
        ..TunerConfig::default()
    }))
}

#[test]
fn tuning_is_deterministic_whatever_the_thread_count() {
    let (s1, l1) = run(tuned(1));
    let (s4, l4) = run(tuned(4));
    assert_eq!(s1, s4);
    assert_eq!(l1, l4);
    assert!(s1.tuning_rounds >= 2, "{} rounds", s1.tuning_rounds);
}

#[test]
fn tuning_finds_that_flop_efficiency_pays_here_and_beats_lru() {
    let (lru, _) = run(cfg(AlphaMode::Fixed(0.0)));
    let (auto, log) = run(tuned(0));
    let adopted: Vec<(f64, f64, f64)> = log
        .iter()
        .filter_map(|d| match d {
            Decision::Alpha {
                new,
                objective_at_zero,
                objective_at_new,
                ..
            } => Some((*new, *objective_at_zero, *objective_at_new)),
            _ => None,
        })
        .collect();
    assert!(!adopted.is_empty());
    for &(new, at_zero, at_new) in &adopted {
        // Never an α that did worse than α = 0 on its window.
        assert!(at_new >= at_zero, "α {new}: {at_new} < {at_zero}");
    }
    assert!(adopted.iter().any(|a| a.0 > 0.0), "{adopted:?}");
    assert!(
        auto.flops_saved > lru.flops_saved * 1.05,
        "tuned {} vs LRU {}",
        auto.flops_saved,
        lru.flops_saved
    );
    // α = 0 until the first eviction: nothing is tuned before it.
    let first_evict = log.iter().position(|d| matches!(d, Decision::Evict { .. }));
    let first_alpha = log.iter().position(|d| matches!(d, Decision::Alpha { .. }));
    assert!(first_evict.unwrap() < first_alpha.unwrap());
}

fn adopting(adoption: AlphaAdoption) -> CacheConfig {
    cfg(AlphaMode::Auto(TunerConfig {
        adoption,
        ..TunerConfig::default()
    }))
}

#[test]
fn deterministic_adoption_is_the_default_and_keeps_the_pinned_results() {
    assert_eq!(
        TunerConfig::default().adoption,
        AlphaAdoption::Deterministic
    );
    let (s, l) = run(tuned(0));
    let (sd, ld) = run(adopting(AlphaAdoption::Deterministic));
    assert_eq!(s, sd);
    assert_eq!(l, ld);
}

#[test]
fn when_ready_adoption_serves_the_workload_and_adopts_once_a_search_ends() {
    let mut c = PrefixCache::new(CacheConfig {
        decision_log: true,
        ..adopting(AlphaAdoption::WhenReady)
    })
    .unwrap();
    let mut adopted = Vec::new();
    let keep = |c: &mut PrefixCache, adopted: &mut Vec<Decision>| {
        adopted.extend(
            c.drain_log()
                .into_iter()
                .filter(|d| matches!(d, Decision::Alpha { .. } | Decision::AlphaKept { .. })),
        );
    };
    for r in workload() {
        c.serve(0, &r, &[]).unwrap();
        keep(&mut c, &mut adopted);
    }
    // When a search ends depends on the machine: go on serving (the last
    // request again) until one has been adopted.
    let last = workload().pop().unwrap();
    while adopted.is_empty() {
        c.serve(0, &last, &[]).unwrap();
        keep(&mut c, &mut adopted);
        std::thread::yield_now();
    }
    c.check_invariants();
    for d in &adopted {
        match d {
            Decision::Alpha {
                objective_at_zero,
                objective_at_new,
                ..
            } => assert!(objective_at_new >= objective_at_zero, "{d}"),
            _ => panic!("a search failed: {d}"),
        }
    }
    assert!(c.stats().tuning_rounds >= 1);
}

/// With `tune_rules`, every round also replays the other eviction rules
/// (protect_branch_states flipped, plain LRU): the search is deterministic
/// whatever the thread count, a rule change is logged and put in force
/// (the configuration says so), the index stays exact (invariants after
/// every request) and the result is never below the window's α = 0 under
/// the rules in force (the same guard as α).
#[test]
fn rule_tuning_is_deterministic_and_keeps_the_cache_consistent() {
    let rules_cfg = |threads: u32| {
        cfg(AlphaMode::Auto(TunerConfig {
            threads,
            tune_rules: true,
            max_window: 40,
            ..TunerConfig::default()
        }))
    };
    let serve_all = |cfg: CacheConfig| {
        let mut c = PrefixCache::new(CacheConfig {
            decision_log: true,
            ..cfg
        })
        .unwrap();
        let mut log = Vec::new();
        for r in workload() {
            c.serve(0, &r, &[]).unwrap();
            c.check_invariants();
            log.extend(c.drain_log());
        }
        (c.stats(), log, c.config().clone())
    };
    let (s1, log1, cfg1) = serve_all(rules_cfg(1));
    let (s4, log4, cfg4) = serve_all(rules_cfg(4));
    assert_eq!(s1, s4);
    assert_eq!(log1, log4);
    assert_eq!(
        (cfg1.eviction, cfg1.protect_branch_states),
        (cfg4.eviction, cfg4.protect_branch_states)
    );
    let rounds: Vec<_> = log1
        .iter()
        .filter_map(|d| match d {
            Decision::Alpha {
                objective_at_zero,
                objective_at_new,
                ..
            } => Some((*objective_at_zero, *objective_at_new)),
            _ => None,
        })
        .collect();
    assert!(rounds.len() >= 2, "{} rounds", rounds.len());
    assert!(rounds.iter().all(|(zero, new)| new >= zero));
    // The last rules logged are the ones in force.
    let last = log1.iter().rev().find_map(|d| match d {
        Decision::Rules {
            lru,
            protect_branch_states,
            ..
        } => Some((*lru, *protect_branch_states)),
        _ => None,
    });
    if let Some((lru, protect)) = last {
        assert_eq!(cfg1.eviction == marconi_core::EvictionPolicy::Lru, lru);
        if !lru {
            assert_eq!(cfg1.protect_branch_states, protect);
        }
    } else {
        assert_eq!(cfg1.eviction, marconi_core::EvictionPolicy::FlopAware);
        assert!(cfg1.protect_branch_states);
    }
}

/// A round logs what the candidates scored on its window, not their
/// totals since the cache started (the replays start from the window's
/// snapshot with its statistics zeroed): a round that keeps the α in force
/// replayed the window exactly as the cache ran it, so its logged score is
/// the FLOPs the cache saved over `requests` consecutive requests before
/// the round, after earlier hits.
#[test]
fn a_round_logs_the_window_score_not_the_total() {
    let mut c = PrefixCache::new(CacheConfig {
        decision_log: true,
        ..cfg(AlphaMode::Auto(TunerConfig {
            grid: vec![1.0],
            threads: 1,
            ..TunerConfig::default()
        }))
    })
    .unwrap();
    let mut saved = vec![0.0];
    let mut kept = Vec::new();
    for r in workload() {
        c.serve(0, &r, &[]).unwrap();
        saved.push(c.stats().flops_saved);
        for d in c.drain_log() {
            if let Decision::Alpha {
                requests,
                old,
                new,
                objective_at_new,
                ..
            } = d
            {
                if old == 1.0 && new == 1.0 {
                    kept.push((saved.len() - 1, requests as usize, objective_at_new));
                }
            }
        }
    }
    assert!(!kept.is_empty(), "no round kept alpha 1");
    for (done, len, score) in kept {
        // Hits before the window: a total would be no window's score.
        assert!(saved[done - len] > 0.0);
        let window = (len..=done).any(|end| {
            let w = saved[end] - saved[end - len];
            (w - score).abs() <= 1e-9 * w.abs().max(1.0)
        });
        assert!(
            window,
            "round after request {done}: {score} is no {len}-request window's score"
        );
    }
}
