//! Rule choice by shadow caches (`ShadowConfig`): the cache adopts the
//! rules of the shadow that does best, logs it, keeps its invariants, and
//! behaves the same through the engine's calls as through `serve`.

use marconi_core::{
    AlphaMode, CacheConfig, CacheError, Decision, EvictionPolicy, ModelSpec, PrefixCache,
    ShadowConfig, Stats, TunerConfig,
};

mod common;
use common::{workload, KV, STATE};

fn model() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

fn capacity() -> u64 {
    10 * STATE + 9_500 * KV
}

fn shadowed(base: CacheConfig, shadows: ShadowConfig) -> CacheConfig {
    CacheConfig {
        alpha: AlphaMode::Auto(TunerConfig {
            shadows: Some(shadows),
            ..TunerConfig::default()
        }),
        decision_log: true,
        ..base
    }
}

/// Serves the workload with `serve`; stats and the decision log.
fn run(cfg: CacheConfig) -> (Stats, Vec<Decision>) {
    let mut c = PrefixCache::new(cfg).unwrap();
    let mut log = Vec::new();
    for r in workload() {
        c.serve(0, &r, &[]).unwrap();
        c.check_invariants();
        log.extend(c.drain_log());
    }
    (c.stats(), log)
}

/// Starting from plain LRU, the shadows find that FLOP-aware eviction at
/// α = 2 keeps the documents, and the cache switches to it (logged), ending
/// with more hits than plain LRU.
#[test]
fn the_cache_adopts_the_rules_of_the_best_shadow() {
    let (lru, _) = run(CacheConfig::sglang_plus(model(), capacity()));
    let cfg = shadowed(
        CacheConfig::sglang_plus(model(), capacity()),
        ShadowConfig {
            alphas: vec![2.0],
            tuned: false,
            ..ShadowConfig::default()
        },
    );
    assert_eq!(cfg.eviction, EvictionPolicy::Lru);
    let (s, log) = run(cfg);
    let switched: Vec<&Decision> = log
        .iter()
        .filter(|d| matches!(d, Decision::Rules { lru: false, .. }))
        .collect();
    assert!(!switched.is_empty(), "never left LRU");
    assert!(log
        .iter()
        .any(|d| matches!(d, Decision::Alpha { new, .. } if *new == 2.0)));
    assert!(s.tuning_rounds >= 1);
    assert!(
        s.hit_tokens > lru.hit_tokens,
        "shadowed {} vs lru {}",
        s.hit_tokens,
        lru.hit_tokens
    );
}

/// Requests served through lookup, admit and release reach the shadows as
/// whole requests: the same decisions as `serve`.
#[test]
fn the_engine_path_and_serve_agree() {
    let cfg = shadowed(
        CacheConfig::marconi(model(), capacity()),
        ShadowConfig::default(),
    );
    let (served, served_log) = run(cfg.clone());
    let mut c = PrefixCache::new(cfg).unwrap();
    let mut log = Vec::new();
    for r in workload() {
        let l = c.lookup(0, &r).unwrap();
        let states = c.states_to_save(&l, r.len());
        c.admit(l.lease, &r, &states, &[]).unwrap();
        c.release(l.lease).unwrap();
        c.check_invariants();
        log.extend(c.drain_log());
    }
    assert_eq!(c.stats(), served);
    assert_eq!(log, served_log);
}

/// Above `exact_bytes` the shadows see a hashed sample of the requests at
/// a scaled capacity: the cache serves every request, keeps its invariants
/// and stays deterministic.
#[test]
fn sampled_shadows_serve() {
    let cfg = shadowed(
        CacheConfig::marconi(model(), capacity()),
        ShadowConfig {
            alphas: vec![0.0, 2.0],
            exact_bytes: capacity() / 2,
            sample_tokens: 8,
            ..ShadowConfig::default()
        },
    );
    let (s, log) = run(cfg.clone());
    assert_eq!(s.requests, workload().len() as u64);
    assert!(s.evictions > 0);
    assert_eq!(run(cfg), (s, log));
}

#[test]
fn bad_shadow_configurations_are_refused() {
    let bad = |s: ShadowConfig| {
        let cfg = shadowed(CacheConfig::marconi(model(), capacity()), s);
        assert!(matches!(
            PrefixCache::new(cfg),
            Err(CacheError::InvalidConfig(_))
        ));
    };
    bad(ShadowConfig {
        alphas: vec![f64::NAN],
        ..ShadowConfig::default()
    });
    bad(ShadowConfig {
        alphas: vec![-1.0],
        ..ShadowConfig::default()
    });
    bad(ShadowConfig {
        hysteresis: f64::INFINITY,
        ..ShadowConfig::default()
    });
    bad(ShadowConfig {
        exact_bytes: 0,
        ..ShadowConfig::default()
    });
    bad(ShadowConfig {
        sample_tokens: 0,
        ..ShadowConfig::default()
    });
    bad(ShadowConfig {
        alphas: vec![],
        tuned: false,
        lru: false,
        ..ShadowConfig::default()
    });
}
