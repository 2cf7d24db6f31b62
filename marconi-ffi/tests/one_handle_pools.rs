//! The one cache handle over pools (marconi_cache_config.pools): the full
//! pooled request cycle (lookup, reserve, copy the cached state, admit,
//! free what was not taken, release, drain, resolve, held, stats, check,
//! decision log) through marconi_cache_* calls; every pool call refused
//! on a cache without pools; every call over engine ids refused on a cache
//! over pools, naming the call to use; tiers written back below pools
//! refused; the deprecated marconi_pooled_cache_* forwarders still working
//! on either handle; a freed cache over pools refused without being read.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::collections::BTreeSet;
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::events::*;
use marconi::pool::*;
use marconi::pooled::*;
use marconi::status::marconi_status;
use marconi::tiered::*;

const PAGE: u32 = 16;
const MODEL: &std::ffi::CStr = c"nemotron-h-8b";

mod common;
use common::*;

/// (KV page bytes, state slot bytes) of the model at PAGE tokens a page.
fn unit_bytes() -> (u64, u64) {
    let m = marconi_core::ModelSpec::preset("nemotron-h-8b").unwrap();
    marconi_gpu::pooled::unit_sizes(&m, PAGE)
}

fn cache_config() -> marconi_cache_config {
    let mut cfg = init(marconi_cache_config_init);
    cfg.model_preset = MODEL.as_ptr();
    cfg.page_size = PAGE;
    cfg.alpha_mode = marconi_alpha_mode::Fixed as u32;
    cfg.alpha = 1.0;
    cfg
}

fn pool_config(backend: marconi_pool_backend, budget: u64) -> marconi_pool_config {
    let mut p = init(marconi_pool_config_init);
    p.backend = backend as u32;
    p.budget_bytes = budget;
    p.state_fraction = 0.3;
    p
}

/// A budget of `states` states and `tokens` tokens of KV, in whole 2 MiB
/// chunks.
fn budget(states: u64, tokens: u64) -> u64 {
    let (kv, st) = unit_bytes();
    let b = states * st + tokens / u64::from(PAGE) * kv;
    b.div_ceil(2 << 20) * (2 << 20)
}

/// A cache over pools through marconi_cache_new.
fn new_pooled(backend: marconi_pool_backend, budget: u64, log: bool) -> *mut marconi_cache {
    let mut cfg = cache_config();
    cfg.decision_log = u32::from(log);
    let p = pool_config(backend, budget);
    cfg.pools = &p;
    let c = new_cache(&cfg);
    assert!(!c.is_null());
    c
}

fn new_plain() -> *mut marconi_cache {
    let mut cfg = cache_config();
    cfg.capacity_bytes = 1 << 30;
    new_cache(&cfg)
}

fn drain_freed_units(c: *const marconi_cache) -> Vec<u64> {
    let mut buf = vec![0u64; 1 << 14];
    let mut n = 0usize;
    // SAFETY: buf has its length in writable elements.
    ok(unsafe { marconi_cache_drain_freed_units(c, buf.as_mut_ptr(), buf.len(), &mut n) });
    buf.truncate(n);
    buf
}

/// The decision log's lines.
fn drain_log(c: *const marconi_cache) -> Vec<serde_json::Value> {
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0usize;
    // SAFETY: buf has its length in writable bytes.
    ok(unsafe { marconi_cache_drain_log(c, buf.as_mut_ptr().cast(), buf.len(), &mut n) });
    String::from_utf8(buf[..n].to_vec())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// What one request did.
struct Served {
    lease: u64,
    hit_tokens: u32,
    resumed: bool,
}

/// One request through the one handle: `tokens[0..input]` looked up with
/// `hints`, `tokens[0..full]` admitted, the engine's part played on memfd
/// memory (the resumed state copied into the request's slot, each saved
/// state written). None when the reservation found no room.
fn serve(
    c: *const marconi_cache,
    tokens: &[u32],
    input: u32,
    full: u32,
    hints: &[u32],
) -> Option<Served> {
    let mut l = marconi_pooled_lookup::default();
    // SAFETY: live handle, valid buffers.
    ok(unsafe {
        marconi_cache_lookup_pooled_hinted(
            c,
            0,
            tokens.as_ptr(),
            input as usize,
            hints.as_ptr(),
            hints.len(),
            &mut l,
        )
    });
    assert!(l.hit_tokens < input);
    let mut n_hit = 0usize;
    let mut hit = vec![0u64; l.n_kv_pages as usize];
    // SAFETY: hit has n_kv_pages writable elements.
    ok(unsafe {
        marconi_cache_lease_kv_handles(c, l.lease, hit.as_mut_ptr(), hit.len(), &mut n_hit)
    });
    assert_eq!(n_hit, l.n_kv_pages as usize);
    assert_eq!(n_hit as u32, l.hit_tokens / PAGE, "the hit's pages");
    let mut plan = vec![0u32; l.n_plan as usize];
    let mut n_plan = 0usize;
    // SAFETY: plan has n_plan writable elements.
    ok(unsafe { marconi_cache_lease_plan(c, l.lease, plan.as_mut_ptr(), plan.len(), &mut n_plan) });
    assert_eq!(n_plan, l.n_plan as usize);
    // Every hit page is the cache's.
    let now_held: BTreeSet<u64> = held(c).into_iter().collect();
    assert!(hit.iter().all(|h| now_held.contains(h)));
    let full_pages = full / PAGE;
    let want_pages = full_pages - n_hit as u32;
    let want_slots = n_plan as u32 + 1;
    let mut pages = vec![0u64; full_pages as usize];
    let mut slots = vec![0u64; want_slots as usize];
    // SAFETY: buffers of the given capacities.
    let st = unsafe {
        marconi_cache_reserve(
            c,
            want_pages,
            want_slots,
            pages[n_hit..].as_mut_ptr(),
            want_pages as usize,
            slots.as_mut_ptr(),
            slots.len(),
        )
    };
    if st == marconi_status::OutOfMemory {
        // SAFETY: live handle and lease.
        ok(unsafe { marconi_cache_release(c, l.lease) });
        return None;
    }
    ok(st);
    pages[..n_hit].copy_from_slice(&hit);
    for h in pages[n_hit..].iter().chain(&slots) {
        assert!(!now_held.contains(h), "a reserved unit is the caller's");
    }
    let mut loc = vec![marconi_unit_location::default(); slots.len()];
    // SAFETY: slots readable, loc writable, both of the same length.
    ok(unsafe {
        marconi_cache_resolve(c, slots.as_ptr(), slots.len(), loc.as_mut_ptr(), loc.len())
    });
    let (_, state_bytes) = unit_bytes();
    let resumed = l.state_handle != 0;
    if resumed {
        // Resume: the cached state into the request's own slot, which then
        // reads as the cached one did.
        let copy = marconi_state_copy {
            src_state: l.state_handle,
            dst_state: slots[0],
        };
        // SAFETY: live handle; one pair.
        ok(unsafe { marconi_cache_copy_states(c, &copy, 1) });
        let mut src = marconi_unit_location::default();
        // SAFETY: one handle, one location.
        ok(unsafe { marconi_cache_resolve(c, &l.state_handle, 1, &mut src, 1) });
        // SAFETY: memfd addresses of live units of state_bytes bytes.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(src.address as *const u8, 64),
                std::slice::from_raw_parts(loc[0].address as *const u8, 64),
            )
        };
        assert_eq!(a, b, "the copied state");
    }
    // "Prefill and decode": write each saved state's slot.
    let mut states = pooled_states(&plan, &slots[1..]);
    states.push(marconi_pooled_state {
        position: full / PAGE * PAGE,
        reserved: 0,
        state_handle: slots[0],
    });
    for loc in &loc {
        assert!(loc.unit_bytes >= state_bytes);
        // SAFETY: a memfd unit the caller holds, at least 64 bytes.
        unsafe { std::ptr::write_bytes(loc.address as *mut u8, (full & 0xff) as u8, 64) };
    }
    let mut taken = vec![0u8; states.len()];
    let mut r = marconi_admit_result::default();
    let tokens = &tokens[..full as usize];
    ok(pooled_admit(
        c, l.lease, tokens, &states, &pages, &mut taken, &mut r,
    ));
    // Free what the cache did not take.
    let mine = untaken(&pages, n_hit, &r, &states, &taken);
    // SAFETY: mine readable.
    ok(unsafe { marconi_cache_free_units(c, mine.as_ptr(), mine.len()) });
    if let Some(h) = mine.first() {
        // SAFETY: one handle, no longer the caller's.
        let st = unsafe { marconi_cache_free_units(c, h, 1) };
        assert_eq!(st, marconi_status::UnknownHandle, "{}", last_error());
    }
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_release(c, l.lease) });
    // SAFETY: as above.
    let st = unsafe { marconi_cache_release(c, l.lease) };
    assert_eq!(st, marconi_status::UnknownLease);
    Some(Served {
        lease: l.lease,
        hit_tokens: l.hit_tokens,
        resumed,
    })
}

type EventsCall = unsafe extern "C" fn(
    *const marconi_events,
    *const marconi_cache,
    f64,
    *mut u8,
    usize,
    *mut usize,
) -> marconi_status;

/// One batch from `call` (marconi_events_drain or _snapshot), sized by a
/// query first, decoded.
///
/// # Safety
///
/// `ev` and `c` are live, `ev` made on `c`.
unsafe fn events_batch(
    ev: *const marconi_events,
    c: *const marconi_cache,
    call: EventsCall,
) -> Vec<::marconi_events::DecodedEvent> {
    let mut len = 0usize;
    // SAFETY: a size query (NULL buffer, capacity 0).
    let st = unsafe { call(ev, c, 1.0, ptr::null_mut(), 0, &mut len) };
    if st == marconi_status::Ok {
        assert_eq!(len, 0, "nothing pending");
        return Vec::new();
    }
    assert_eq!(st, marconi_status::BufferTooSmall, "{}", last_error());
    let mut buf = vec![0u8; len];
    // SAFETY: buf has len writable bytes.
    ok(unsafe { call(ev, c, 1.0, buf.as_mut_ptr(), buf.len(), &mut len) });
    ::marconi_events::decode_batch(&buf[..len])
        .expect("a decodable batch")
        .events
}

/// Drains `ev` into `mirror`; returns the removals it held.
fn drain_events(
    ev: *const marconi_events,
    c: *const marconi_cache,
    mirror: &mut ::marconi_events::Mirror,
) -> usize {
    // SAFETY: live handles (the caller's).
    let events = unsafe { events_batch(ev, c, marconi_events_drain) };
    let removals = events
        .iter()
        .filter(|e| matches!(e, ::marconi_events::DecodedEvent::BlockRemoved { .. }))
        .count();
    mirror.apply(&events);
    removals
}

/// The invariants after each request: check passes, every held handle
/// resolves, drained handles are no longer held and no longer resolve,
/// the two stats calls agree.
fn check_all(c: *const marconi_cache, budget: u64, freed_seen: &mut Vec<u64>) {
    // SAFETY: live handle.
    ok(unsafe { marconi_cache_check(c) });
    let h = held(c);
    let mut loc = vec![marconi_unit_location::default(); h.len()];
    if !h.is_empty() {
        // SAFETY: h readable, loc writable.
        ok(unsafe { marconi_cache_resolve(c, h.as_ptr(), h.len(), loc.as_mut_ptr(), loc.len()) });
    }
    let ps = pool_stats(c);
    assert_eq!(ps.held_kv_pages + ps.held_state_slots, h.len() as u64);
    assert_eq!(ps.backend, marconi_pool_backend::Memfd as u32);
    assert!(ps.physical_bytes <= budget && ps.budget_bytes <= budget);
    assert_eq!(ps.leases, 0);
    let s = cache_stats(c);
    assert_eq!(s.requests, ps.requests);
    assert_eq!(s.hit_tokens, ps.hit_tokens);
    assert_eq!(s.evictions, ps.evictions);
    assert_eq!(s.leases, 0);
    assert_eq!(
        s.capacity_bytes, ps.budget_bytes,
        "the pools are the capacity"
    );
    let held_set: BTreeSet<u64> = h.into_iter().collect();
    for f in drain_freed_units(c) {
        assert!(!held_set.contains(&f), "{f:#x} drained yet held");
        let mut l = marconi_unit_location::default();
        // SAFETY: one handle, one location.
        let st = unsafe { marconi_cache_resolve(c, &f, 1, &mut l, 1) };
        assert_ne!(st, marconi_status::Ok, "a drained handle is stale");
        freed_seen.push(f);
    }
    assert!(drain_freed_units(c).is_empty(), "drained once");
}

#[test]
fn the_pooled_request_cycle_through_the_one_handle() {
    // Room for a few states and a few thousand tokens: evictions happen.
    let b = budget(6, 2600);
    let c = new_pooled(marconi_pool_backend::Memfd, b, true);
    let mut freed_seen = Vec::new();
    check_all(c, b, &mut freed_seen);
    // The event stream over pools: drained after every request into a
    // subscriber's mirror, which must rebuild what the cache holds.
    let ecfg = init(marconi_events_config_init);
    let mut ev = ptr::null_mut();
    // SAFETY: live cache, initialised config, out writable.
    ok(unsafe { marconi_events_new(c, &ecfg, &mut ev) });
    let mut mirror = ::marconi_events::Mirror::default();
    let mut removals = 0usize;
    // Four conversations sharing a 160-token prefix (the last one not),
    // each turn extending the previous one; an application checkpoint at
    // the end of the shared prefix.
    let conv: Vec<Vec<u32>> = (0..4u32)
        .map(|k| {
            (0..4096u32)
                .map(|i| if k < 3 && i < 160 { i } else { k * 100_000 + i })
                .collect()
        })
        .collect();
    let mut len = [0u32; 4];
    let (mut served, mut refused, mut resumed) = (0u64, 0u64, 0u64);
    let mut leases = Vec::new();
    for _turn in 0..10 {
        for k in 0..4 {
            let input = len[k] + 160;
            let full = input + 48;
            if full > 4096 {
                continue;
            }
            match serve(c, &conv[k], input, full, &[160]) {
                Some(s) => {
                    served += 1;
                    resumed += u64::from(s.resumed);
                    assert!(!s.resumed || s.hit_tokens > 0);
                    leases.push(s.lease);
                }
                None => refused += 1,
            }
            len[k] = full;
            check_all(c, b, &mut freed_seen);
            removals += drain_events(ev, c, &mut mirror);
        }
    }
    // SAFETY: live handles.
    let snapshot = unsafe { events_batch(ev, c, marconi_events_snapshot) };
    let mut rebuilt = ::marconi_events::Mirror::default();
    rebuilt.apply(&snapshot);
    assert_eq!(
        mirror.unknown_removals, 0,
        "removals of blocks never stored"
    );
    assert!(!mirror.set.is_empty() && removals > 0, "stored and removed");
    assert_eq!(
        mirror.set, rebuilt.set,
        "the drained stream rebuilds the cache"
    );
    // SAFETY: both live; the events handle first.
    unsafe { marconi_events_free(ev, c) };
    let ps = pool_stats(c);
    assert_eq!(ps.requests, served + refused);
    assert_eq!(ps.reservations_refused, refused);
    assert!(resumed > 0 && ps.hit_tokens > 0, "later turns resume");
    assert!(ps.evictions > 0, "the budget is small: entries left memory");
    assert!(!freed_seen.is_empty(), "and their handles came back");
    let s = cache_stats(c);
    assert_eq!(s.requests, served + refused);
    assert!(s.used_bytes <= s.capacity_bytes);
    // The decision log names the C lease ids the lookups gave.
    let log = drain_log(c);
    let logged: BTreeSet<u64> = log
        .iter()
        .filter(|d| d["kind"] == "lookup")
        .filter_map(|d| d["lease"].as_u64())
        .collect();
    assert!(!log.is_empty());
    for l in &leases {
        assert!(logged.contains(l), "lease {l} not in the log");
    }
    assert!(drain_log(c).is_empty(), "drained once");
    // A lease of this cache is not another's.
    let other = new_pooled(marconi_pool_backend::None, 8 << 30, false);
    let t: Vec<u32> = (0..64).collect();
    let mut l = marconi_pooled_lookup::default();
    // SAFETY: live handles, valid buffers.
    unsafe {
        ok(marconi_cache_lookup_pooled(
            c,
            0,
            t.as_ptr(),
            t.len(),
            &mut l,
        ));
        assert_eq!(
            marconi_cache_release(other, l.lease),
            marconi_status::UnknownLease
        );
        ok(marconi_cache_release(c, l.lease));
        // Backend NONE has no memory to copy.
        let mut sl = [0u64; 2];
        ok(marconi_cache_reserve(
            other,
            0,
            2,
            ptr::null_mut(),
            0,
            sl.as_mut_ptr(),
            2,
        ));
        let pair = marconi_state_copy {
            src_state: sl[0],
            dst_state: sl[1],
        };
        unsupported(
            marconi_cache_copy_states(other, &pair, 1),
            &["backend NONE"],
        );
        ok(marconi_cache_free_units(other, sl.as_ptr(), 2));
        ok(marconi_cache_check(other));
        marconi_cache_free(other);
        ok(marconi_cache_check(c));
        marconi_cache_free(c);
    }
}

/// Every pool call on a cache without pools (plain or tiered) is
/// MARCONI_STATUS_UNSUPPORTED naming the call and what to configure, and
/// changes nothing; so are the deprecated forwarders given such a cache.
#[test]
fn every_pool_call_refuses_on_a_cache_without_pools() {
    let plain = new_plain();
    let mut tcfg = cache_config();
    tcfg.capacity_bytes = 1 << 30;
    let mut o = init(marconi_tier_options_init);
    o.host.capacity_bytes = 1 << 30;
    tcfg.tiers = &o;
    let tiered = new_cache(&tcfg);
    let t: Vec<u32> = (0..64).collect();
    for c in [plain, tiered] {
        // A lease of the cache's own, which the pool calls must not take.
        let mut pl = marconi_lookup::default();
        // SAFETY: live handle, valid buffers.
        ok(unsafe { marconi_cache_lookup(c, 0, t.as_ptr(), t.len(), MARCONI_NO_SLOT, &mut pl) });
        let before = cache_stats(c);
        let mut l = marconi_pooled_lookup::default();
        let (mut buf, mut n) = ([0u64; 8], 0usize);
        let mut loc = [marconi_unit_location::default(); 1];
        let pair = marconi_state_copy {
            src_state: 1,
            dst_state: 2,
        };
        let st = [marconi_pooled_state::default(); 1];
        let mut taken = [0u8; 1];
        let mut r = marconi_admit_result::default();
        let mut ps = versioned::<marconi_pooled_stats>();
        let hint = [32u32];
        let want = ["marconi_cache_config.pools", "marconi_pool_config"];
        // SAFETY: live handle; every buffer valid for its length.
        unsafe {
            let calls: Vec<(&str, marconi_status)> = vec![
                (
                    "marconi_cache_lookup_pooled",
                    marconi_cache_lookup_pooled(c, 0, t.as_ptr(), t.len(), &mut l),
                ),
                (
                    "marconi_cache_lookup_pooled_hinted",
                    marconi_cache_lookup_pooled_hinted(
                        c,
                        0,
                        t.as_ptr(),
                        t.len(),
                        hint.as_ptr(),
                        1,
                        &mut l,
                    ),
                ),
                (
                    "marconi_cache_lease_kv_handles",
                    marconi_cache_lease_kv_handles(c, pl.lease, buf.as_mut_ptr(), 8, &mut n),
                ),
                (
                    "marconi_cache_reserve",
                    marconi_cache_reserve(c, 1, 1, buf.as_mut_ptr(), 1, buf[1..].as_mut_ptr(), 1),
                ),
                (
                    "marconi_cache_admit_pooled",
                    marconi_cache_admit_pooled(
                        c,
                        pl.lease,
                        t.as_ptr(),
                        64,
                        st.as_ptr(),
                        1,
                        buf.as_ptr(),
                        4,
                        taken.as_mut_ptr(),
                        &mut r,
                    ),
                ),
                (
                    "marconi_cache_free_units",
                    marconi_cache_free_units(c, buf.as_ptr(), 1),
                ),
                (
                    "marconi_cache_drain_freed_units",
                    marconi_cache_drain_freed_units(c, buf.as_mut_ptr(), 8, &mut n),
                ),
                (
                    "marconi_cache_held",
                    marconi_cache_held(c, buf.as_mut_ptr(), 8, &mut n),
                ),
                (
                    "marconi_cache_resolve",
                    marconi_cache_resolve(c, buf.as_ptr(), 1, loc.as_mut_ptr(), 1),
                ),
                (
                    "marconi_cache_copy_states",
                    marconi_cache_copy_states(c, &pair, 1),
                ),
                (
                    "marconi_cache_pool_stats",
                    marconi_cache_pool_stats(c, &mut ps),
                ),
                // The deprecated forwarders, given a cache without pools.
                (
                    "marconi_cache_lookup_pooled",
                    marconi_pooled_cache_lookup(c.cast(), 0, t.as_ptr(), t.len(), &mut l),
                ),
                (
                    "marconi_cache_reserve",
                    marconi_pooled_cache_reserve(
                        c.cast(),
                        1,
                        0,
                        buf.as_mut_ptr(),
                        1,
                        ptr::null_mut(),
                        0,
                    ),
                ),
                (
                    "marconi_cache_held",
                    marconi_pooled_cache_held(c.cast(), buf.as_mut_ptr(), 8, &mut n),
                ),
                (
                    "marconi_cache_pool_stats",
                    marconi_pooled_cache_stats(c.cast(), &mut ps),
                ),
            ];
            for (name, s) in calls {
                // The message of the call itself is gone by now: check the
                // status here, the words once more below.
                assert_eq!(
                    s,
                    marconi_status::Unsupported,
                    "{name} on a cache without pools"
                );
            }
            unsupported(
                marconi_cache_reserve(c, 1, 0, buf.as_mut_ptr(), 1, ptr::null_mut(), 0),
                &want,
            );
            unsupported(
                marconi_cache_held(c, buf.as_mut_ptr(), 8, &mut n),
                &["marconi_cache_held needs pools"],
            );
            unsupported(
                marconi_pooled_cache_free_units(c.cast(), buf.as_ptr(), 1),
                &["marconi_cache_free_units needs pools"],
            );
            assert_eq!((l, r, ps.requests, taken), Default::default());
            // The common calls the forwarders reach work on any cache.
            ok(marconi_pooled_cache_check(c.cast()));
            let (mut plan, mut np) = ([0u32; 8], 0usize);
            ok(marconi_pooled_cache_lease_plan(
                c.cast(),
                pl.lease,
                plan.as_mut_ptr(),
                8,
                &mut np,
            ));
            let after = cache_stats(c);
            assert_eq!(
                (before.requests, before.leases),
                (after.requests, after.leases)
            );
            ok(marconi_pooled_cache_release(c.cast(), pl.lease));
            ok(marconi_cache_check(c));
            marconi_pooled_cache_free(c.cast());
        }
    }
}

/// Every call over ids the engine owns (and evict) refuses on a cache over
/// pools, naming the call to use, and changes
/// nothing; so does every tier call.
#[test]
fn calls_over_engine_ids_refuse_on_a_cache_over_pools() {
    let c = new_pooled(marconi_pool_backend::None, 8 << 30, false);
    let t: Vec<u32> = (0..64).collect();
    let t64: Vec<i64> = (0..64).collect();
    let mut pl = marconi_pooled_lookup::default();
    // SAFETY: live handle, valid buffers.
    ok(unsafe { marconi_cache_lookup_pooled(c, 0, t.as_ptr(), t.len(), &mut pl) });
    let before = cache_stats(c);
    let mut l = marconi_lookup::default();
    let (mut p32, mut s32, mut n, mut n2) = ([0u32; 8], [0u32; 8], 0usize, 0usize);
    let p64 = [0i64; 4];
    let st = [marconi_saved_state {
        position: 64,
        slot: 1,
    }];
    let mut r = marconi_admit_result::default();
    let hint = [32u32];
    // SAFETY: live handle; every buffer valid for its length.
    unsafe {
        unsupported(
            marconi_cache_lookup(c, 0, t.as_ptr(), t.len(), MARCONI_NO_SLOT, &mut l),
            &["marconi_cache_lookup ", "use marconi_cache_lookup_pooled"],
        );
        unsupported(
            marconi_cache_lookup_hinted(
                c,
                0,
                t.as_ptr(),
                t.len(),
                hint.as_ptr(),
                1,
                MARCONI_NO_SLOT,
                &mut l,
            ),
            &["use marconi_cache_lookup_pooled"],
        );
        unsupported(
            marconi_cache_lookup_i64(c, 0, t64.as_ptr(), t64.len(), MARCONI_NO_SLOT, &mut l),
            &["use marconi_cache_lookup_pooled"],
        );
        unsupported(
            marconi_cache_lookup_i64_flags(
                c,
                0,
                t64.as_ptr(),
                t64.len(),
                MARCONI_NO_SLOT,
                0,
                &mut l,
            ),
            &["use marconi_cache_lookup_pooled"],
        );
        unsupported(
            marconi_cache_lease_kv_pages(c, pl.lease, p32.as_mut_ptr(), 8, &mut n),
            &["use marconi_cache_lease_kv_handles"],
        );
        unsupported(
            marconi_cache_admit(
                c,
                pl.lease,
                t.as_ptr(),
                64,
                st.as_ptr(),
                1,
                p32.as_ptr(),
                4,
                ptr::null_mut(),
                &mut r,
            ),
            &["use marconi_cache_admit_pooled"],
        );
        unsupported(
            marconi_cache_admit_i64(
                c,
                pl.lease,
                t64.as_ptr(),
                64,
                st.as_ptr(),
                1,
                p64.as_ptr(),
                4,
                ptr::null_mut(),
                &mut r,
            ),
            &["use marconi_cache_admit_pooled"],
        );
        unsupported(
            marconi_cache_drain_freed(c, p32.as_mut_ptr(), 8, &mut n, s32.as_mut_ptr(), 8, &mut n2),
            &["use marconi_cache_drain_freed_units"],
        );
        let mut free = 0u64;
        unsupported(
            marconi_cache_evict(c, 1 << 20, &mut free),
            &["marconi_cache_reserve"],
        );
        // Tier calls: no tiers here.
        let mut th = marconi_tiered_hit::default();
        unsupported(
            marconi_cache_lookup_tiered(
                c,
                0,
                t.as_ptr(),
                t.len(),
                ptr::null(),
                0,
                ptr::null(),
                &mut th,
            ),
            &["needs lower tiers"],
        );
        unsupported(marconi_cache_settle(c), &["needs lower tiers"]);
        assert_eq!((l, r, n, free), Default::default());
        assert_eq!((p32, s32, n2), ([0; 8], [0; 8], 0));
        // Nothing changed: the pooled lease is still the only one, and
        // still works.
        let after = cache_stats(c);
        assert_eq!(
            (before.requests, before.leases),
            (after.requests, after.leases)
        );
        assert_eq!(pool_stats(c).leases, 1);
        let (mut plan, mut np) = ([0u32; 8], 0usize);
        ok(marconi_cache_lease_plan(
            c,
            pl.lease,
            plan.as_mut_ptr(),
            8,
            &mut np,
        ));
        assert_eq!(np, pl.n_plan as usize);
        ok(marconi_cache_release(c, pl.lease));
        ok(marconi_cache_check(c));
        marconi_cache_free(c);
    }
}

/// Tiers written back or with deferred moves below pools are refused
/// (an eviction's copy would read units the same reservation hands out);
/// a configuration of version 5 (no pools field) is a cache without pools
/// whatever follows it; a model without recurrent layers cannot have
/// pools; the deprecated constructor refuses a configuration that already
/// sets pools.
#[test]
fn pool_configurations_that_cannot_make_a_cache_are_refused() {
    let p = pool_config(marconi_pool_backend::None, 8 << 30);
    let mut o = init(marconi_tier_options_init);
    o.host.capacity_bytes = 1 << 30;
    let mut cfg = cache_config();
    cfg.pools = &p;
    cfg.tiers = &o;
    let sentinel = ptr::NonNull::<marconi_cache>::dangling().as_ptr();
    let mut c = sentinel;
    // SAFETY: valid configs and out pointer.
    let st = unsafe { marconi_cache_new(&cfg, &mut c) };
    refusal(
        st,
        marconi_status::InvalidConfig,
        "write-back",
        &["written through"],
    );
    assert_eq!(c, sentinel, "nothing written");
    o.write_mode = marconi_tier_write::Through as u32;
    o.defer_moves = 1;
    cfg.tiers = &o;
    // SAFETY: as above.
    let st = unsafe { marconi_cache_new(&cfg, &mut c) };
    refusal(
        st,
        marconi_status::InvalidConfig,
        "deferred",
        &["defer_moves"],
    );
    assert_eq!(c, sentinel, "nothing written");
    cfg.tiers = ptr::null();
    // A model without recurrent layers.
    cfg.model_preset = c"paper-7b-attn".as_ptr();
    // SAFETY: as above.
    let st = unsafe { marconi_cache_new(&cfg, &mut c) };
    assert_eq!(st, marconi_status::InvalidConfig, "{}", last_error());
    assert!(last_error().contains("recurrent"), "{}", last_error());
    // Units smaller than the model's.
    cfg.model_preset = MODEL.as_ptr();
    let mut small = p;
    small.state_slot_bytes = 128;
    cfg.pools = &small;
    // SAFETY: as above.
    let st = unsafe { marconi_cache_new(&cfg, &mut c) };
    assert_eq!(st, marconi_status::InvalidConfig, "{}", last_error());
    assert_eq!(c, sentinel);
    // The deprecated constructor with pools already set.
    cfg.pools = &p;
    let mut pc = ptr::null_mut();
    // SAFETY: as above.
    let st = unsafe { marconi_pooled_cache_new(&cfg, &p, &mut pc) };
    assert_eq!(st, marconi_status::InvalidConfig, "{}", last_error());
    assert!(pc.is_null());
    // Version 5 of the struct ends before pools: never read.
    let v5 = std::mem::offset_of!(marconi_cache_config, pools);
    let mut old = cache_config();
    old.struct_size = v5 as u32;
    old.capacity_bytes = 1 << 30;
    old.pools = ptr::NonNull::dangling().as_ptr();
    // SAFETY: a whole struct; only its first v5 bytes are read.
    ok(unsafe { marconi_cache_new(&old, &mut c) });
    let (mut buf, mut n) = ([0u64; 4], 0usize);
    // SAFETY: live handle; freed once.
    unsafe {
        unsupported(
            marconi_cache_held(c, buf.as_mut_ptr(), 4, &mut n),
            &["needs pools"],
        );
        marconi_cache_free(c);
    }
}

/// The deprecated marconi_pooled_cache_* calls drive a cache over pools as
/// before, and the handle is a marconi_cache either way: made by
/// marconi_pooled_cache_new it takes the marconi_cache_* calls, made by
/// marconi_cache_new it takes the forwarders.
#[test]
fn the_deprecated_pooled_forwarders_still_work() {
    let cfg = cache_config();
    let p = pool_config(marconi_pool_backend::Memfd, budget(8, 2048));
    let mut pc = ptr::null_mut();
    // SAFETY: valid configs and out pointer.
    ok(unsafe { marconi_pooled_cache_new(&cfg, &p, &mut pc) });
    let one = new_pooled(marconi_pool_backend::Memfd, budget(8, 2048), false);
    let tokens: Vec<u32> = (0..400).collect();
    for (k, c) in [(0u32, pc), (1, one.cast::<marconi_pooled_cache>())] {
        let mut l = marconi_pooled_lookup::default();
        // SAFETY: live handles; every buffer valid for its length.
        unsafe {
            let hints = [320u32];
            ok(marconi_pooled_cache_lookup_hinted(
                c,
                k.into(),
                tokens.as_ptr(),
                336,
                hints.as_ptr(),
                1,
                &mut l,
            ));
            assert_eq!(l.n_plan, 1);
            let (mut plan, mut np) = ([0u32; 4], 0usize);
            ok(marconi_pooled_cache_lease_plan(
                c,
                l.lease,
                plan.as_mut_ptr(),
                4,
                &mut np,
            ));
            assert_eq!(plan[..np], [320]);
            let (mut hit, mut nh) = ([0u64; 4], 0usize);
            ok(marconi_pooled_cache_lease_kv_pages(
                c,
                l.lease,
                hit.as_mut_ptr(),
                4,
                &mut nh,
            ));
            assert_eq!(nh, 0);
            let (mut pages, mut slots) = ([0u64; 21], [0u64; 2]);
            ok(marconi_pooled_cache_reserve(
                c,
                21,
                2,
                pages.as_mut_ptr(),
                21,
                slots.as_mut_ptr(),
                2,
            ));
            let mut loc = [marconi_unit_location::default(); 2];
            ok(marconi_pooled_cache_resolve(
                c,
                slots.as_ptr(),
                2,
                loc.as_mut_ptr(),
                2,
            ));
            let states = [
                marconi_pooled_state {
                    position: 320,
                    reserved: 0,
                    state_handle: slots[0],
                },
                marconi_pooled_state {
                    position: 336,
                    reserved: 0,
                    state_handle: slots[1],
                },
            ];
            let mut taken = [0u8; 2];
            let mut r = marconi_admit_result::default();
            ok(marconi_pooled_cache_admit(
                c,
                l.lease,
                tokens.as_ptr(),
                336,
                states.as_ptr(),
                2,
                pages.as_ptr(),
                21,
                taken.as_mut_ptr(),
                &mut r,
            ));
            assert_eq!(taken, [1, 1]);
            ok(marconi_pooled_cache_release(c, l.lease));
            // The next request resumes from the checkpoint at 320 (the
            // state at 336 covers the first input only).
            ok(marconi_pooled_cache_lookup(
                c,
                k.into(),
                [&tokens[..320], &[9, 9, 9, 9][..]].concat().as_ptr(),
                324,
                &mut l,
            ));
            assert_eq!(l.hit_tokens, 320);
            assert_eq!(l.state_handle, slots[0]);
            let mut mine = [0u64; 1];
            ok(marconi_pooled_cache_reserve(
                c,
                0,
                1,
                ptr::null_mut(),
                0,
                mine.as_mut_ptr(),
                1,
            ));
            let pair = marconi_state_copy {
                src_state: l.state_handle,
                dst_state: mine[0],
            };
            ok(marconi_pooled_cache_copy_states(c, &pair, 1));
            ok(marconi_pooled_cache_free_units(c, mine.as_ptr(), 1));
            ok(marconi_pooled_cache_release(c, l.lease));
            let (mut h, mut nhd) = ([0u64; 64], 0usize);
            ok(marconi_pooled_cache_held(c, h.as_mut_ptr(), 64, &mut nhd));
            assert_eq!(nhd, 23, "21 pages and 2 states");
            ok(marconi_pooled_cache_drain_freed(
                c,
                h.as_mut_ptr(),
                64,
                &mut nhd,
            ));
            assert_eq!(nhd, 0);
            let mut s = versioned::<marconi_pooled_stats>();
            ok(marconi_pooled_cache_stats(c, &mut s));
            assert_eq!((s.requests, s.hit_tokens, s.leases), (2, 320, 0));
            ok(marconi_pooled_cache_check(c));
            // The same handle through the one handle's calls.
            let c1 = c.cast::<marconi_cache>();
            assert_eq!(pool_stats(c1).held_state_slots, 2);
            assert_eq!(cache_stats(c1).requests, 2);
            ok(marconi_cache_check(c1));
        }
    }
    // SAFETY: live handles, each freed once (either free takes either).
    unsafe {
        marconi_cache_free(pc.cast());
        marconi_pooled_cache_free(one.cast());
    }
}

/// A freed cache over pools, and memory that cannot be read, are refused
/// by every pool call and every forwarder without a byte of them being
/// read (the live-handle registry answers).
#[test]
fn a_freed_cache_over_pools_is_refused_without_being_read() {
    let page = NoAccessPage::new();
    let freed = new_pooled(marconi_pool_backend::None, 8 << 30, false);
    // SAFETY: a live handle, freed once.
    unsafe { marconi_cache_free(freed) };
    let refused = |s, what: &str| not_a_handle(s, what, "is not a marconi_cache handle");
    let t = [1u32, 2, 3];
    for (c, place) in [
        (freed, "a freed cache over pools"),
        (page.ptr(), "an inaccessible page"),
    ] {
        let c: *mut marconi_cache = c;
        let mut l = marconi_pooled_lookup::default();
        let (mut buf, mut n) = ([0u64; 4], 0usize);
        let mut loc = [marconi_unit_location::default(); 1];
        let pair = marconi_state_copy::default();
        let mut r = marconi_admit_result::default();
        let mut ps = versioned::<marconi_pooled_stats>();
        let pc = c.cast::<marconi_pooled_cache>();
        // SAFETY: the calls under test take any pointer and must not read it.
        unsafe {
            refused(
                marconi_cache_lookup_pooled(c, 0, t.as_ptr(), 3, &mut l),
                place,
            );
            refused(
                marconi_cache_lookup_pooled_hinted(c, 0, t.as_ptr(), 3, ptr::null(), 0, &mut l),
                place,
            );
            refused(
                marconi_cache_lease_kv_handles(c, 1, buf.as_mut_ptr(), 4, &mut n),
                place,
            );
            refused(
                marconi_cache_reserve(c, 1, 0, buf.as_mut_ptr(), 4, ptr::null_mut(), 0),
                place,
            );
            refused(
                marconi_cache_admit_pooled(
                    c,
                    1,
                    t.as_ptr(),
                    3,
                    ptr::null(),
                    0,
                    ptr::null(),
                    0,
                    ptr::null_mut(),
                    &mut r,
                ),
                place,
            );
            refused(marconi_cache_free_units(c, buf.as_ptr(), 1), place);
            refused(
                marconi_cache_drain_freed_units(c, buf.as_mut_ptr(), 4, &mut n),
                place,
            );
            refused(marconi_cache_held(c, buf.as_mut_ptr(), 4, &mut n), place);
            refused(
                marconi_cache_resolve(c, buf.as_ptr(), 1, loc.as_mut_ptr(), 1),
                place,
            );
            refused(marconi_cache_copy_states(c, &pair, 1), place);
            refused(marconi_cache_pool_stats(c, &mut ps), place);
            refused(marconi_cache_release(c, 1), place);
            refused(marconi_cache_check(c), place);
            refused(
                marconi_pooled_cache_lookup(pc, 0, t.as_ptr(), 3, &mut l),
                place,
            );
            refused(
                marconi_pooled_cache_reserve(pc, 1, 0, buf.as_mut_ptr(), 4, ptr::null_mut(), 0),
                place,
            );
            refused(
                marconi_pooled_cache_held(pc, buf.as_mut_ptr(), 4, &mut n),
                place,
            );
            refused(marconi_pooled_cache_stats(pc, &mut ps), place);
            refused(marconi_pooled_cache_check(pc), place);
            marconi_pooled_cache_free(pc);
            marconi_cache_free(c);
        }
        assert_eq!((l, r, n, ps.requests), Default::default());
    }
}

/// Regression: a cache over pools made with decision_log = 1 kept every
/// record with no call able to drain them (marconi_cache_drain_log refused
/// a marconi_pooled_cache), so its memory grew with every request. It is a
/// marconi_cache now: its log drains, naming the C lease ids.
#[test]
fn the_decision_log_of_a_cache_over_pools_drains() {
    let mut cfg = cache_config();
    cfg.decision_log = 1;
    let p = pool_config(marconi_pool_backend::None, 8 << 30);
    let mut pc = ptr::null_mut();
    // SAFETY: valid configs and out pointer (the deprecated constructor,
    // as callers of the earlier release made these caches).
    ok(unsafe { marconi_pooled_cache_new(&cfg, &p, &mut pc) });
    let t: Vec<u32> = (0..64).collect();
    let mut l = marconi_pooled_lookup::default();
    // SAFETY: live handle, valid buffers.
    ok(unsafe { marconi_pooled_cache_lookup(pc, 0, t.as_ptr(), t.len(), &mut l) });
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_pooled_cache_release(pc, l.lease) });
    let c = pc.cast::<marconi_cache>();
    let (mut buf, mut n) = (vec![0u8; 1 << 16], 0usize);
    // SAFETY: buf has its length in writable bytes.
    ok(unsafe { marconi_cache_drain_log(c, buf.as_mut_ptr().cast(), buf.len(), &mut n) });
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(text.contains("\"kind\":\"lookup\""), "{text}");
    assert!(text.contains(&format!("\"lease\":{}", l.lease)), "{text}");
    // SAFETY: as above: drained once.
    ok(unsafe { marconi_cache_drain_log(c, buf.as_mut_ptr().cast(), buf.len(), &mut n) });
    assert_eq!(n, 0);
    // SAFETY: freed once.
    unsafe { marconi_pooled_cache_free(pc) };
}
