//! The one cache handle with lower tiers (marconi_cache_config.tiers):
//! SGLang's path (int64 ids, lookup flags, engine page lists) through
//! host and store tiers with the event stream on, the engine's copies
//! replayed from the tier ops; the device view of marconi_cache_lookup on
//! such a cache; every tier call refused on a cache configured without
//! tiers; a configuration struct of the previous version still accepted.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::mem::{offset_of, size_of};
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::events::*;
use marconi::status::marconi_status;
use marconi::tiered::*;

mod common;
use common::*;

fn tier_options(host: u64, store: u64) -> marconi_tier_options {
    let mut o = init(marconi_tier_options_init);
    o.host.capacity_bytes = chain(host);
    o.store.capacity_bytes = if store > 0 { chain(store) } else { 0 };
    // Loads always pay off: the lower tiers are fast.
    o.host.bandwidth_bytes_per_s = 1e15;
    o.store.bandwidth_bytes_per_s = 1e15;
    o.store.latency_s = 0.0;
    o.host.latency_s = 0.0;
    o
}

/// The engine: device slots and pages it tracks, the host and store
/// copies it keeps, replayed from the tier ops.
struct Engine {
    c: *mut marconi_cache,
    /// State slots: the chain each holds (the engine's or the cache's).
    slots: BTreeMap<u32, Vec<u32>>,
    /// State slots the cache took.
    cache_slots: BTreeSet<u32>,
    /// KV pages the cache took.
    cache_pages: BTreeSet<i64>,
    next_id: u32,
    host: BTreeSet<Vec<u32>>,
    store: BTreeSet<Vec<u32>>,
    lower_hits: u64,
    ops: u64,
}

impl Engine {
    fn new(c: *mut marconi_cache) -> Self {
        Engine {
            c,
            slots: BTreeMap::new(),
            cache_slots: BTreeSet::new(),
            cache_pages: BTreeSet::new(),
            next_id: 0,
            host: BTreeSet::new(),
            store: BTreeSet::new(),
            lower_hits: 0,
            ops: 0,
        }
    }

    fn id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    fn lease_list(&self, lease: u64, plan: bool) -> Vec<u32> {
        let mut n = 0usize;
        let mut v = vec![0u32; 65536];
        // SAFETY: v has its length in elements.
        ok(unsafe {
            if plan {
                marconi_cache_lease_plan(self.c, lease, v.as_mut_ptr(), v.len(), &mut n)
            } else {
                marconi_cache_lease_kv_pages(self.c, lease, v.as_mut_ptr(), v.len(), &mut n)
            }
        });
        v.truncate(n);
        v
    }

    /// One request as SGLang makes it: the int64 flagged tier lookup (or
    /// the device view), the loads, the prefill's states, admit_i64 with
    /// the page list, release, then the ops and the freed ids.
    fn serve(&mut self, input: &[u32], output: &[u32], tiered: bool) {
        let ids: Vec<i64> = input.iter().map(|&t| i64::from(t)).collect();
        let flags = MARCONI_LOOKUP_NO_KV_PAGES;
        let (lease, hit, device_hit, tier) = if tiered {
            let mut h = marconi_tiered_hit::default();
            // SAFETY: valid handle, ids and out.
            ok(unsafe {
                marconi_cache_lookup_tiered_i64_flags(
                    self.c,
                    0,
                    ids.as_ptr(),
                    ids.len(),
                    flags,
                    ptr::null(),
                    &mut h,
                )
            });
            assert_eq!(h.n_kv_pages, 0, "NO_KV_PAGES");
            (h.lease, h.hit_tokens, h.device_hit_tokens, h.tier)
        } else {
            let mut l = marconi_lookup::default();
            // SAFETY: valid handle, ids and out.
            ok(unsafe {
                marconi_cache_lookup_i64_flags(
                    self.c,
                    0,
                    ids.as_ptr(),
                    ids.len(),
                    MARCONI_NO_SLOT,
                    flags,
                    &mut l,
                )
            });
            (l.lease, l.hit_tokens, l.hit_tokens, 0)
        };
        // The device hit's pages, computed on demand.
        let dev_pages = self.lease_list(lease, false);
        assert_eq!(dev_pages.len() as u32, device_hit, "one page per token");
        let mut loads = vec![marconi_load_order::default(); 16];
        let mut n = 0usize;
        // SAFETY: loads has 16 elements.
        ok(unsafe { marconi_cache_lease_loads(self.c, lease, loads.as_mut_ptr(), 16, &mut n) });
        loads.truncate(n);
        if tier == marconi_tier::Device as u32 {
            assert!(loads.is_empty());
            if hit > 0 {
                assert!(
                    self.slots.values().any(|s| s[..] == input[..hit as usize]),
                    "a device hit no slot holds"
                );
            }
        } else {
            self.lower_hits += 1;
            let state = loads.last().unwrap();
            assert_eq!(state.kind, marconi_load_kind::State as u32);
            assert_eq!(state.position, hit);
            let want = input[..hit as usize].to_vec();
            let copies = if state.tier == marconi_tier::Host as u32 {
                &self.host
            } else {
                &self.store
            };
            assert!(copies.contains(&want), "a load of a chain the tier lacks");
        }
        let mut full = input.to_vec();
        full.extend_from_slice(output);
        let mut states = Vec::new();
        for p in self.lease_list(lease, true) {
            if p > hit && p as usize <= full.len() {
                states.push(self.save(&full[..p as usize]));
            }
        }
        states.push(self.save(&full));
        let mut pages: Vec<i64> = dev_pages.iter().map(|&p| i64::from(p)).collect();
        while pages.len() < full.len() {
            let p = i64::from(self.id());
            pages.push(p);
        }
        let full_ids: Vec<i64> = full.iter().map(|&t| i64::from(t)).collect();
        let mut taken = vec![0u8; states.len()];
        let mut r = marconi_admit_result::default();
        let t = Some(&mut taken[..]);
        ok(admit_i64(
            self.c, lease, &full_ids, &states, &pages, t, &mut r,
        ));
        for &p in &pages[r.kv_pages_taken_start as usize..r.kv_pages_taken_end as usize] {
            assert!(self.cache_pages.insert(p), "page {p} taken twice");
        }
        for (s, &t) in states.iter().zip(&taken) {
            if t == 1 {
                assert!(self.cache_slots.insert(s.slot));
            }
        }
        // SAFETY: valid handle and lease.
        ok(unsafe { marconi_cache_release(self.c, lease) });
        self.apply_ops();
        // The states the cache did not take stay the engine's: freed now.
        for (s, &t) in states.iter().zip(&taken) {
            if t == 0 {
                self.slots.remove(&s.slot);
            }
        }
        // SAFETY: a valid handle.
        ok(unsafe { marconi_cache_check(self.c) });
    }

    fn save(&mut self, tokens: &[u32]) -> marconi_saved_state {
        let slot = self.id();
        self.slots.insert(slot, tokens.to_vec());
        marconi_saved_state {
            position: tokens.len() as u32,
            slot,
        }
    }

    fn apply_ops(&mut self) {
        let mut ops = vec![marconi_tier_op::default(); 4096];
        let mut toks = vec![0u32; 1 << 20];
        let (st, no, _) = drain_tier_ops(marconi_cache_drain_ops, self.c, &mut ops, &mut toks);
        ok(st);
        for o in &ops[..no] {
            self.ops += 1;
            let at = o.tokens_offset as usize;
            let chain = toks[at..at + o.position as usize].to_vec();
            let write = o.kind == marconi_tier_op_kind::Write as u32;
            match (write, o.tier) {
                (true, t) if t == marconi_tier::Host as u32 => {
                    assert!(
                        self.slots.values().any(|s| *s == chain),
                        "a host write of a chain no device slot holds"
                    );
                    self.host.insert(chain);
                }
                (true, _) => {
                    assert!(self.host.contains(&chain), "a store write the host lacks");
                    self.store.insert(chain);
                }
                (false, t) if t == marconi_tier::Host as u32 => {
                    assert!(self.host.remove(&chain), "a host drop never written");
                }
                (false, _) => {
                    assert!(self.store.remove(&chain), "a store drop never written");
                }
            }
        }
        let mut pages = vec![0u32; 1 << 20];
        let mut slots = vec![0u32; 4096];
        let (st, np, ns) = drain_freed(self.c, &mut pages, &mut slots);
        ok(st);
        for p in &pages[..np] {
            assert!(
                self.cache_pages.remove(&i64::from(*p)),
                "page {p} freed but not the cache's"
            );
        }
        for s in &slots[..ns] {
            assert!(
                self.cache_slots.remove(s),
                "slot {s} freed but not the cache's"
            );
            assert!(self.slots.remove(s).is_some());
        }
    }
}

/// Conversations of `turns` turns, interleaved: (input, output).
fn workload(sessions: u32, turns: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut hist: Vec<Vec<u32>> = (0..sessions)
        .map(|s| (0..40).map(|i| 1_000 * (s + 1) + i).collect())
        .collect();
    let mut out = Vec::new();
    let mut next = 1_000_000u32;
    for _ in 0..turns {
        for h in hist.iter_mut() {
            let mut input = h.clone();
            input.extend(next..next + 10);
            next += 10;
            let output: Vec<u32> = (next..next + 10).collect();
            next += 10;
            h.clone_from(&input);
            h.extend_from_slice(&output);
            out.push((input, output));
        }
    }
    out
}

fn drain_events(ev: *const marconi_events, c: *const marconi_cache) -> usize {
    let mut buf = vec![0u8; 1 << 22];
    let mut n = 0usize;
    // SAFETY: live handles, buf has its length in bytes.
    ok(unsafe { marconi_events_drain(ev, c, 1.0, buf.as_mut_ptr(), buf.len(), &mut n) });
    n
}

/// SGLang's path through host and store tiers with the event stream on:
/// a small device evicts into the host, the host into the store; later
/// turns resume from them. Every load names a copy the engine holds, every
/// freed id was the cache's, the invariants hold after each request, and
/// both lookups (the tier lookup and the device view) run on the one handle.
#[test]
fn sglang_path_through_host_and_store_tiers_with_events() {
    for (write_mode, defer) in [(0u32, 0u32), (1, 0), (0, 1)] {
        let mut dev = device_config(400);
        dev.page_size = 1;
        let mut o = tier_options(600, 4_000);
        o.write_mode = write_mode;
        o.defer_moves = defer;
        dev.tiers = &o;
        let c = new_cache(&dev);
        let ecfg = init(marconi_events_config_init);
        let mut ev = ptr::null_mut();
        // SAFETY: live cache, valid config and out.
        ok(unsafe { marconi_events_new(c, &ecfg, &mut ev) });
        let mut e = Engine::new(c);
        let mut event_bytes = 0usize;
        for (i, (input, output)) in workload(6, 5).into_iter().enumerate() {
            // Every third request takes the device view.
            e.serve(&input, &output, i % 3 != 2);
            if defer == 1 {
                // SAFETY: a valid handle.
                ok(unsafe { marconi_cache_settle(c) });
                e.apply_ops();
            }
            event_bytes += drain_events(ev, c);
        }
        assert!(e.lower_hits > 0, "no request resumed from a lower tier");
        assert!(e.ops > 0);
        assert!(event_bytes > 0, "the device's events were published");
        let ts = tier_stats(c);
        assert_eq!(ts.requests, 30);
        assert!(ts.hits_by_tier[1] + ts.hits_by_tier[2] > 0);
        let s = cache_stats(c);
        assert_eq!(s.requests, 30, "the device saw every lookup");
        assert!(s.evictions > 0);
        // Evicting the device moves its content down: WRITE ops.
        let mut free = 0u64;
        // SAFETY: valid handle and out.
        ok(unsafe { marconi_cache_evict(c, u64::MAX, &mut free) });
        if defer == 1 {
            // SAFETY: a valid handle.
            ok(unsafe { marconi_cache_settle(c) });
        }
        let before = e.host.len();
        e.apply_ops();
        assert!(e.cache_slots.is_empty(), "every device state was freed");
        assert!(e.host.len() >= before);
        // SAFETY: valid handles, freed once.
        unsafe {
            ok(marconi_cache_check(c));
            marconi_events_free(ev, c);
            marconi_cache_free(c);
        }
    }
}

/// On a cache with tiers, marconi_cache_lookup is the device's view: its
/// hit is the device's own even where a lower tier holds a longer one, and
/// its lease has no loads; the tier lookup of the same input offers the
/// longer hit with its loads.
#[test]
fn the_plain_lookup_on_a_tiered_cache_is_the_device_view() {
    let mut dev = device_config(100);
    let o = tier_options(1_000, 0);
    dev.tiers = &o;
    let c = new_cache(&dev);
    let mut e = Engine::new(c);
    let a: Vec<u32> = (0..80).collect();
    let b: Vec<u32> = (1_000..1_080).collect();
    e.serve(&a, &[7; 5], true);
    // b evicts a from the device into the host.
    e.serve(&b, &[8; 5], true);
    let mut input = a.clone();
    input.extend([7; 5]);
    assert!(e.host.contains(&input), "a's chain went to the host");
    input.push(9);
    let mut l = marconi_lookup::default();
    // SAFETY: valid handle, arrays and out.
    ok(unsafe { marconi_cache_lookup(c, 0, input.as_ptr(), input.len(), MARCONI_NO_SLOT, &mut l) });
    let mut h = marconi_tiered_hit::default();
    // SAFETY: as above.
    ok(unsafe {
        marconi_cache_lookup_tiered(
            c,
            0,
            input.as_ptr(),
            input.len(),
            ptr::null(),
            0,
            ptr::null(),
            &mut h,
        )
    });
    assert_eq!(h.tier, marconi_tier::Host as u32);
    assert!(
        h.hit_tokens > l.hit_tokens,
        "{} vs {}",
        h.hit_tokens,
        l.hit_tokens
    );
    assert_eq!(l.hit_tokens, h.device_hit_tokens);
    let mut n = 99usize;
    // SAFETY: a size query.
    ok(unsafe { marconi_cache_lease_loads(c, l.lease, ptr::null_mut(), 0, &mut n) });
    assert_eq!(n, 0, "the device view loads nothing");
    // SAFETY: as above.
    let st = unsafe { marconi_cache_lease_loads(c, h.lease, ptr::null_mut(), 0, &mut n) };
    assert_eq!(st, marconi_status::BufferTooSmall);
    assert!(n > 0);
    // SAFETY: valid handle and leases.
    unsafe {
        ok(marconi_cache_release(c, l.lease));
        ok(marconi_cache_release(c, h.lease));
        ok(marconi_cache_check(c));
        marconi_cache_free(c);
    }
}

/// Every tier call on a cache configured without tiers: MARCONI_STATUS_UNSUPPORTED,
/// a message that says what to configure, nothing written; the deprecated
/// forwarders refuse the same way.
#[test]
fn every_tier_call_refuses_on_a_plain_cache() {
    let c = new_cache(&device_config(1_000));
    let tokens: Vec<u32> = (0..20).collect();
    let ids: Vec<i64> = (0..20).collect();
    let mut l = marconi_lookup::default();
    // SAFETY: valid handle, arrays and out.
    ok(unsafe { marconi_cache_lookup(c, 0, tokens.as_ptr(), 20, MARCONI_NO_SLOT, &mut l) });
    let mut hit = marconi_tiered_hit::default();
    let mut order = [marconi_load_order::default(); 4];
    let mut ops = [marconi_tier_op::default(); 4];
    let mut toks = [0u32; 4];
    let (mut n, mut m) = (7usize, 7usize);
    let mut ts = versioned::<marconi_tiered_stats>();
    let t = c.cast::<marconi_tiered>();
    let refused = |name: &str, st: marconi_status| {
        refusal(
            st,
            marconi_status::Unsupported,
            name,
            &[name, "marconi_cache_config.tiers"],
        );
    };
    // SAFETY (this block): a live handle and valid buffers.
    unsafe {
        refused(
            "marconi_cache_lookup_tiered",
            marconi_cache_lookup_tiered(
                c,
                0,
                tokens.as_ptr(),
                20,
                ptr::null(),
                0,
                ptr::null(),
                &mut hit,
            ),
        );
        refused(
            "marconi_cache_lookup_tiered_i64_flags",
            marconi_cache_lookup_tiered_i64_flags(c, 0, ids.as_ptr(), 20, 0, ptr::null(), &mut hit),
        );
        refused(
            "marconi_cache_lease_loads",
            marconi_cache_lease_loads(c, l.lease, order.as_mut_ptr(), 4, &mut n),
        );
        refused(
            "marconi_cache_report_load_failure",
            marconi_cache_report_load_failure(c, l.lease),
        );
        refused("marconi_cache_settle", marconi_cache_settle(c));
        refused(
            "marconi_cache_drain_ops",
            marconi_cache_drain_ops(c, ops.as_mut_ptr(), 4, &mut n, toks.as_mut_ptr(), 4, &mut m),
        );
        refused(
            "marconi_cache_tier_stats",
            marconi_cache_tier_stats(c, &mut ts),
        );
        // The deprecated forwarders refuse alike.
        refused(
            "marconi_cache_lookup_tiered",
            marconi_tiered_lookup(
                t,
                0,
                tokens.as_ptr(),
                20,
                ptr::null(),
                0,
                ptr::null(),
                &mut hit,
            ),
        );
        refused("marconi_cache_settle", marconi_tiered_settle(t));
    }
    assert_eq!(hit, marconi_tiered_hit::default(), "nothing written");
    assert_eq!((n, m), (7, 7), "no counts written");
    assert_eq!(ts.requests, 0);
    // The plain cache is unchanged by the refusals.
    // SAFETY: valid handle and lease.
    unsafe {
        ok(marconi_cache_release(c, l.lease));
        ok(marconi_cache_check(c));
        marconi_cache_free(c);
    }
}

/// Bad tier options are refused at marconi_cache_new; a tier options
/// struct smaller than its first version is refused by its init.
#[test]
fn bad_tier_options_are_refused() {
    let mut dev = device_config(1_000);
    let good = tier_options(1_000, 1_000);
    let bads: [fn(&mut marconi_tier_options); 6] = [
        |o| o.write_mode = 9,
        |o| o.exclusive = 2,
        |o| o.max_store_probe = 0,
        |o| o.reserved = 1,
        |o| o.host.capacity_bytes = 0,
        |o| o.host.bandwidth_bytes_per_s = f64::NAN,
    ];
    for bad in bads {
        let mut o = good;
        bad(&mut o);
        dev.tiers = &o;
        let mut c = ptr::null_mut();
        // SAFETY: valid config and out.
        let st = unsafe { marconi_cache_new(&dev, &mut c) };
        assert_eq!(st, marconi_status::InvalidConfig, "{o:?}");
        assert!(c.is_null());
    }
    let mut small = [0u64; 4];
    // SAFETY: small has 32 writable bytes.
    let st = unsafe { marconi_tier_options_init(small.as_mut_ptr().cast(), 16) };
    assert_eq!(st, marconi_status::UnsupportedStructSize);
    assert_eq!(small, [0u64; 4]);
}

/// A caller built against the previous header (marconi_cache_config
/// without `tiers`) gets a plain cache, whatever lies past its struct.
#[test]
fn a_config_of_the_previous_size_is_accepted() {
    let v4 = offset_of!(marconi_cache_config, tiers);
    let mut buf = vec![0xA5A5_A5A5_A5A5_A5A5u64; size_of::<marconi_cache_config>() / 8 + 1];
    let cfg = buf.as_mut_ptr().cast::<marconi_cache_config>();
    // SAFETY: buf holds more than v4 writable, aligned bytes.
    ok(unsafe { marconi_cache_config_init(cfg, v4) });
    // SAFETY: the first v4 bytes are initialised; capacity_bytes lies there.
    unsafe { (*cfg).capacity_bytes = 1 << 30 };
    let mut c = ptr::null_mut();
    // SAFETY: cfg has struct_size = v4 readable bytes.
    ok(unsafe { marconi_cache_new(cfg, &mut c) });
    // SAFETY: a live handle, freed once.
    unsafe {
        assert_eq!(marconi_cache_settle(c), marconi_status::Unsupported);
        marconi_cache_free(c);
    }
}
