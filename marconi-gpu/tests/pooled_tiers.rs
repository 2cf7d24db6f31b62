//! The cache over pools with lower tiers (`PooledCache::with_tiers`): an
//! engine model over memfd-backed pools carries out every tier op and load
//! with bytes. Each KV page and state holds bytes derived from the tokens
//! it covers (what a recompute would write), so every device hit, every
//! host write and every load is checked against what it must hold; the
//! joined invariants are checked after every request; the event stream
//! follows the device's states. Write-back tiers and deferred moves are
//! refused.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use marconi_core::{
    AlphaMode, CacheConfig, LoadWhat, Tier, TierConfig, TierOp, TierSpec, WriteMode,
};
use marconi_gpu::phys::{BackedPool, MemfdBackend};
use marconi_gpu::pooled::{dual_pool, PoolLayout, PooledCache, PooledError, PooledState};
use marconi_gpu::{PoolAllocator, VirtualHandle};

mod common;
use common::tiny;

const PAGE: u32 = 4;
const BUDGET: u64 = 24 << 10;
const GRAN: usize = 4096;

fn cfg() -> CacheConfig {
    let mut c = CacheConfig::marconi(tiny(), 1);
    c.page_size = PAGE;
    c.min_branch_depth = 0;
    c.alpha = AlphaMode::Fixed(1.0);
    c
}

fn tiers(write: WriteMode) -> TierConfig {
    let mut host = cfg();
    host.capacity_bytes = 4 << 20;
    let mut t = TierConfig::marconi(
        Some(TierSpec {
            cache: host,
            bandwidth_bytes_per_s: 25e9,
            latency_s: 1e-5,
        }),
        None,
    );
    t.write = write;
    // The tiny model recomputes faster than any load: load anyway.
    t.always_load = true;
    t
}

type Backed = BackedPool<MemfdBackend>;

fn backed() -> Backed {
    let mut pool = dual_pool(
        &tiny(),
        PAGE,
        BUDGET,
        PoolLayout::Static {
            ssm_fraction: 0.3334,
        },
    )
    .unwrap();
    pool.set_migration_step_bytes(GRAN as u64);
    let chunks = (BUDGET as usize) / GRAN;
    BackedPool::new(pool, MemfdBackend::with_granularity(chunks, GRAN).unwrap()).unwrap()
}

/// Bytes of `len` derived from `tokens` and a salt.
fn content(tokens: &[u32], salt: u64, len: usize) -> Vec<u8> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tokens.hash(&mut h);
    salt.hash(&mut h);
    let mut x = h.finish() | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// What page `i` of a sequence starting with `tokens` holds.
fn kv(tokens: &[u32], i: usize) -> Vec<u8> {
    content(&tokens[..(i + 1) * PAGE as usize], 0x6b76, 512)
}

/// What the state after `tokens` holds.
fn state(tokens: &[u32]) -> Vec<u8> {
    content(tokens, 0x5747, 2048)
}

fn read(c: &PooledCache<Backed>, h: VirtualHandle) -> Vec<u8> {
    let mut out = vec![0u8; c.pool().unit_bytes(h.pool()) as usize];
    c.pool().read_unit(h, 0, &mut out).unwrap();
    out
}

fn write(c: &mut PooledCache<Backed>, h: VirtualHandle, data: &[u8]) {
    let n = c.pool().unit_bytes(h.pool()) as usize;
    assert!(data.len() <= n);
    c.pool_mut().write_unit(h, 0, data).unwrap();
}

/// A chain's bytes held by the engine in a lower tier.
#[derive(Clone)]
struct Copy {
    state: Vec<u8>,
    pages: Vec<Vec<u8>>,
}

#[derive(Default)]
struct Engine {
    /// Host and store copies by (namespace, chain).
    lower: [HashMap<(u64, Vec<u32>), Copy>; 2],
    /// Requests whose hit came from the host, with their loads checked.
    host_hits: u32,
    /// Device hits whose pages and state were checked.
    device_hits: u32,
    host_writes: u32,
    drops: u32,
}

fn lower(t: Tier) -> usize {
    match t {
        Tier::Host => 0,
        Tier::Store => 1,
        Tier::Device => panic!("no device copies"),
    }
}

impl Engine {
    /// Carries out `ops`; a host write copies from this admission's units
    /// (`pages`, `states`), as `PooledCache::with_tiers` says.
    fn carry_out(
        &mut self,
        c: &PooledCache<Backed>,
        ops: Vec<TierOp>,
        pages: &[VirtualHandle],
        states: &[PooledState],
    ) {
        for op in ops {
            match op {
                TierOp::Write {
                    to: Tier::Host,
                    ns,
                    position,
                    prefix,
                    ..
                } => {
                    let s = states
                        .iter()
                        .find(|s| s.position == position)
                        .expect("a host write reads a state of the admission that decided it");
                    let n = (position / PAGE) as usize;
                    let copy = Copy {
                        state: read(c, s.slot),
                        pages: pages[..n].iter().map(|&h| read(c, h)).collect(),
                    };
                    assert_eq!(copy.state, state(&prefix), "the state written down");
                    for (i, p) in copy.pages.iter().enumerate() {
                        assert_eq!(p, &kv(&prefix, i), "page {i} written down");
                    }
                    self.lower[0].insert((ns, prefix), copy);
                    self.host_writes += 1;
                }
                TierOp::Write {
                    to: Tier::Store,
                    ns,
                    prefix,
                    ..
                } => {
                    let copy = self.lower[0]
                        .get(&(ns, prefix.clone()))
                        .expect("a store write reads a host copy")
                        .clone();
                    self.lower[1].insert((ns, prefix), copy);
                }
                TierOp::Write { to, .. } => panic!("a write into the {to:?}"),
                TierOp::Drop {
                    from, ns, prefix, ..
                } => {
                    let gone = self.lower[lower(from)].remove(&(ns, prefix));
                    assert!(gone.is_some(), "a drop of a copy the engine never made");
                    self.drops += 1;
                }
            }
        }
    }

    /// One request: lookup, reserve, loads, prefill, admit, ops, free,
    /// release, ops; every byte read checked.
    fn request(&mut self, c: &mut PooledCache<Backed>, ns: u64, full: &[u32], input_len: usize) {
        let l = c.lookup(ns, &full[..input_len]).unwrap();
        let t = l
            .tiered
            .clone()
            .expect("a cache with tiers gives the tiered lookup");
        for (i, &h) in l.kv_pages.iter().enumerate() {
            assert_eq!(read(c, h), kv(full, i), "device page {i}");
        }
        if t.tier == Tier::Device && t.hit_tokens > 0 {
            let s = l.state_slot.expect("a device hit has a state");
            assert_eq!(read(c, s), state(&full[..t.hit_tokens as usize]));
            self.device_hits += 1;
        }
        let mut saves = c.cache().states_to_save(&l.lookup, full.len());
        saves.retain(|s| {
            s.position > t.hit_tokens || (s.position == t.hit_tokens && t.tier != Tier::Device)
        });
        let dev_pages = l.kv_pages.len();
        let full_pages = full.len() / PAGE as usize;
        let r = c
            .reserve((full_pages - dev_pages) as u32, saves.len() as u32)
            .unwrap();
        let mut loaded_state = None;
        let mut loaded_to = dev_pages;
        for o in &t.loads {
            let copies = &self.lower[lower(o.tier)];
            match o.what {
                LoadWhat::Kv { start, end, .. } => {
                    let src = copies
                        .iter()
                        .find(|((n, chain), _)| {
                            *n == ns
                                && chain.len() >= end as usize
                                && chain[..end as usize] == full[..end as usize]
                        })
                        .map(|(_, c)| c.clone())
                        .expect("a KV load reads a chain the engine holds");
                    for i in (start / PAGE) as usize..end.div_ceil(PAGE) as usize {
                        assert_eq!(src.pages[i], kv(full, i), "loaded page {i}");
                        write(c, r.kv_pages[i - dev_pages], &src.pages[i]);
                        loaded_to = loaded_to.max(i + 1);
                    }
                }
                LoadWhat::State { position, .. } => {
                    let src = copies
                        .get(&(ns, full[..position as usize].to_vec()))
                        .expect("a state load reads a chain the engine holds");
                    assert_eq!(src.state, state(&full[..position as usize]));
                    loaded_state = Some(position);
                }
            }
        }
        if t.tier != Tier::Device {
            assert_eq!(
                loaded_state,
                Some(t.hit_tokens),
                "the hit's state was loaded"
            );
            assert!(loaded_to * PAGE as usize >= t.hit_tokens as usize);
            self.host_hits += u32::from(t.tier == Tier::Host);
        }
        // Prefill: the pages past what was reused or loaded, the states.
        for i in loaded_to..full_pages {
            write(c, r.kv_pages[i - dev_pages], &kv(full, i));
        }
        let states: Vec<PooledState> = saves
            .iter()
            .zip(&r.state_slots)
            .map(|(s, &slot)| PooledState {
                position: s.position,
                slot,
            })
            .collect();
        for s in &states {
            write(c, s.slot, &state(&full[..s.position as usize]));
        }
        let mut pages = l.kv_pages.clone();
        pages.extend_from_slice(&r.kv_pages);
        let a = c.admit(l.lookup.lease, full, &states, &pages).unwrap();
        let ops = c.drain_tier_ops();
        self.carry_out(c, ops, &pages, &states);
        c.free(&a.returned).unwrap();
        c.release(l.lookup.lease).unwrap();
        let ops = c.drain_tier_ops();
        assert!(
            !ops.iter()
                .any(|o| matches!(o, TierOp::Write { to: Tier::Host, .. })),
            "a host write outside an admission"
        );
        self.carry_out(c, ops, &[], &[]);
        c.check_invariants();
    }
}

/// `docs` documents of `pages` pages each, every request one of them
/// followed by a fresh question and answer of one page each; with `hot`,
/// document 0 again after each other one.
fn workload(docs: u32, pages: u32, rounds: u32, hot: bool) -> Vec<(Vec<u32>, usize)> {
    let mut out = Vec::new();
    let mut fresh = 1_000_000;
    let order: Vec<u32> = (0..docs)
        .flat_map(|d| if hot { vec![d, 0] } else { vec![d] })
        .collect();
    for r in 0..rounds {
        for &d in &order {
            let mut full: Vec<u32> = (0..pages * PAGE).map(|i| d * 10_000 + i).collect();
            for _ in 0..2 * PAGE {
                full.push(fresh);
                fresh += 1;
            }
            let input = full.len() - PAGE as usize;
            out.push((full, input));
            let _ = r;
        }
    }
    out
}

#[test]
fn host_hits_load_the_bytes_written_down() {
    let mut c = PooledCache::with_tiers(cfg(), tiers(WriteMode::Through), backed()).unwrap();
    c.record_tier_ops(true);
    let mut e = Engine::default();
    // 8 documents of 6 pages cycled: more than the device's ~31 pages.
    for (full, input) in workload(8, 6, 4, false) {
        e.request(&mut c, 7, &full, input);
    }
    assert!(e.host_writes > 0, "nothing was written down");
    assert!(e.host_hits > 0, "no hit came from the host");
    assert_eq!(e.device_hits, 0, "8 documents cycled fit no device");
    let s = c.tiers().unwrap().stats();
    assert_eq!(u64::from(e.host_hits), s.hits_by_tier[Tier::Host.index()]);
    // The same requests over the same pools without tiers skip less.
    let mut plain = PooledCache::new(cfg(), backed()).unwrap();
    for (full, input) in workload(8, 6, 4, false) {
        plain.serve(7, input, &full).unwrap();
    }
    let (with, without) = (s.token_hit_rate(), plain.cache_stats().token_hit_rate());
    assert!(
        with > without + 0.2,
        "hit rate with a host tier {with:.3}, without {without:.3}"
    );
}

#[test]
fn device_and_host_hits_mix() {
    let mut c = PooledCache::with_tiers(cfg(), tiers(WriteMode::Through), backed()).unwrap();
    c.record_tier_ops(true);
    let mut e = Engine::default();
    for (full, input) in workload(8, 6, 4, true) {
        e.request(&mut c, 9, &full, input);
    }
    assert!(
        e.device_hits > 0 && e.host_hits > 0,
        "{} {}",
        e.device_hits,
        e.host_hits
    );
}

#[test]
fn a_store_below_the_host_receives_what_the_host_drops() {
    let mut t = tiers(WriteMode::Through);
    let mut small = cfg();
    // Room for about two documents on the host.
    small.capacity_bytes = 2 * 6 * 4 * 128 + 2 * 2048 + 4096;
    t.host.as_mut().unwrap().cache = small;
    let mut store = cfg();
    store.capacity_bytes = 4 << 20;
    t.store = Some(TierSpec {
        cache: store,
        bandwidth_bytes_per_s: 5e9,
        latency_s: 1e-3,
    });
    let mut c = PooledCache::with_tiers(cfg(), t, backed()).unwrap();
    c.record_tier_ops(true);
    let mut e = Engine::default();
    for (full, input) in workload(8, 6, 4, false) {
        e.request(&mut c, 3, &full, input);
    }
    let s = c.tiers().unwrap().stats();
    assert!(e.drops > 0, "the host dropped nothing");
    assert!(
        s.hits_by_tier[Tier::Store.index()] > 0,
        "no hit came from the store: {s:?}"
    );
}

#[test]
fn write_back_and_deferred_moves_are_refused() {
    let e = PooledCache::with_tiers(cfg(), tiers(WriteMode::Back), backed()).unwrap_err();
    assert!(
        matches!(&e, PooledError::InvalidConfig(m) if m.contains("written through")),
        "{e}"
    );
    let mut t = tiers(WriteMode::Through);
    t.defer_moves = true;
    let e = PooledCache::with_tiers(cfg(), t, backed()).unwrap_err();
    assert!(
        matches!(&e, PooledError::InvalidConfig(m) if m.contains("defer_moves")),
        "{e}"
    );
}

#[test]
fn serve_with_tiers_keeps_the_invariants() {
    let mut c = PooledCache::with_tiers(cfg(), tiers(WriteMode::Through), backed()).unwrap();
    for (full, input) in workload(8, 6, 3, false) {
        let s = c.serve(1, input, &full).unwrap();
        assert!(!s.refused);
        c.check_invariants();
    }
    assert!(c.tiers().unwrap().stats().hits_by_tier[Tier::Host.index()] > 0);
}

#[test]
fn events_over_pools_with_tiers_follow_the_device() {
    use marconi_core::CacheEvent;
    use std::collections::BTreeSet;
    let mut c = PooledCache::with_tiers(cfg(), tiers(WriteMode::Through), backed()).unwrap();
    c.record_tier_ops(true);
    c.enable_events().unwrap();
    let mut e = Engine::default();
    let mut states: BTreeSet<(u64, Vec<u32>)> = BTreeSet::new();
    let (mut stored, mut removed) = (0, 0);
    for (full, input) in workload(8, 6, 3, true) {
        e.request(&mut c, 4, &full, input);
        for ev in c.drain_events() {
            match ev {
                CacheEvent::AllCleared => states.clear(),
                CacheEvent::StateStored {
                    ns,
                    position,
                    prefix,
                } => {
                    stored += 1;
                    assert!(states.insert((ns, prefix[..position as usize].to_vec())));
                }
                CacheEvent::StateRemoved {
                    ns,
                    position,
                    prefix,
                } => {
                    removed += 1;
                    assert!(states.remove(&(ns, prefix[..position as usize].to_vec())));
                }
                _ => {}
            }
        }
        let mut held: Vec<(u64, Vec<u32>)> = c.cache().cached_chains().states;
        held.sort();
        assert_eq!(held, states.iter().cloned().collect::<Vec<_>>());
    }
    assert!(
        stored > 0 && removed > 0,
        "{stored} stored, {removed} removed"
    );
    assert!(e.host_hits > 0);
}

/// A lower tier's hit where the device still holds KV past its own hit:
/// a document loaded from the host (its state there not promoted, its
/// pages admitted) asked again. The engine holds handles for the device
/// hit's pages only (none here), so the loads must bring the KV from
/// there on, not from the device's matched KV past its hit.
#[test]
fn a_lower_hit_over_kv_the_device_matched_loads_that_kv() {
    let mut c = PooledCache::with_tiers(cfg(), tiers(WriteMode::Through), backed()).unwrap();
    c.record_tier_ops(true);
    let mut e = Engine::default();
    // Document 1 twice (a branch at its end: a state there, written down),
    // six others (it leaves the device), then 1 twice.
    let w = workload_of(&[1, 1, 2, 3, 4, 5, 6, 7, 1, 1], 6, 1);
    for (full, input) in &w {
        e.request(&mut c, 9, full, *input);
    }
    assert_eq!(e.host_hits, 2, "document 1 came back from the host twice");
}

/// Requests for the documents of `order` as [`workload`] makes them.
fn workload_of(order: &[u32], pages: u32, rounds: u32) -> Vec<(Vec<u32>, usize)> {
    let mut out = Vec::new();
    let mut fresh = 1_000_000;
    for _ in 0..rounds {
        for &d in order {
            let mut full: Vec<u32> = (0..pages * PAGE).map(|i| d * 10_000 + i).collect();
            for _ in 0..2 * PAGE {
                full.push(fresh);
                fresh += 1;
            }
            let input = full.len() - PAGE as usize;
            out.push((full, input));
        }
    }
    out
}
