//! The one lookup, admit and drain (marconi_cache_lookup_with,
//! _admit_with, _drain_with) against every call they stand for, on twin
//! caches driven by the same requests: over ids the engine owns (u32 and
//! int64 ids, hints, flags, the request's own slot), with lower tiers
//! (every tier, and the device's view), over pools with and without
//! tiers; then their refusals, each leaving nothing behind.

use std::mem::size_of;
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::cycle::*;
use marconi::lookup::*;
use marconi::pool::*;
use marconi::pooled::*;
use marconi::status::marconi_status;
use marconi::tiered::*;

mod common;
use common::*;

const PAGE: u32 = 16;
const MODEL: &std::ffi::CStr = c"nemotron-h-8b";

/// A request as both twins receive it: namespace, ids, hints, flags,
/// the request's own slot.
#[derive(Clone)]
struct Req {
    ns: u64,
    tokens: Vec<u32>,
    hints: Vec<u32>,
    flags: u32,
    wide: bool,
    dst_slot: u32,
}

fn req(tokens: &[u32]) -> Req {
    Req {
        ns: 0,
        tokens: tokens.to_vec(),
        hints: Vec::new(),
        flags: 0,
        wide: false,
        dst_slot: MARCONI_NO_SLOT,
    }
}

/// marconi_cache_lookup_with of `r`: (status, result).
fn lookup_with(c: *const marconi_cache, r: &Req) -> (marconi_status, marconi_lookup_result) {
    common::lookup_with(c, r.ns, (&r.tokens, r.wide), &r.hints, r.flags, r.dst_slot)
}

/// The lease's plan and its KV pages (ids, or handles over pools).
fn lease_lists(c: *const marconi_cache, lease: u64, pooled: bool) -> (Vec<u32>, Vec<u64>) {
    let (mut plan, mut n) = (vec![0u32; 4096], 0usize);
    // SAFETY: buffers of their lengths.
    ok(unsafe { marconi_cache_lease_plan(c, lease, plan.as_mut_ptr(), plan.len(), &mut n) });
    plan.truncate(n);
    let pages = if pooled {
        let (mut p, mut n) = (vec![0u64; 4096], 0usize);
        // SAFETY: as above.
        ok(unsafe { marconi_cache_lease_kv_handles(c, lease, p.as_mut_ptr(), p.len(), &mut n) });
        p.truncate(n);
        p
    } else {
        let (mut p, mut n) = (vec![0u32; 4096], 0usize);
        // SAFETY: as above.
        ok(unsafe { marconi_cache_lease_kv_pages(c, lease, p.as_mut_ptr(), p.len(), &mut n) });
        p.into_iter().take(n).map(u64::from).collect()
    };
    (plan, pages)
}

/// Admits `tokens` over ids under `lease`: its hit pages `hit`, then
/// fresh page ids, and a state at each planned position and the final page
/// boundary, in fresh slots; then releases.
fn admit_ids(
    c: *const marconi_cache,
    lease: u64,
    tokens: &[u32],
    plan: &[u32],
    hit: &[u64],
    next: &mut u32,
    with: Option<bool>,
) -> (marconi_admit_result, Vec<u8>) {
    let end = tokens.len() as u32 / PAGE * PAGE;
    let mut positions: Vec<u32> = plan.iter().copied().filter(|&p| p <= end).collect();
    if !positions.contains(&end) {
        positions.push(end);
    }
    let mut fresh = || {
        *next += 1;
        *next
    };
    let slots: Vec<u32> = positions.iter().map(|_| fresh()).collect();
    let mut pages: Vec<u32> = hit.iter().map(|&p| p as u32).collect();
    while pages.len() < (end / PAGE) as usize {
        pages.push(fresh());
    }
    let st = states(&positions, &slots);
    let mut taken = vec![0u8; st.len()];
    let mut out = marconi_admit_result::default();
    match with {
        None => ok(admit(c, lease, tokens, &st, &pages, &mut taken, &mut out)),
        Some(wide) => {
            let units: Vec<(u32, u64)> =
                st.iter().map(|s| (s.position, u64::from(s.slot))).collect();
            let p: Vec<u64> = pages.iter().map(|&p| u64::from(p)).collect();
            let width = if wide {
                marconi_id_width::I64
            } else {
                marconi_id_width::U32
            };
            ok(admit_with(
                c,
                lease,
                (tokens, wide),
                &units,
                &p,
                width as u32,
                Some(&mut taken),
                &mut out,
            ));
        }
    }
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_release(c, lease) });
    (out, taken)
}

/// What a drain gives: ops (kind, tier, ns, position, tokens), freed pages
/// and slots.
type Drained = (Vec<(u32, u32, u64, u32, Vec<u32>)>, Vec<u64>, Vec<u64>);

/// The legacy drains: marconi_cache_drain_ops (with tiers), then
/// marconi_cache_drain_freed or, over pools, _drain_freed_units (split by
/// kind).
fn drain_legacy(c: *const marconi_cache, tiers: bool, pooled: bool) -> Drained {
    let mut ops_out = Vec::new();
    if tiers {
        let (mut ops, mut toks) = (vec![marconi_tier_op::default(); 4096], vec![0u32; 1 << 20]);
        let (st, n, _) = drain_tier_ops(marconi_cache_drain_ops, c, &mut ops, &mut toks);
        ok(st);
        for o in &ops[..n] {
            let at = o.tokens_offset as usize;
            ops_out.push((
                o.kind,
                o.tier,
                o.ns,
                o.position,
                toks[at..at + o.position as usize].to_vec(),
            ));
        }
    }
    if pooled {
        let (mut buf, mut n) = (vec![0u64; 4096], 0usize);
        // SAFETY: buf has its length.
        ok(unsafe { marconi_cache_drain_freed_units(c, buf.as_mut_ptr(), buf.len(), &mut n) });
        buf.truncate(n);
        let (kv, st): (Vec<u64>, Vec<u64>) = buf.into_iter().partition(|&h| {
            marconi_gpu::VirtualHandle::from_raw(h).pool() == marconi_gpu::PoolKind::Kv
        });
        return (ops_out, kv, st);
    }
    let (mut p, mut s) = (vec![0u32; 4096], vec![0u32; 4096]);
    let (st, np, ns) = drain_freed(c, &mut p, &mut s);
    ok(st);
    (
        ops_out,
        p[..np].iter().map(|&v| u64::from(v)).collect(),
        s[..ns].iter().map(|&v| u64::from(v)).collect(),
    )
}

/// marconi_cache_drain_with, after a size query that must give the same
/// counts.
fn drain_one(c: *const marconi_cache) -> Drained {
    let mut d = marconi_drain::default();
    // SAFETY: a size query: every buffer NULL with capacity 0.
    let st = unsafe { marconi_cache_drain_with(c, &mut d) };
    let want = (d.n_ops, d.n_op_tokens, d.n_kv_pages, d.n_state_slots);
    assert!(
        st == marconi_status::Ok && want == (0, 0, 0, 0) || st == marconi_status::BufferTooSmall,
        "{st:?}"
    );
    let b = drain_buffers(&mut d, 0);
    // SAFETY: buffers of the capacities given.
    ok(unsafe { marconi_cache_drain_with(c, &mut d) });
    assert_eq!(
        (d.n_ops, d.n_op_tokens, d.n_kv_pages, d.n_state_slots),
        want
    );
    let DrainBuffers {
        ops,
        toks,
        pages,
        slots,
    } = b;
    let ops = ops
        .iter()
        .map(|o| {
            let at = o.tokens_offset as usize;
            (
                o.kind,
                o.tier,
                o.ns,
                o.position,
                toks[at..at + o.position as usize].to_vec(),
            )
        })
        .collect();
    (ops, pages, slots)
}

/// Admits `tokens` over pools under `lease` (its hit pages `hit`): pages
/// and slots reserved for the rest, the units not taken freed; then
/// releases. Loads are not carried out: these twins compare decisions.
fn admit_pooled(
    c: *const marconi_cache,
    lease: u64,
    tokens: &[u32],
    plan: &[u32],
    hit: &[u64],
    with: bool,
) -> (marconi_admit_result, Vec<u8>) {
    let full = tokens.len() as u32 / PAGE;
    let end = full * PAGE;
    let mut positions: Vec<u32> = plan.iter().copied().filter(|&p| p <= end).collect();
    if !positions.contains(&end) {
        positions.push(end);
    }
    let want = full as usize - hit.len();
    let (mut pages, mut slots) = (vec![0u64; want], vec![0u64; positions.len()]);
    // SAFETY: buffers of their lengths.
    ok(unsafe {
        marconi_cache_reserve(
            c,
            want as u32,
            slots.len() as u32,
            pages.as_mut_ptr(),
            pages.len(),
            slots.as_mut_ptr(),
            slots.len(),
        )
    });
    let all: Vec<u64> = hit.iter().chain(&pages).copied().collect();
    let st = pooled_states(&positions, &slots);
    let mut taken = vec![0u8; st.len()];
    let mut out = marconi_admit_result::default();
    if with {
        let units: Vec<(u32, u64)> = st.iter().map(|s| (s.position, s.state_handle)).collect();
        let width = marconi_id_width::U64 as u32;
        let taken = Some(&mut taken[..]);
        ok(admit_with(
            c,
            lease,
            (tokens, false),
            &units,
            &all,
            width,
            taken,
            &mut out,
        ));
    } else {
        ok(pooled_admit(
            c, lease, tokens, &st, &all, &mut taken, &mut out,
        ));
    }
    let free = untaken(&all, hit.len(), &out, &st, &taken);
    // SAFETY: handles the caller holds.
    ok(unsafe { marconi_cache_free_units(c, free.as_ptr(), free.len()) });
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_release(c, lease) });
    (out, taken)
}

/// Requests over a few shared documents, with the variants of the lookup
/// in turn: plain, hinted, int64, int64 with flags.
fn requests(n: u32) -> Vec<Req> {
    let mut out = Vec::new();
    for i in 0..n {
        let doc = i % 5;
        let mut t: Vec<u32> = (0..8 * PAGE).map(|k| doc * 100_000 + k).collect();
        t.extend((0..(i % 3 + 1) * PAGE).map(|k| 1_000_000 + i * 1000 + k));
        let mut r = req(&t);
        r.ns = u64::from(i % 7 == 6);
        match i % 4 {
            1 => r.hints = vec![8 * PAGE, 3 * PAGE],
            2 => r.wide = true,
            3 => {
                r.wide = true;
                r.flags = MARCONI_LOOKUP_WHOLE_INPUT;
            }
            _ => {}
        }
        out.push(r);
    }
    out
}

/// The legacy lookup over ids that `r` stands for, as a result.
fn legacy_ids(c: *const marconi_cache, r: &Req) -> marconi_lookup_result {
    let mut l = marconi_lookup::default();
    let wide: Vec<i64> = r.tokens.iter().map(|&t| i64::from(t)).collect();
    let (t, n) = (r.tokens.as_ptr(), r.tokens.len());
    // SAFETY: arrays readable for their lengths, l writable.
    ok(unsafe {
        match (r.wide, r.flags, r.hints.is_empty()) {
            (false, 0, true) => marconi_cache_lookup(c, r.ns, t, n, r.dst_slot, &mut l),
            (false, 0, false) => marconi_cache_lookup_hinted(
                c,
                r.ns,
                t,
                n,
                r.hints.as_ptr(),
                r.hints.len(),
                r.dst_slot,
                &mut l,
            ),
            (true, 0, true) => {
                marconi_cache_lookup_i64(c, r.ns, wide.as_ptr(), n, r.dst_slot, &mut l)
            }
            (true, f, true) => {
                marconi_cache_lookup_i64_flags(c, r.ns, wide.as_ptr(), n, r.dst_slot, f, &mut l)
            }
            _ => unreachable!("no legacy lookup takes hints and flags"),
        }
    });
    marconi_lookup_result {
        lease: l.lease,
        hit_tokens: l.hit_tokens,
        device_hit_tokens: l.hit_tokens,
        kv_matched_tokens: l.kv_matched_tokens,
        n_kv_pages: l.n_kv_pages,
        n_plan: l.n_plan,
        has_device_state: u32::from(l.state_slot != MARCONI_NO_SLOT),
        device_state: if l.state_slot == MARCONI_NO_SLOT {
            0
        } else {
            u64::from(l.state_slot)
        },
        has_copy_order: l.n_copy_orders,
        copy_order: l.copy_order,
        ..Default::default()
    }
}

/// A legacy hinted lookup of `r` that must succeed: `call` with its
/// namespace, tokens and hints (NULL where none), into a default `T`.
fn legacy_hinted<T: Default>(
    r: &Req,
    call: impl FnOnce(u64, *const u32, usize, *const u32, usize, *mut T) -> marconi_status,
) -> T {
    let mut out = T::default();
    let h = &r.hints;
    let hints = if h.is_empty() {
        ptr::null()
    } else {
        h.as_ptr()
    };
    ok(call(
        r.ns,
        r.tokens.as_ptr(),
        r.tokens.len(),
        hints,
        h.len(),
        &mut out,
    ));
    out
}

/// The fields twins must agree on (leases and, over pools, handle values
/// differ between two caches).
fn decisions(r: &marconi_lookup_result, pooled: bool) -> [u64; 12] {
    [
        u64::from(r.tier),
        u64::from(r.hit_tokens),
        u64::from(r.device_hit_tokens),
        u64::from(r.kv_matched_tokens),
        u64::from(r.n_kv_pages),
        u64::from(r.n_plan),
        u64::from(r.n_loads),
        u64::from(r.has_device_state),
        if pooled || r.has_device_state == 0 {
            0
        } else {
            r.device_state
        },
        u64::from(r.has_copy_order),
        u64::from(r.declined_tokens),
        u64::from(r.shared),
    ]
}

#[test]
fn the_one_cycle_is_each_call_over_ids() {
    let mut cfg = device_config(2000);
    cfg.page_size = PAGE;
    // Room for ten chains: hits, and evictions.
    cfg.capacity_bytes = 10 * chain(200);
    let (a, b) = (new_cache(&cfg), new_cache(&cfg));
    let (mut next_a, mut next_b) = (0u32, 0u32);
    let (mut hits, mut freed) = (0, 0);
    for (i, r) in requests(60).into_iter().enumerate() {
        let mut r = r;
        if i % 5 == 4 {
            r.dst_slot = 5_000_000 + i as u32;
        }
        let la = legacy_ids(a, &r);
        let (st, lb) = lookup_with(b, &r);
        ok(st);
        assert_eq!(decisions(&la, false), decisions(&lb, false), "request {i}");
        assert_eq!(
            (la.copy_order.src_slot, la.copy_order.dst_slot),
            (lb.copy_order.src_slot, lb.copy_order.dst_slot)
        );
        let (pa, ka) = lease_lists(a, la.lease, false);
        let (pb, kb) = lease_lists(b, lb.lease, false);
        assert_eq!((&pa, &ka), (&pb, &kb), "request {i}: plan and pages");
        hits += u32::from(la.hit_tokens > 0);
        let aa = admit_ids(a, la.lease, &r.tokens, &pa, &ka, &mut next_a, None);
        let ab = admit_ids(b, lb.lease, &r.tokens, &pb, &kb, &mut next_b, Some(r.wide));
        assert_eq!(aa, ab, "request {i}: the admissions");
        let (da, db) = (drain_legacy(a, false, false), drain_one(b));
        assert_eq!(da, db, "request {i}: the drains");
        freed += da.1.len() + da.2.len();
    }
    assert!(freed > 0, "nothing was evicted");
    assert!(hits > 20, "{hits} hits");
    let (sa, sb) = (cache_stats(a), cache_stats(b));
    assert_eq!((sa.requests, sa.hit_tokens), (sb.requests, sb.hit_tokens));
    // Hints and flags together: only the one lookup takes both (the last
    // request again: cached).
    let mut r = requests(60).pop().unwrap();
    r.wide = false;
    r.dst_slot = MARCONI_NO_SLOT;
    r.hints = vec![4 * PAGE];
    r.flags = MARCONI_LOOKUP_WHOLE_INPUT | MARCONI_LOOKUP_NO_KV_PAGES;
    let (st, l) = lookup_with(b, &r);
    ok(st);
    assert_eq!(l.n_kv_pages, 0, "NO_KV_PAGES");
    let (_, pages) = lease_lists(b, l.lease, false);
    assert!(l.hit_tokens > 0);
    assert_eq!(
        pages.len() as u32,
        l.hit_tokens / PAGE,
        "the pages, when asked"
    );
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_release(b, l.lease) });
    check_and_free(&[a, b]);
}

fn tiered_config(host_tokens: u64) -> (marconi_cache_config, Box<marconi_tier_options>) {
    let mut cfg = device_config(400);
    cfg.page_size = PAGE;
    let mut o = Box::new(init(marconi_tier_options_init));
    o.host.capacity_bytes = chain(host_tokens);
    o.host.bandwidth_bytes_per_s = 1e15;
    o.host.latency_s = 0.0;
    o.always_load = 1;
    cfg.tiers = &*o;
    (cfg, o)
}

#[test]
fn the_one_cycle_weighs_every_tier_or_the_device_only() {
    let (cfg, _o) = tiered_config(100_000);
    // a: marconi_cache_lookup_tiered, b: the one lookup; c:
    // marconi_cache_lookup (the device's view), d: the one lookup with
    // MARCONI_LOOKUP_DEVICE_ONLY.
    let [a, b, c, d] = [(); 4].map(|_| new_cache(&cfg));
    let mut next = [0u32; 4];
    let (mut lower, mut ops) = (0, 0);
    for (i, r) in requests(60).into_iter().enumerate() {
        let r = Req {
            wide: false,
            flags: 0,
            ..r
        };
        // SAFETY: arrays readable for their lengths, the result writable.
        let la: marconi_tiered_hit = legacy_hinted(&r, |ns, t, n, h, nh, out| unsafe {
            marconi_cache_lookup_tiered(a, ns, t, n, h, nh, ptr::null(), out)
        });
        let (st, lb) = lookup_with(b, &r);
        ok(st);
        assert_eq!(
            (
                la.tier,
                la.hit_tokens,
                la.device_hit_tokens,
                la.device_kv_tokens
            ),
            (
                lb.tier,
                lb.hit_tokens,
                lb.device_hit_tokens,
                lb.kv_matched_tokens
            ),
            "request {i}"
        );
        assert_eq!(
            (la.n_loads, la.n_plan, la.n_kv_pages, la.declined_tokens),
            (lb.n_loads, lb.n_plan, lb.n_kv_pages, lb.declined_tokens)
        );
        let device_state = if lb.has_device_state == 1 {
            lb.device_state as u32
        } else {
            MARCONI_NO_SLOT
        };
        assert_eq!(la.device_state_slot, device_state);
        lower += u32::from(lb.tier != marconi_tier::Device as u32);
        let lc = legacy_ids(c, &r);
        let (st, ld) = lookup_with(
            d,
            &Req {
                flags: MARCONI_LOOKUP_DEVICE_ONLY,
                ..r.clone()
            },
        );
        ok(st);
        assert_eq!(decisions(&lc, false), decisions(&ld, false), "request {i}");
        assert_eq!(ld.n_loads, 0);
        let mut got = Vec::new();
        for (k, (cache, lease)) in [(a, la.lease), (b, lb.lease), (c, lc.lease), (d, ld.lease)]
            .into_iter()
            .enumerate()
        {
            let (plan, hit) = lease_lists(cache, lease, false);
            // b and d: the one admit and the one drain.
            let with = (k % 2 == 1).then_some(i % 2 == 0);
            let admitted = admit_ids(cache, lease, &r.tokens, &plan, &hit, &mut next[k], with);
            let drained = if with.is_some() {
                drain_one(cache)
            } else {
                drain_legacy(cache, true, false)
            };
            got.push((admitted, drained));
        }
        assert_eq!(got[0], got[1], "request {i}: every tier");
        assert_eq!(got[2], got[3], "request {i}: the device's view");
        ops += got[0].1 .0.len();
    }
    assert!(ops > 0, "no tier op");
    assert!(lower > 5, "{lower} lower-tier hits");
    check_and_free(&[a, b, c, d]);
}

fn pooled_config(
    tiers: Option<&marconi_tier_options>,
) -> (marconi_cache_config, Box<marconi_pool_config>) {
    let mut cfg = init(marconi_cache_config_init);
    cfg.model_preset = MODEL.as_ptr();
    cfg.page_size = PAGE;
    cfg.alpha_mode = marconi_alpha_mode::Fixed as u32;
    cfg.alpha = 1.0;
    let m = marconi_core::ModelSpec::preset("nemotron-h-8b").unwrap();
    let (kv, st) = marconi_gpu::pooled::unit_sizes(&m, PAGE);
    let mut p = Box::new(init(marconi_pool_config_init));
    p.backend = marconi_pool_backend::None as u32;
    p.budget_bytes = (6 * st + 40 * kv).div_ceil(2 << 20) * (2 << 20);
    p.state_fraction = 0.3;
    cfg.pools = &*p;
    if let Some(t) = tiers {
        cfg.tiers = t;
    }
    (cfg, p)
}

#[test]
fn the_one_cycle_over_pools_with_and_without_tiers() {
    let mut t = init(marconi_tier_options_init);
    t.write_mode = marconi_tier_write::Through as u32;
    t.host.capacity_bytes = 1 << 40;
    t.host.bandwidth_bytes_per_s = 1e15;
    t.host.latency_s = 0.0;
    t.always_load = 1;
    for tiers in [None, Some(&t)] {
        let (cfg, _p) = pooled_config(tiers);
        let (a, b) = (new_cache(&cfg), new_cache(&cfg));
        let (mut lower, mut freed, mut ops) = (0, 0, 0);
        for (i, r) in requests(40).into_iter().enumerate() {
            let r = Req { flags: 0, ..r };
            // SAFETY: arrays readable for their lengths, the result writable.
            let la: marconi_pooled_lookup = legacy_hinted(&r, |ns, t, n, h, nh, out| unsafe {
                marconi_cache_lookup_pooled_hinted(a, ns, t, n, h, nh, out)
            });
            // int64 ids on every other request: the pools' int64 lookup.
            let (st, lb) = lookup_with(b, &r);
            ok(st);
            assert_eq!(
                (
                    la.hit_tokens,
                    la.kv_matched_tokens,
                    la.n_kv_pages,
                    la.n_plan
                ),
                (
                    lb.hit_tokens,
                    lb.kv_matched_tokens,
                    lb.n_kv_pages,
                    lb.n_plan
                ),
                "request {i}"
            );
            let device = lb.tier == marconi_tier::Device as u32;
            assert_eq!(la.state_handle != 0, device && lb.has_device_state == 1);
            lower += u32::from(!device);
            assert_eq!(lb.n_loads > 0, !device);
            let (pa, ka) = lease_lists(a, la.lease, true);
            let (pb, kb) = lease_lists(b, lb.lease, true);
            assert_eq!((pa.len(), ka.len()), (pb.len(), kb.len()));
            assert_eq!(pa, pb);
            let aa = admit_pooled(a, la.lease, &r.tokens, &pa, &ka, false);
            let ab = admit_pooled(b, lb.lease, &r.tokens, &pb, &kb, true);
            assert_eq!(aa, ab, "request {i}: the admissions");
            let (da, db) = (drain_legacy(a, tiers.is_some(), true), drain_one(b));
            // Handles name their pool: compare the ops and the counts.
            assert_eq!(da.0, db.0, "request {i}: the ops");
            assert_eq!((da.1.len(), da.2.len()), (db.1.len(), db.2.len()));
            freed += da.1.len() + da.2.len();
            ops += da.0.len();
        }
        assert_eq!(lower > 0, tiers.is_some(), "{lower} lower-tier hits");
        assert_eq!(ops > 0, tiers.is_some(), "{ops} ops");
        assert!(freed > 0, "nothing was evicted");
        // The device's view of a cache over pools and tiers.
        let (st, l) = lookup_with(
            b,
            &Req {
                flags: MARCONI_LOOKUP_DEVICE_ONLY,
                ..requests(1).remove(0)
            },
        );
        ok(st);
        assert_eq!((l.tier, l.n_loads), (0, 0));
        assert_eq!(l.hit_tokens, l.device_hit_tokens);
        // SAFETY: live handle and lease.
        ok(unsafe { marconi_cache_release(b, l.lease) });
        check_and_free(&[a, b]);
    }
}

#[test]
fn the_one_lookup_admit_and_drain_refuse_clearly_and_change_nothing() {
    let mut cfg = device_config(2000);
    cfg.page_size = PAGE;
    let c = new_cache(&cfg);
    let (pcfg, _p) = pooled_config(None);
    let pc = new_cache(&pcfg);
    let r = requests(1).remove(0);
    let refused = |c, r: &Req, want, words: &[&str]| {
        let (st, out) = lookup_with(c, r);
        refusal(st, want, "lookup_with", words);
        assert_eq!(out.lease, 0, "nothing written");
    };
    refused(
        c,
        &Req {
            flags: 8,
            ..r.clone()
        },
        marconi_status::InvalidArgument,
        &["unknown bits 0x8"],
    );
    refused(
        c,
        &Req {
            tokens: Vec::new(),
            ..r.clone()
        },
        marconi_status::EmptyTokens,
        &[],
    );
    refused(
        pc,
        &Req {
            dst_slot: 3,
            ..r.clone()
        },
        marconi_status::InvalidArgument,
        &["dst_slot 3", "marconi_cache_copy_states"],
    );
    // An int64 id outside [0, 2^32 - 1].
    let big: Vec<i64> = vec![1, 2, 1 << 40];
    let mut q = init(marconi_lookup_request_init);
    q.token_width = marconi_id_width::I64 as u32;
    q.tokens = big.as_ptr().cast();
    q.n_tokens = big.len();
    let mut out = versioned::<marconi_lookup_result>();
    let lookup = |q: *const marconi_lookup_request, out: &mut marconi_lookup_result| {
        // SAFETY: q is NULL or a request whose arrays live for the call
        // (or one smaller than the first version); out is writable.
        unsafe { marconi_cache_lookup_with(c, q, out) }
    };
    let st = lookup(&q, &mut out);
    refusal(st, marconi_status::InvalidArgument, "wide", &["tokens[2]"]);
    // An unknown width, a NULL request, a short result, a store without
    // tiers.
    q.token_width = 7;
    let st = lookup(&q, &mut out);
    refusal(
        st,
        marconi_status::InvalidArgument,
        "width",
        &["token_width 7"],
    );
    // A NULL request: refused before anything is read.
    let st = lookup(ptr::null(), &mut out);
    refusal(st, marconi_status::NullArgument, "null", &["req"]);
    q.token_width = 0;
    q.tokens = r.tokens.as_ptr().cast();
    q.n_tokens = r.tokens.len();
    out.struct_size = 8;
    let st = lookup(&q, &mut out);
    refusal(
        st,
        marconi_status::UnsupportedStructSize,
        "short",
        &["struct_size is 8"],
    );
    out.struct_size = size_of::<marconi_lookup_result>() as u32;
    let store = store_at(
        marconi::store::marconi_store_backend::Dir,
        std::env::temp_dir()
            .join("marconi-one-lookup")
            .to_str()
            .unwrap(),
        "nemotron-h-8b",
        100,
        None,
    );
    q.store = store;
    unsupported(lookup(&q, &mut out), &["store is probed only"]);
    let mut small = init(marconi_lookup_request_init);
    small.struct_size = 8;
    // The struct is smaller than the first version.
    let st = lookup(&small, &mut out);
    refusal(st, marconi_status::UnsupportedStructSize, "small", &[]);
    // Nothing was issued by any refusal.
    assert_eq!(cache_stats(c).leases, 0);
    assert_eq!(cache_stats(c).requests, 0);
    assert_eq!(cache_stats(pc).requests, 0);

    // The one admit: each refusal changes nothing (the lease stays).
    for (cache, pooled) in [(c, false), (pc, true)] {
        let (st, l) = lookup_with(cache, &r);
        ok(st);
        let units = [marconi_admit_state {
            position: 16,
            reserved: 0,
            unit: 1 << 40,
        }];
        let pages = [1u64 << 40];
        let mut q = init(marconi_admit_request_init);
        q.lease = l.lease;
        q.tokens = r.tokens.as_ptr().cast();
        q.n_tokens = r.tokens.len();
        q.states = units.as_ptr();
        q.n_states = 1;
        q.kv_pages = pages.as_ptr().cast();
        q.n_kv_pages = 1;
        let mut out = marconi_admit_result::default();
        let admit_with = |q: *const marconi_admit_request, out: &mut marconi_admit_result| {
            // SAFETY: q is NULL or a request whose arrays live for the
            // call; out is writable.
            unsafe { marconi_cache_admit_with(cache, q, out) }
        };
        let st = admit_with(&q, &mut out);
        if pooled {
            refusal(
                st,
                marconi_status::InvalidArgument,
                "u32 pages",
                &["MARCONI_ID_WIDTH_U64"],
            );
        } else {
            q.page_width = marconi_id_width::U64 as u32;
            let st = admit_with(&q, &mut out);
            refusal(
                st,
                marconi_status::InvalidArgument,
                "wide unit",
                &["states[0].unit"],
            );
        }
        for (field, v, word) in [
            ("token_width", 5, "token_width 5"),
            ("page_width", 9, "page_width 9"),
            ("reserved", 1, "reserved must be 0"),
        ] {
            let mut bad = q;
            match field {
                "token_width" => bad.token_width = v,
                "page_width" => bad.page_width = v,
                _ => bad.reserved = v,
            }
            refusal(
                admit_with(&bad, &mut out),
                marconi_status::InvalidArgument,
                field,
                &[word],
            );
        }
        let mut small = q;
        small.struct_size = 8;
        let st = admit_with(&small, &mut out);
        refusal(st, marconi_status::UnsupportedStructSize, "small", &[]);
        let st = admit_with(ptr::null(), &mut out);
        refusal(st, marconi_status::NullArgument, "null", &["req"]);
        assert_eq!(out, marconi_admit_result::default(), "nothing written");
        // SAFETY: live handle; the lease is still outstanding.
        ok(unsafe { marconi_cache_release(cache, l.lease) });
        assert_eq!(cache_stats(cache).leases, 0);
    }

    // The one drain: NULL, a short struct, a NULL buffer with a capacity.
    let mut d = marconi_drain {
        struct_size: 8,
        n_ops: 7,
        ..Default::default()
    };
    // SAFETY: d is readable and writable.
    let st = unsafe { marconi_cache_drain_with(c, &mut d) };
    assert_eq!(
        st,
        marconi_status::UnsupportedStructSize,
        "{}",
        last_error()
    );
    d.struct_size = size_of::<marconi_drain>() as u32;
    d.kv_pages_cap = 4;
    // SAFETY: as above.
    let st = unsafe { marconi_cache_drain_with(c, &mut d) };
    refusal(
        st,
        marconi_status::NullArgument,
        "null buffer",
        &["kv_pages"],
    );
    assert_eq!(d.n_ops, 7, "nothing written");
    // SAFETY: NULL: refused.
    let st = unsafe { marconi_cache_drain_with(c, ptr::null_mut()) };
    refusal(st, marconi_status::NullArgument, "null", &["d"]);
    // SAFETY: live handles.
    unsafe {
        marconi::store::marconi_store_free(store);
        marconi_cache_free(c);
        marconi_cache_free(pc);
    }
}
