//! Host tier memory: the host pool's handles (its own pool id: refused by a
//! device pool and the reverse, stale once freed), demote/promote between a
//! memfd-backed device pool and the host pool (bytes survive round trips;
//! a bad pair refuses the whole batch, nothing copied), and the executor of
//! core's tier decisions (every host load reads back the bytes demoted for
//! that very chain).

use marconi_core::{
    CacheConfig, LoadWhat, ModelSpec, Tier, TierConfig, TierSpec, TieredCache, WriteMode,
};
use marconi_gpu::host::{HostPool, HostPoolConfig, MoveError, Side, UnitMemory};
use marconi_gpu::phys::{BackedPool, MemfdBackend};
use marconi_gpu::tiers::{move_chains, HostTier, LoadCopy, LoadTarget, TierMoveError};
use marconi_gpu::{
    AllocError, DualPool, DualPoolConfig, MigrationPolicy, PoolAllocator, PoolKind, VirtualHandle,
};
use proptest::prelude::*;

const PAGE: u64 = 4096;
const STATE: u64 = 64 << 10;

fn device(total: u64, page: u64, state: u64) -> BackedPool<MemfdBackend> {
    let dual = DualPool::new(
        "device",
        DualPoolConfig {
            total_bytes: total,
            ssm_ratio: 0.5 + 0.5 / total as f64,
            kv_unit: page,
            ssm_unit: state,
            policy: MigrationPolicy::Static,
        },
    )
    .unwrap();
    let chunks = usize::try_from(total / (2 << 20)).unwrap();
    BackedPool::new(dual, MemfdBackend::new(chunks).unwrap()).unwrap()
}

fn host(total: u64, page: u64, state: u64) -> HostPool {
    HostPool::new(HostPoolConfig::new(total, page, state)).unwrap()
}

fn alloc<A: PoolAllocator>(a: &mut A, kind: PoolKind, n: u32) -> Vec<VirtualHandle> {
    let mut v = Vec::new();
    a.allocate(kind, n, &mut v).unwrap();
    v
}

fn host_alloc(h: &mut HostPool, kind: PoolKind, n: u32) -> Vec<VirtualHandle> {
    let mut v = Vec::new();
    h.allocate(kind, n, &mut v).unwrap();
    v
}

/// Deterministic bytes for a seed.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn read_dev(d: &BackedPool<MemfdBackend>, h: VirtualHandle) -> Vec<u8> {
    let mut out = vec![0u8; d.resolve(h).unwrap().unit_bytes as usize];
    d.read_unit(h, 0, &mut out).unwrap();
    out
}

fn read_host(p: &HostPool, h: VirtualHandle) -> Vec<u8> {
    let mut out = vec![0u8; p.resolve(h).unwrap().unit_bytes as usize];
    p.read_unit(h, 0, &mut out).unwrap();
    out
}

#[test]
fn capacity_is_rounded_to_chunks_and_counted() {
    let p = HostPool::new(HostPoolConfig {
        capacity_bytes: (8 << 20) + 12_345,
        state_fraction: 0.25,
        page_bytes: PAGE,
        state_bytes: STATE,
        chunk_bytes: 0,
    })
    .unwrap();
    let s = p.stats();
    assert_eq!(s.capacity_bytes, 8 << 20);
    assert_eq!(s.state_capacity, (2 << 20) / STATE as u32);
    assert_eq!(s.page_capacity, (6 << 20) / PAGE as u32);
    assert_eq!((s.pages_live, s.states_live, s.bytes_demoted), (0, 0, 0));
    if !cfg!(feature = "cuda") {
        assert!(!s.pinned, "a build without CUDA never page-locks");
    } else if std::env::var("MARCONI_REQUIRE_GPU").as_deref() == Ok("1") {
        // scripts/gpu-check.sh: on a GPU machine a cuda build page-locks.
        assert!(s.pinned, "a cuda build with a GPU page-locks the host pool");
    }
    for bad in [
        HostPoolConfig::new(2 << 20, PAGE, STATE),
        HostPoolConfig::new(8 << 20, 0, STATE),
        HostPoolConfig::new(8 << 20, PAGE, 0),
        HostPoolConfig::new(8 << 20, PAGE, 5 << 20),
        HostPoolConfig {
            state_fraction: 1.0,
            ..HostPoolConfig::new(8 << 20, PAGE, STATE)
        },
        HostPoolConfig {
            chunk_bytes: 1000,
            ..HostPoolConfig::new(8 << 20, PAGE, STATE)
        },
    ] {
        assert!(
            matches!(HostPool::new(bad), Err(AllocError::InvalidConfig(_))),
            "{bad:?} not refused as a configuration error"
        );
    }
}

#[test]
fn host_and_device_handles_are_refused_by_the_other_pool_and_stale_once_freed() {
    let mut dev = device(8 << 20, PAGE, STATE);
    let mut hp = host(8 << 20, PAGE, STATE);
    let d = alloc(&mut dev, PoolKind::Ssm, 1)[0];
    let h = host_alloc(&mut hp, PoolKind::Ssm, 1)[0];
    assert_ne!(d.pool_id(), h.pool_id());
    assert_eq!(hp.resolve(d), Err(AllocError::ForeignHandle(d.raw())));
    assert_eq!(dev.resolve(h), Err(AllocError::ForeignHandle(h.raw())));
    assert_eq!(hp.free(&[d]), Err((0, AllocError::ForeignHandle(d.raw()))));
    // All or nothing: a bad handle after a good one frees neither.
    let pages = host_alloc(&mut hp, PoolKind::Kv, 2);
    assert!(hp.free(&[pages[0], d]).is_err());
    assert!(hp.free(&[pages[0], pages[0]]).is_err());
    assert_eq!(hp.stats().pages_live, 2);
    hp.free(&pages).unwrap();
    assert_eq!(
        hp.resolve(pages[0]),
        Err(AllocError::DoubleFree(pages[0].raw()))
    );
    // Reallocated: the old handle is stale, the new one is not it.
    let again = host_alloc(&mut hp, PoolKind::Kv, 2);
    assert!(!again.contains(&pages[0]) && !again.contains(&pages[1]));
    assert_eq!(
        hp.resolve(pages[1]),
        Err(AllocError::StaleHandle(pages[1].raw()))
    );
    // A device handle in a move is refused on its side, nothing copied.
    hp.write_unit(h, 0, &pattern(1, STATE as usize)).unwrap();
    let err = hp.demote(&dev, &[(h, h)]).unwrap_err();
    assert!(matches!(
        err,
        MoveError::Handle {
            index: 0,
            side: Side::Source,
            ..
        }
    ));
    let err = hp.promote(&mut dev, &[(h, h)]).unwrap_err();
    assert!(matches!(
        err,
        MoveError::Handle {
            side: Side::Destination,
            ..
        }
    ));
    assert_eq!(read_host(&hp, h), pattern(1, STATE as usize));
    assert_eq!(hp.stats().units_moved, 0);
}

#[test]
fn a_bad_pair_refuses_the_whole_batch() {
    let mut dev = device(8 << 20, PAGE, STATE);
    let mut hp = host(8 << 20, PAGE, STATE);
    let ds = alloc(&mut dev, PoolKind::Ssm, 2);
    let dk = alloc(&mut dev, PoolKind::Kv, 2);
    let hs = host_alloc(&mut hp, PoolKind::Ssm, 2);
    let hk = host_alloc(&mut hp, PoolKind::Kv, 2);
    for (i, &h) in ds.iter().chain(&dk).enumerate() {
        let n = dev.resolve(h).unwrap().unit_bytes as usize;
        dev.write_unit(h, 0, &pattern(i as u64 + 10, n)).unwrap();
    }
    let zeros: Vec<Vec<u8>> = hs.iter().chain(&hk).map(|&h| read_host(&hp, h)).collect();
    let stale = {
        let h = host_alloc(&mut hp, PoolKind::Kv, 1)[0];
        hp.free(&[h]).unwrap();
        h
    };
    let cases: Vec<(Vec<(VirtualHandle, VirtualHandle)>, &str)> = vec![
        (vec![(ds[0], hs[0]), (dk[0], hs[1])], "kind"),
        (vec![(ds[0], hs[0]), (ds[1], hs[0])], "duplicate"),
        (vec![(dk[0], hk[0]), (dk[1], stale)], "stale"),
        (vec![(ds[0], hs[0]), (hk[0], hk[1])], "foreign source"),
    ];
    for (pairs, what) in cases {
        assert!(hp.demote(&dev, &pairs).is_err(), "{what} accepted");
        let now: Vec<Vec<u8>> = hs.iter().chain(&hk).map(|&h| read_host(&hp, h)).collect();
        assert_eq!(now, zeros, "{what}: bytes moved on a refused batch");
    }
    // Sizes are checked: a host pool of other page size refuses the pair.
    let mut other = host(8 << 20, PAGE * 2, STATE);
    let ok = host_alloc(&mut other, PoolKind::Kv, 1)[0];
    assert!(matches!(
        other.demote(&dev, &[(dk[0], ok)]),
        Err(MoveError::SizeMismatch { index: 0, .. })
    ));
    assert_eq!(hp.stats().units_moved, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    /// Random demote/promote round trips: after each step every unit holds
    /// exactly the bytes a model of both pools predicts.
    #[test]
    fn bytes_survive_demote_promote_round_trips(
        steps in proptest::collection::vec((any::<bool>(), 0u32..6, 0u32..6, any::<u64>(), any::<bool>()), 1..24),
    ) {
        let mut dev = device(8 << 20, PAGE, STATE);
        let mut hp = host(8 << 20, PAGE, STATE);
        let dev_units: Vec<VirtualHandle> = [alloc(&mut dev, PoolKind::Ssm, 6), alloc(&mut dev, PoolKind::Kv, 6)].concat();
        let host_units: Vec<VirtualHandle> = [host_alloc(&mut hp, PoolKind::Ssm, 6), host_alloc(&mut hp, PoolKind::Kv, 6)].concat();
        let mut dev_model: Vec<Vec<u8>> = dev_units.iter().map(|&h| read_dev(&dev, h)).collect();
        let mut host_model: Vec<Vec<u8>> = host_units.iter().map(|&h| read_host(&hp, h)).collect();
        let (mut demoted, mut promoted) = (0u64, 0u64);
        for (down, a, b, seed, kv) in steps {
            let off = if kv { 6 } else { 0 };
            let (i, j) = ((a + off) as usize, (b + off) as usize);
            // Fresh bytes on the side read, so each move is observable.
            let bytes = pattern(seed, dev_model[i].len());
            if down {
                dev.write_unit(dev_units[i], 0, &bytes).unwrap();
                dev_model[i] = bytes;
                let n = hp.demote(&dev, &[(dev_units[i], host_units[j])]).unwrap();
                host_model[j] = dev_model[i].clone();
                demoted += n;
            } else {
                hp.write_unit(host_units[j], 0, &bytes).unwrap();
                host_model[j] = bytes;
                let n = hp.promote(&mut dev, &[(host_units[j], dev_units[i])]).unwrap();
                dev_model[i] = host_model[j].clone();
                promoted += n;
            }
            for (k, &h) in dev_units.iter().enumerate() {
                prop_assert_eq!(&read_dev(&dev, h), &dev_model[k]);
            }
            for (k, &h) in host_units.iter().enumerate() {
                prop_assert_eq!(&read_host(&hp, h), &host_model[k]);
            }
        }
        let s = hp.stats();
        prop_assert_eq!((s.bytes_demoted, s.bytes_promoted), (demoted, promoted));
    }

    /// A batch with one bad handle anywhere copies nothing.
    #[test]
    fn a_foreign_or_stale_handle_anywhere_refuses_the_batch(n in 1usize..8, bad_at in 0usize..8, stale in any::<bool>()) {
        let bad_at = bad_at % n;
        let mut dev = device(8 << 20, PAGE, STATE);
        let mut hp = host(8 << 20, PAGE, STATE);
        let d = alloc(&mut dev, PoolKind::Kv, n as u32);
        let mut h = host_alloc(&mut hp, PoolKind::Kv, n as u32);
        for (i, &x) in d.iter().enumerate() {
            dev.write_unit(x, 0, &pattern(i as u64, PAGE as usize)).unwrap();
        }
        let before: Vec<Vec<u8>> = h.iter().map(|&x| read_host(&hp, x)).collect();
        h[bad_at] = if stale {
            let x = host_alloc(&mut hp, PoolKind::Kv, 1)[0];
            hp.free(&[x]).unwrap();
            x
        } else {
            d[bad_at]
        };
        let pairs: Vec<_> = d.iter().copied().zip(h.iter().copied()).collect();
        let refused = hp.demote(&dev, &pairs);
        prop_assert!(
            matches!(refused, Err(MoveError::Handle { side: Side::Destination, index, .. }) if index == bad_at),
            "{:?}", refused
        );
        for (k, &x) in h.iter().enumerate() {
            if k != bad_at {
                prop_assert_eq!(&read_host(&hp, x), &before[k]);
            }
        }
    }
}

fn model() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

fn chain_bytes(tokens: u64) -> u64 {
    let m = model();
    tokens * m.kv_bytes_per_token() + m.state_bytes()
}

fn workload(sessions: u32, turns: u32, seed: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let system: Vec<u32> = (0..40).map(|i| 1_000_000 + i).collect();
    let mut hist: Vec<Vec<u32>> = vec![system.clone(); sessions as usize];
    let mut out = Vec::new();
    for _ in 0..turns {
        for h in hist.iter_mut() {
            let n = 10 + rnd() % 60;
            h.extend((0..n).map(|_| rnd() % 50_000));
            let reply: Vec<u32> = (0..(5 + rnd() % 30)).map(|_| rnd() % 50_000).collect();
            out.push((h.clone(), reply.clone()));
            h.extend(reply);
        }
    }
    out
}

/// FNV-1a of a namespace and tokens: the seed of a chain's bytes.
fn chain_seed(ns: u64, tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ ns;
    for &t in tokens {
        for b in t.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Small units for the executor test: the decisions come from core's
/// model, the bytes only need to tell chains apart.
const T_PAGE: u64 = 64;
const T_STATE: u64 = 256;

/// Writes what the device would hold for `chain` (its state, and each page's
/// KV, a function of the tokens up to the page's end) into fresh device
/// units and returns them.
fn device_chain(
    dev: &mut BackedPool<MemfdBackend>,
    ns: u64,
    chain: &[u32],
    page_tokens: u32,
) -> (VirtualHandle, Vec<VirtualHandle>) {
    let n = chain.len().div_ceil(page_tokens as usize);
    let state = alloc(dev, PoolKind::Ssm, 1)[0];
    dev.write_unit(state, 0, &pattern(chain_seed(ns, chain), T_STATE as usize))
        .unwrap();
    let pages = alloc(dev, PoolKind::Kv, n as u32);
    for (i, &p) in pages.iter().enumerate() {
        let end = ((i + 1) * page_tokens as usize).min(chain.len());
        let seed = chain_seed(ns, &chain[..end]) ^ 0x5555;
        dev.write_unit(p, 0, &pattern(seed, T_PAGE as usize))
            .unwrap();
    }
    (state, pages)
}

fn free_dev(dev: &mut BackedPool<MemfdBackend>, state: VirtualHandle, pages: &[VirtualHandle]) {
    dev.free(state).unwrap();
    for &p in pages {
        dev.free(p).unwrap();
    }
}

/// Demotes the moves drained since the last call; returns how many.
fn settle_moves(
    c: &mut TieredCache,
    tier: &mut HostTier,
    dev: &mut BackedPool<MemfdBackend>,
    page_tokens: u32,
    write: WriteMode,
    admitted: Option<(u64, &[u32])>,
) -> usize {
    let events = c.drain_device_events();
    let moves = c.drain_moves();
    let chains = move_chains(&moves, &events, write, admitted);
    let mut done = 0;
    for (m, chain) in moves.iter().zip(chains) {
        let Some(chain) = chain else { continue };
        let (s, p) = device_chain(dev, m.ns, chain, page_tokens);
        if done % 2 == 0 {
            tier.demote(m, chain, &*dev, s, &p).unwrap();
        } else {
            // As an engine that owns its memory: units, then its own copies.
            let e = tier.demote_units(m, chain).unwrap();
            assert_eq!(e.pages.len(), p.len());
            for (&d, &h) in std::iter::once(&s)
                .zip([&e.state])
                .chain(p.iter().zip(&e.pages))
            {
                let bytes = read_dev(dev, d);
                let (at, len) = tier.pool().unit_span(h).unwrap();
                assert_eq!(len as usize, bytes.len());
                // SAFETY: a live host unit of `len` bytes, mapped while its
                // handle is live; nothing else touches it during the copy.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, bytes.len())
                };
            }
        }
        free_dev(dev, s, &p);
        done += 1;
    }
    done
}

/// Core decides (a real `TieredCache`: device, host and store tiers), the
/// executor moves bytes: every host load the lookups order finds its chain
/// and reads back exactly the bytes demoted for it, and after every request
/// the executor holds only chains core's host tier holds. Returns the
/// requests that loaded from the host and the chains demoted.
fn serve_with_host_tier(
    seed: u32,
    dev_tokens: u64,
    host_mult: u64,
    page_tokens: u32,
    through: bool,
) -> Result<(usize, usize), TestCaseError> {
    let write = if through {
        WriteMode::Through
    } else {
        WriteMode::Back
    };
    let mut dev_cfg = CacheConfig::marconi(model(), chain_bytes(dev_tokens));
    dev_cfg.page_size = page_tokens;
    dev_cfg.events = true;
    let mut host_cfg = CacheConfig::marconi(model(), chain_bytes(dev_tokens) * host_mult);
    host_cfg.page_size = page_tokens;
    let mut store_cfg = host_cfg.clone();
    store_cfg.capacity_bytes *= 2;
    let spec = |cache: CacheConfig, gbps: f64| TierSpec {
        cache,
        bandwidth_bytes_per_s: gbps * 1e9,
        latency_s: 10e-6,
    };
    let mut tiers = TierConfig::marconi(Some(spec(host_cfg, 25.0)), Some(spec(store_cfg, 5.0)));
    tiers.write = write;
    let mut c = TieredCache::new(dev_cfg, tiers).unwrap();
    let mut dev = device(64 << 20, T_PAGE, T_STATE);
    let mut tier = HostTier::new(host(256 << 20, T_PAGE, T_STATE), page_tokens).unwrap();
    let (mut loads, mut demoted) = (0, 0);
    for (input, output) in workload(6, 5, seed) {
        let mut full = input.clone();
        full.extend(&output);
        let l = c.lookup(0, &input).unwrap();
        let host_state = l
            .loads
            .iter()
            .any(|o| o.tier == Tier::Host && matches!(o.what, LoadWhat::State { .. }));
        let host_kv: Vec<(u32, u32)> = l
            .loads
            .iter()
            .filter(|o| o.tier == Tier::Host)
            .filter_map(|o| match o.what {
                LoadWhat::Kv { start, end, .. } => Some((start, end)),
                LoadWhat::State { .. } => None,
            })
            .collect();
        if host_state || !host_kv.is_empty() {
            let hit = l.hit_tokens;
            let rs = alloc(&mut dev, PoolKind::Ssm, 1)[0];
            let rp = alloc(&mut dev, PoolKind::Kv, hit.div_ceil(page_tokens));
            if loads % 2 == 0 {
                let moved = tier.load(0, &input, &l.loads, &mut dev, rs, &rp);
                prop_assert!(moved.is_ok(), "host load refused: {:?}", moved);
            } else {
                // As an engine that owns its memory: orders, its own copies.
                let copies = tier.load_units(0, &input, &l.loads);
                prop_assert!(copies.is_ok(), "host load refused: {:?}", copies);
                for c in copies.unwrap() {
                    let dst = match c.to {
                        LoadTarget::State => rs,
                        LoadTarget::Page(i) => rp[i as usize],
                    };
                    dev.write_unit(dst, 0, &read_host(tier.pool(), c.from))
                        .unwrap();
                }
            }
            if host_state {
                prop_assert_eq!(
                    read_dev(&dev, rs),
                    pattern(chain_seed(0, &input[..hit as usize]), T_STATE as usize)
                );
            }
            for (start, end) in host_kv {
                // Whole pages only: a page the range ends inside holds
                // the covering chain's later tokens.
                for p in (start / page_tokens)..(end / page_tokens) {
                    let upto = ((p + 1) * page_tokens) as usize;
                    let want = pattern(chain_seed(0, &input[..upto]) ^ 0x5555, T_PAGE as usize);
                    prop_assert_eq!(read_dev(&dev, rp[p as usize]), want, "page {}", p);
                }
            }
            free_dev(&mut dev, rs, &rp);
            loads += 1;
        }
        let mut states = c.device().states_to_save(&l.device, full.len());
        states.retain(|s| {
            s.position > l.hit_tokens || (s.position == l.hit_tokens && l.tier != Tier::Device)
        });
        c.admit(&l, &full, &states, &[]).unwrap();
        demoted += settle_moves(
            &mut c,
            &mut tier,
            &mut dev,
            page_tokens,
            write,
            Some((0, &full)),
        );
        c.release(&l).unwrap();
        demoted += settle_moves(&mut c, &mut tier, &mut dev, page_tokens, write, None);
        tier.sync(c.tier(Tier::Host).unwrap());
        let held = c.tier(Tier::Host).unwrap().cached_chains().states;
        prop_assert!(tier.len() <= held.len());
        let s = tier.pool().stats();
        prop_assert_eq!(s.states_live as usize, tier.len());
    }
    Ok((loads, demoted))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]

    #[test]
    fn host_loads_read_back_the_bytes_demoted_for_their_chain(
        seed in 0u32..1000,
        dev_tokens in 200u64..1200,
        host_mult in 2u64..6,
        page_tokens in prop_oneof![Just(1u32), Just(4), Just(16)],
        through in any::<bool>(),
    ) {
        serve_with_host_tier(seed, dev_tokens, host_mult, page_tokens, through)?;
    }
}

#[test]
fn the_workload_demotes_and_loads_from_the_host() {
    for (page_tokens, through) in [(1, false), (16, false), (4, true)] {
        let (loads, demoted) = serve_with_host_tier(350, 244, 5, page_tokens, through).unwrap();
        assert!(
            loads > 0 && demoted > 0,
            "page {page_tokens}, through {through}: {loads} loads, {demoted} demotions"
        );
    }
}

#[test]
fn tier_moves_refuse_bad_input_and_change_nothing() {
    let mut dev = device(8 << 20, T_PAGE, T_STATE);
    let mut tier = HostTier::new(host(8 << 20, T_PAGE, T_STATE), 4).unwrap();
    assert!(HostTier::new(host(8 << 20, T_PAGE, T_STATE), 0).is_err());
    let chain: Vec<u32> = (0..10).collect();
    let (s, p) = device_chain(&mut dev, 7, &chain, 4);
    let mv = marconi_core::Move {
        to: Tier::Host,
        ns: 7,
        position: 10,
        bytes: 1,
    };
    let store_mv = marconi_core::Move {
        to: Tier::Store,
        ..mv.clone()
    };
    assert_eq!(
        tier.demote(&store_mv, &chain, &dev, s, &p),
        Err(TierMoveError::NotHost(Tier::Store))
    );
    assert!(matches!(
        tier.demote(&mv, &chain[..9], &dev, s, &p),
        Err(TierMoveError::ChainLength { .. })
    ));
    assert!(matches!(
        tier.demote(&mv, &chain, &dev, s, &p[..2]),
        Err(TierMoveError::PageCount {
            needed: 3,
            given: 2
        })
    ));
    // A page handle in the state's place: refused, nothing left allocated.
    assert!(matches!(
        tier.demote(&mv, &chain, &dev, p[0], &p),
        Err(TierMoveError::Move(MoveError::KindMismatch { .. }))
    ));
    assert_eq!(tier.len(), 0);
    assert_eq!(
        (
            tier.pool().stats().states_live,
            tier.pool().stats().pages_live
        ),
        (0, 0)
    );
    assert_eq!(
        tier.demote_units(&store_mv, &chain),
        Err(TierMoveError::NotHost(Tier::Store))
    );
    assert!(matches!(
        tier.demote_units(&mv, &chain[..3]),
        Err(TierMoveError::ChainLength { .. })
    ));
    assert_eq!(tier.len(), 0);
    tier.demote(&mv, &chain, &dev, s, &p).unwrap();
    assert_eq!(tier.len(), 1);
    // The same chain again: its units, not new ones.
    let held = tier.entry(7, &chain).unwrap().clone();
    assert_eq!(tier.demote_units(&mv, &chain), Ok(held.clone()));
    assert_eq!(tier.pool().stats().states_live, 1);
    // Loads: a chain not held is a miss, an order past the input refused.
    let state_order = |position| marconi_core::LoadOrder {
        tier: Tier::Host,
        what: LoadWhat::State {
            position,
            slot: None,
        },
        bytes: T_STATE,
    };
    let rs = alloc(&mut dev, PoolKind::Ssm, 1)[0];
    let before = read_dev(&dev, rs);
    assert_eq!(
        tier.load(7, &chain, &[state_order(9)], &mut dev, rs, &[]),
        Err(TierMoveError::Missing { ns: 7, end: 9 })
    );
    assert_eq!(
        tier.load(8, &chain, &[state_order(10)], &mut dev, rs, &[]),
        Err(TierMoveError::Missing { ns: 8, end: 10 })
    );
    assert!(matches!(
        tier.load(7, &chain, &[state_order(11)], &mut dev, rs, &[]),
        Err(TierMoveError::BeyondInput { .. })
    ));
    assert_eq!(
        tier.load_units(7, &chain, &[state_order(9)]),
        Err(TierMoveError::Missing { ns: 7, end: 9 })
    );
    let kv = marconi_core::LoadOrder {
        tier: Tier::Host,
        what: LoadWhat::Kv {
            start: 4,
            end: 10,
            pages: Vec::new(),
        },
        bytes: 2 * T_PAGE,
    };
    assert_eq!(
        tier.load_units(7, &chain, &[kv, state_order(10)]),
        Ok(vec![
            LoadCopy {
                from: held.pages[1],
                to: LoadTarget::Page(1)
            },
            LoadCopy {
                from: held.pages[2],
                to: LoadTarget::Page(2)
            },
            LoadCopy {
                from: held.state,
                to: LoadTarget::State
            },
        ])
    );
    assert_eq!(read_dev(&dev, rs), before);
    assert_eq!(
        tier.load(7, &chain, &[state_order(10)], &mut dev, rs, &[]),
        Ok(T_STATE)
    );
    assert_eq!(read_dev(&dev, rs), read_dev(&dev, s));
    // The device's handles are not the host's: unit_span refuses them.
    assert!(tier.pool().unit_span(s).is_err());
}
