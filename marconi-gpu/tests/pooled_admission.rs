//! Admission over pools under every admission policy: the final state (the
//! admitted length rounded down to the page size) is admissible also where
//! an all-blocks block is larger than the page.

use marconi_core::{CacheConfig, ModelSpec};
use marconi_gpu::pooled::{dual_pool, PoolLayout, PooledCache, PooledState};

const PAGE: u32 = 4;

fn cache(cfg: CacheConfig) -> PooledCache<marconi_gpu::DualPool> {
    // Handles and offsets only (no backing memory): 64 GiB hold a few
    // thousand 7B states and pages.
    let pool = dual_pool(
        &cfg.model,
        PAGE,
        64 << 30,
        PoolLayout::Static { ssm_fraction: 0.5 },
    )
    .unwrap();
    PooledCache::new(cfg, pool).unwrap()
}

#[test]
fn the_final_state_between_block_boundaries_is_admitted_over_pools() {
    let model = ModelSpec::preset("paper-7b").unwrap();
    let mut c = cache(CacheConfig {
        page_size: PAGE,
        ..CacheConfig::vllm_plus(model, 32 << 30, 8)
    });
    let input: Vec<u32> = (0..20).collect();
    let l = c.lookup(0, &input).unwrap();
    assert_eq!(l.lookup.plan, vec![8, 16]);
    // 20 input + 10 decoded tokens: 7 whole pages, states at the block
    // boundaries 8, 16, 24 and the final position 28.
    let full: Vec<u32> = (0..30).collect();
    let r = c.reserve(7, 4).unwrap();
    let states: Vec<PooledState> = [8, 16, 24, 28]
        .iter()
        .zip(&r.state_slots)
        .map(|(&position, &slot)| PooledState { position, slot })
        .collect();
    let a = c
        .admit(l.lookup.lease, &full, &states, &r.kv_pages)
        .unwrap();
    assert_eq!(a.taken.len(), 11);
    assert!(a.returned.is_empty());
    c.release(l.lookup.lease).unwrap();
    c.check_invariants();
    let next: Vec<u32> = (0..40).collect();
    let l = c.lookup(0, &next).unwrap();
    assert_eq!(l.lookup.hit_tokens, 28);
    assert_eq!(l.state_slot, Some(r.state_slots[3]));
    c.release(l.lookup.lease).unwrap();
    c.check_invariants();
}
