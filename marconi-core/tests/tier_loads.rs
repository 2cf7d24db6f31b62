//! A lower tier's hit gives the engine the KV of every token it skips: the
//! device hit's pages (the only device pages a lease names), then the
//! loads, with no gap between them. The case that had one: the device
//! still holds a chain's KV but not its state (a document served from the
//! host, its state there not promoted), so its KV match passes its hit;
//! the loads started at that match, and the engine held no page for the
//! KV between the hit and the match.

use marconi_core::{
    AlphaMode, CacheConfig, LoadWhat, ModelSpec, SavedState, Tier, TierConfig, TierSpec,
    TieredCache, WriteMode,
};

const PAGE: u32 = 4;

fn cfg(bytes: u64) -> CacheConfig {
    let mut c = CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), bytes);
    c.page_size = PAGE;
    c.checkpoint_grid = PAGE;
    c.min_branch_depth = 0;
    c.alpha = AlphaMode::Fixed(1.0);
    c
}

/// Documents of 6 pages, each asked with a fresh question and answer, in
/// `order`, through a device that holds about two of them and a host that
/// holds all; every lower-tier hit's KV checked for a gap.
fn run(write: WriteMode, order: &[u32]) -> u32 {
    let m = ModelSpec::preset("paper-7b").unwrap();
    let chain = 32 * m.kv_bytes_per_token() + 2 * m.state_bytes();
    let mut t = TierConfig::marconi(
        Some(TierSpec {
            cache: cfg(100 * chain),
            bandwidth_bytes_per_s: 1e15,
            latency_s: 0.0,
        }),
        None,
    );
    t.write = write;
    t.always_load = true;
    let mut c = TieredCache::new(cfg(2 * chain + chain / 2), t).unwrap();
    let (mut next_id, mut fresh, mut lower) = (0u32, 1_000_000u32, 0);
    for &d in order {
        let mut full: Vec<u32> = (0..6 * PAGE).map(|i| d * 10_000 + i).collect();
        full.extend(fresh..fresh + 2 * PAGE);
        fresh += 2 * PAGE;
        let input = full.len() - PAGE as usize;
        let l = c.lookup(0, &full[..input]).unwrap();
        let have = l.device.kv_pages.len() as u32 * PAGE;
        if l.tier != Tier::Device {
            lower += 1;
            let mut covered = have;
            for o in &l.loads {
                if let LoadWhat::Kv { start, end, .. } = o.what {
                    assert!(
                        start <= covered,
                        "KV {covered}..{start} has no page and no load"
                    );
                    covered = covered.max(end);
                }
            }
            assert!(
                covered >= l.hit_tokens,
                "KV to {covered} of a hit of {}",
                l.hit_tokens
            );
        }
        let mut pages = l.device.kv_pages.clone();
        while pages.len() < full.len() / PAGE as usize {
            next_id += 1;
            pages.push(next_id);
        }
        let mut states: Vec<SavedState> = c
            .device()
            .states_to_save(&l.device, full.len())
            .into_iter()
            .filter(|s| s.position > l.hit_tokens)
            .collect();
        for s in &mut states {
            next_id += 1;
            s.slot = Some(next_id);
        }
        c.admit(&l, &full, &states, &pages).unwrap();
        c.release(&l).unwrap();
        c.check_invariants();
    }
    lower
}

#[test]
fn a_lower_hit_past_the_device_kv_match_loads_the_kv_the_engine_lacks() {
    for write in [WriteMode::Back, WriteMode::Through] {
        let lower = run(write, &[1, 1, 2, 3, 4, 5, 6, 7, 1, 1, 2, 2, 1]);
        assert!(lower >= 2, "{write:?}: {lower} lower-tier hits");
    }
}
