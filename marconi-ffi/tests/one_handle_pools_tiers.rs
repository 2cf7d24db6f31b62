//! The one cache handle over memfd pools with lower tiers below them
//! (marconi_cache_config.pools and .tiers, written through), driven
//! through the C ABI only. An engine model keeps its own host and store
//! copies keyed by (namespace, tokens) and plays its part with bytes: each
//! KV page holds bytes derived from the tokens it covers and each state
//! bytes derived from its prefix (what a recompute would write), so every
//! device hit's pages and state, every host WRITE's source units (read
//! before the admission's leftovers are freed), every STORE write's and
//! DROP's copy, and every load of marconi_cache_lease_loads are checked;
//! loads land in the request's reserved units, which later device hits
//! check again. marconi_cache_check, the pool counters and the unit
//! accounting are checked after every request. lookup_tiered is refused
//! on such a cache, naming marconi_cache_lookup_pooled.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::pool::*;
use marconi::pooled::*;
use marconi::status::marconi_status;
use marconi::tiered::*;

mod common;
use common::*;

/// Tokens per page of the tiny hybrid: 512-byte pages, 2048-byte states.
const PAGE: u32 = 4;
const KV_BYTES: usize = 512;
const STATE_BYTES: usize = 2048;
/// Both pools: 24 KiB in 4 KiB chunks, a third of them states (4 slots,
/// 32 pages).
const BUDGET: u64 = 24 << 10;
const CHUNK: u64 = 4096;

/// The tiny hybrid of marconi-gpu's pooled tests: one attention, one SSM
/// and one MLP layer.
fn tiny() -> marconi_model_spec {
    marconi_model_spec {
        attn_layers: 1,
        ssm_layers: 1,
        mlp_layers: 1,
        moe_layers: 0,
        moe_top_k: 0,
        reserved: 0,
        d_model: 64,
        n_heads: 2,
        kv_heads: 2,
        head_dim: 16,
        ffn_dim: 128,
        ffn_matrices: 2,
        ssm_inner: 128,
        d_state: 8,
        ssm_state_channels: 64,
        conv_channels: 64,
        conv_kernel: 8,
        dtype_bytes: 2,
        state_dtype_bytes: 2,
    }
}

fn cache_config() -> marconi_cache_config {
    let mut cfg = init(marconi_cache_config_init);
    cfg.model_preset = ptr::null();
    cfg.model = tiny();
    cfg.page_size = PAGE;
    cfg.min_branch_depth = 0;
    cfg.alpha_mode = marconi_alpha_mode::Fixed as u32;
    cfg.alpha = 1.0;
    cfg.tuner_adoption = marconi_alpha_adoption::Deterministic as u32;
    cfg
}

fn pool_config() -> marconi_pool_config {
    let mut p = init(marconi_pool_config_init);
    p.backend = marconi_pool_backend::Memfd as u32;
    p.budget_bytes = BUDGET;
    p.chunk_bytes = CHUNK;
    p.state_fraction = 0.3334;
    p.migration = marconi_pool_migration::Static as u32;
    p
}

/// Write-through tiers: a host of `host` bytes, a store of `store` bytes
/// (0: none). The tiny model recomputes faster than any load: load anyway.
fn tier_options(host: u64, store: u64) -> marconi_tier_options {
    let mut o = init(marconi_tier_options_init);
    o.write_mode = marconi_tier_write::Through as u32;
    o.host.capacity_bytes = host;
    o.store.capacity_bytes = store;
    o.always_load = 1;
    o
}

/// A cache over memfd pools, with `tiers` below them when given.
fn new_over_pools(tiers: Option<&marconi_tier_options>) -> *mut marconi_cache {
    let mut cfg = cache_config();
    let p = pool_config();
    cfg.pools = &p;
    cfg.tiers = tiers.map_or(ptr::null(), |t| t as *const _);
    let c = new_cache(&cfg);
    assert!(!c.is_null());
    c
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
    content(&tokens[..(i + 1) * PAGE as usize], 0x6b76, KV_BYTES)
}

/// What the state after `tokens` holds.
fn state(tokens: &[u32]) -> Vec<u8> {
    content(tokens, 0x5747, STATE_BYTES)
}

/// The bytes of live unit `h` of `c` (a host address: memfd pools).
fn unit<'a>(c: *const marconi_cache, h: u64) -> &'a mut [u8] {
    let mut loc = marconi_unit_location::default();
    // SAFETY: one handle, one location.
    ok(unsafe { marconi_cache_resolve(c, &h, 1, &mut loc, 1) });
    assert_ne!(loc.address, 0, "memfd units have a host address");
    let want = if loc.kind == marconi_pool_kind::Kv as u32 {
        KV_BYTES
    } else {
        STATE_BYTES
    };
    assert!(loc.unit_bytes as usize >= want, "{loc:?}");
    // SAFETY: a live memfd unit of unit_bytes bytes, mapped in this
    // process while the handle is live; no other reference to it is held
    // across calls.
    unsafe { std::slice::from_raw_parts_mut(loc.address as *mut u8, want) }
}

fn read(c: *const marconi_cache, h: u64) -> Vec<u8> {
    unit(c, h).to_vec()
}

fn write(c: *const marconi_cache, h: u64, data: &[u8]) {
    unit(c, h).copy_from_slice(data);
}

/// The drained tier ops: (op, its chain's tokens).
fn drain_ops(c: *const marconi_cache) -> Vec<(marconi_tier_op, Vec<u32>)> {
    drain_all_tier_ops(marconi_cache_drain_ops, c)
}

/// marconi_cache_check passes, every unit in use is the cache's (the
/// caller holds none between requests), no lease is outstanding (in the
/// C handle or the device), nothing is pinned.
fn check_all(c: *const marconi_cache) {
    // SAFETY: live handle.
    ok(unsafe { marconi_cache_check(c) });
    let h = held(c);
    let ps = pool_stats(c);
    let pages = h.iter().filter(|&&x| !is_state(c, x)).count() as u64;
    assert_eq!(
        (ps.held_kv_pages, ps.held_state_slots),
        (pages, h.len() as u64 - pages)
    );
    assert_eq!(
        (
            ps.kv_capacity - ps.kv_free,
            ps.state_capacity - ps.state_free
        ),
        (ps.held_kv_pages, ps.held_state_slots),
        "units in use that the cache does not hold: a leak"
    );
    assert_eq!(ps.leases, 0);
    let s = cache_stats(c);
    assert_eq!(s.leases, 0, "a lease the device still holds");
    assert_eq!(s.evictable_bytes, s.used_bytes, "pinned with no lease out");
}

fn is_state(c: *const marconi_cache, h: u64) -> bool {
    let mut loc = marconi_unit_location::default();
    // SAFETY: one handle, one location.
    ok(unsafe { marconi_cache_resolve(c, &h, 1, &mut loc, 1) });
    loc.kind == marconi_pool_kind::State as u32
}

/// A chain's bytes held by the engine in a lower tier.
#[derive(Clone)]
struct Copy {
    state: Vec<u8>,
    pages: Vec<Vec<u8>>,
}

/// The engine: its lower-tier copies and what it saw.
#[derive(Default)]
struct Engine {
    /// Host and store copies by (namespace, chain).
    lower: [HashMap<(u64, Vec<u32>), Copy>; 2],
    /// Requests whose hit came from the host / the store (their loads
    /// carried out and checked).
    host_hits: u64,
    store_hits: u64,
    /// Device hits whose pages and state were checked.
    device_hits: u64,
    /// Device hit pages checked that a load had landed earlier.
    landed_rechecked: u64,
    host_writes: u64,
    store_writes: u64,
    drops: u64,
    input_tokens: u64,
    hit_tokens: u64,
    /// Pages (by handle) that a load filled, until freed or rechecked.
    landed: std::collections::HashSet<u64>,
}

fn lower(tier: u32) -> usize {
    match tier {
        t if t == marconi_tier::Host as u32 => 0,
        t if t == marconi_tier::Store as u32 => 1,
        t => panic!("tier {t}: the device keeps no engine copy"),
    }
}

/// The units an admission was given, which a host WRITE reads.
struct Admitted<'a> {
    pages: &'a [u64],
    states: &'a [marconi_pooled_state],
}

impl Engine {
    /// Carries out `ops`: a host WRITE copies from this admission's units
    /// (`adm`; none outside an admission), a store WRITE from the host
    /// copy, a DROP frees a copy; every source checked by its bytes.
    fn carry_out(
        &mut self,
        c: *const marconi_cache,
        ops: Vec<(marconi_tier_op, Vec<u32>)>,
        adm: Option<&Admitted>,
    ) {
        for (op, prefix) in ops {
            assert_eq!(op.reserved, 0);
            let key = (op.ns, prefix.clone());
            if op.kind == marconi_tier_op_kind::Drop as u32 {
                let gone = self.lower[lower(op.tier)].remove(&key);
                assert!(gone.is_some(), "a DROP of a copy the engine never made");
                assert_eq!(op.bytes, 0);
                self.drops += 1;
                continue;
            }
            assert_eq!(op.kind, marconi_tier_op_kind::Write as u32);
            if op.tier == marconi_tier::Host as u32 {
                let adm = adm.expect("a host WRITE outside an admission");
                let s = adm
                    .states
                    .iter()
                    .find(|s| s.position == op.position)
                    .expect("a host WRITE reads a state of the admission that decided it");
                let n = op.position.div_ceil(PAGE) as usize;
                assert!(n <= adm.pages.len());
                let copy = Copy {
                    state: read(c, s.state_handle),
                    pages: adm.pages[..n].iter().map(|&h| read(c, h)).collect(),
                };
                assert_eq!(copy.state, state(&prefix), "the state written down");
                for (i, p) in copy.pages.iter().enumerate() {
                    assert_eq!(p, &kv(&prefix, i), "page {i} written down");
                }
                self.lower[0].insert(key, copy);
                self.host_writes += 1;
            } else {
                assert_eq!(
                    op.tier,
                    marconi_tier::Store as u32,
                    "a WRITE into the device"
                );
                let copy = self.lower[0]
                    .get(&key)
                    .expect("a store WRITE reads a host copy")
                    .clone();
                self.lower[1].insert(key, copy);
                self.store_writes += 1;
            }
        }
    }

    /// One request through the one handle: lookup, the device hit checked,
    /// reserve, loads carried out into the reserved units, prefill, admit,
    /// ops, free what was not taken, release, ops. `tiers`: the cache has
    /// lower tiers.
    fn request(
        &mut self,
        c: *const marconi_cache,
        tiers: bool,
        ns: u64,
        full: &[u32],
        input: usize,
    ) {
        let mut l = marconi_pooled_lookup::default();
        // SAFETY: live handle, full readable for input tokens.
        ok(unsafe { marconi_cache_lookup_pooled(c, ns, full.as_ptr(), input, &mut l) });
        assert!((l.hit_tokens as usize) < input);
        self.input_tokens += input as u64;
        self.hit_tokens += u64::from(l.hit_tokens);
        let n_dev = l.n_kv_pages as usize;
        let mut dev = vec![0u64; n_dev];
        let mut n = 0usize;
        // SAFETY: dev has n_dev writable elements.
        ok(unsafe { marconi_cache_lease_kv_handles(c, l.lease, dev.as_mut_ptr(), n_dev, &mut n) });
        assert_eq!(n, n_dev);
        for (i, &h) in dev.iter().enumerate() {
            assert_eq!(read(c, h), kv(full, i), "device page {i}");
            if self.landed.remove(&h) {
                self.landed_rechecked += 1;
            }
        }
        let device_hit = l.state_handle != 0;
        if device_hit {
            assert_eq!(n_dev as u32, l.hit_tokens / PAGE, "a device hit's pages");
            assert_eq!(
                read(c, l.state_handle),
                state(&full[..l.hit_tokens as usize]),
                "the device hit's state"
            );
            self.device_hits += 1;
        }
        let mut plan = vec![0u32; l.n_plan as usize];
        // SAFETY: plan has n_plan writable elements.
        ok(unsafe { marconi_cache_lease_plan(c, l.lease, plan.as_mut_ptr(), plan.len(), &mut n) });
        assert_eq!(n, plan.len());
        let mut loads = vec![marconi_load_order::default(); 16];
        if tiers {
            // SAFETY: loads has its length in writable elements.
            ok(unsafe {
                marconi_cache_lease_loads(c, l.lease, loads.as_mut_ptr(), loads.len(), &mut n)
            });
            loads.truncate(n);
        } else {
            loads.clear();
        }
        let full_pages = full.len() / PAGE as usize;
        let end = (full_pages as u32) * PAGE;
        let mut positions: Vec<u32> = plan.iter().copied().filter(|&p| p != end).collect();
        positions.push(end);
        let mut pages = vec![0u64; full_pages];
        pages[..n_dev].copy_from_slice(&dev);
        let mut slots = vec![0u64; positions.len()];
        let want_pages = full_pages - n_dev;
        // SAFETY: buffers of the given capacities.
        ok(unsafe {
            marconi_cache_reserve(
                c,
                want_pages as u32,
                slots.len() as u32,
                pages[n_dev..].as_mut_ptr(),
                want_pages,
                slots.as_mut_ptr(),
                slots.len(),
            )
        });
        // The loads, from the engine's own copies into the reserved units.
        let mut loaded_state: Option<(u32, u32, Vec<u8>)> = None;
        let mut loaded_to = n_dev;
        for o in &loads {
            let copies = &self.lower[lower(o.tier)];
            if o.kind == marconi_load_kind::Kv as u32 {
                let src = copies
                    .iter()
                    .find(|((m, chain), _)| {
                        *m == ns
                            && chain.len() >= o.end as usize
                            && chain[..o.end as usize] == full[..o.end as usize]
                    })
                    .map(|(_, c)| c.clone())
                    .expect("a KV load reads a chain the engine holds");
                let first = (o.start / PAGE) as usize;
                assert!(first >= n_dev, "a load into a page the device hit holds");
                let last = o.end.div_ceil(PAGE) as usize;
                for (i, &h) in pages.iter().enumerate().take(last).skip(first) {
                    assert_eq!(src.pages[i], kv(full, i), "loaded page {i}");
                    write(c, h, &src.pages[i]);
                    self.landed.insert(h);
                    loaded_to = loaded_to.max(i + 1);
                }
                assert!(loaded_to >= last, "a load past the pages reserved");
            } else {
                assert_eq!(o.kind, marconi_load_kind::State as u32);
                let src = copies
                    .get(&(ns, full[..o.position as usize].to_vec()))
                    .expect("a state load reads a chain the engine holds");
                assert_eq!(src.state, state(&full[..o.position as usize]));
                loaded_state = Some((o.position, o.tier, src.state.clone()));
            }
        }
        if !device_hit && l.hit_tokens > 0 {
            let (pos, tier, _) = loaded_state
                .as_ref()
                .expect("a lower tier's hit brings its state");
            assert_eq!(*pos, l.hit_tokens, "the hit's state was loaded");
            assert!(
                loaded_to as u32 * PAGE >= l.hit_tokens,
                "the hit's KV was loaded: {l:?} {loads:?}"
            );
            if *tier == marconi_tier::Host as u32 {
                self.host_hits += 1;
            } else {
                self.store_hits += 1;
            }
        } else {
            assert!(loads.is_empty(), "loads without a lower tier's hit");
        }
        // Prefill: the pages past what was reused or loaded; the states
        // saved (the hit's own, where planned, is the loaded one).
        for (i, &h) in pages.iter().enumerate().skip(loaded_to) {
            write(c, h, &kv(full, i));
        }
        let states = pooled_states(&positions, &slots);
        for s in &states {
            match &loaded_state {
                Some((p, _, bytes)) if *p == s.position => write(c, s.state_handle, bytes),
                _ => write(c, s.state_handle, &state(&full[..s.position as usize])),
            }
        }
        let mut taken = vec![0u8; states.len()];
        let mut r = marconi_admit_result::default();
        ok(pooled_admit(
            c, l.lease, full, &states, &pages, &mut taken, &mut r,
        ));
        // The host writes read this admission's units: before any is freed.
        let ops = if tiers { drain_ops(c) } else { Vec::new() };
        self.carry_out(
            c,
            ops,
            Some(&Admitted {
                pages: &pages,
                states: &states,
            }),
        );
        let mine = untaken(&pages, n_dev, &r, &states, &taken);
        for h in &mine {
            self.landed.remove(h);
        }
        // SAFETY: mine readable.
        ok(unsafe { marconi_cache_free_units(c, mine.as_ptr(), mine.len()) });
        // SAFETY: live handle and lease.
        ok(unsafe { marconi_cache_release(c, l.lease) });
        if tiers {
            let ops = drain_ops(c);
            self.carry_out(c, ops, None);
        }
        check_all(c);
        // Units the cache let go are no longer rechecked.
        let now: std::collections::HashSet<u64> = held(c).into_iter().collect();
        self.landed.retain(|h| now.contains(h));
    }
}

/// Requests for the documents of `order` (each `pages` pages long),
/// `rounds` times over, each followed by a fresh question and answer of one
/// page each (the answer not looked up).
fn workload(order: &[u32], pages: u32, rounds: u32) -> Vec<(Vec<u32>, usize)> {
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

/// 8 documents cycled: more than the device holds.
const CYCLE: [u32; 8] = [0, 1, 2, 3, 4, 5, 6, 7];

fn free(c: *mut marconi_cache) {
    // SAFETY: a live handle, freed once.
    unsafe { marconi_cache_free(c) };
}

/// More documents cycled than the device holds: the host serves them, its
/// loads bring the bytes written down, and the hit rate beats the same
/// requests on the pools alone.
#[test]
fn host_hits_load_the_bytes_written_down() {
    let o = tier_options(4 << 20, 0);
    let c = new_over_pools(Some(&o));
    check_all(c);
    let mut e = Engine::default();
    // 8 documents of 6 pages cycled: more than the device's 32 pages.
    for (full, input) in workload(&CYCLE, 6, 4) {
        e.request(c, true, 7, &full, input);
    }
    assert!(e.host_writes > 0, "nothing was written down");
    assert!(e.host_hits > 0, "no hit came from the host");
    let s = tier_stats(c);
    assert_eq!(e.host_hits, s.hits_by_tier[marconi_tier::Host as usize]);
    assert!(s.hits_by_tier[marconi_tier::Host as usize] > 0);
    assert_eq!(s.writes[marconi_tier::Host as usize], e.host_writes);
    assert_eq!(s.hit_tokens, e.hit_tokens, "the tiers' hit tokens");
    assert_eq!(s.input_tokens, e.input_tokens);
    // The same requests over the same pools without tiers skip less.
    let plain = new_over_pools(None);
    let mut p = Engine::default();
    for (full, input) in workload(&CYCLE, 6, 4) {
        p.request(plain, false, 7, &full, input);
    }
    assert_eq!(p.host_hits + p.store_hits, 0);
    let with = e.hit_tokens as f64 / e.input_tokens as f64;
    let without = p.hit_tokens as f64 / p.input_tokens as f64;
    let ts = s.hit_tokens as f64 / s.input_tokens as f64;
    eprintln!(
        "token hit rate over pools with a host tier {with:.3} (tier stats {ts:.3}, host hits {}, \
         host writes {}), pools alone {without:.3}",
        e.host_hits, e.host_writes
    );
    assert!(
        with > without + 0.2 && ts > without + 0.2,
        "hit rate with a host tier {with:.3} ({ts:.3} by marconi_cache_tier_stats), without {without:.3}"
    );
    free(plain);
    free(c);
}

/// Device hits (their pages and states checked, pages a load filled
/// among them) mix with host hits.
#[test]
fn device_and_host_hits_mix_and_loaded_units_hold_on_the_device() {
    let o = tier_options(4 << 20, 0);
    let c = new_over_pools(Some(&o));
    let mut e = Engine::default();
    // Document 0 between the others, each other one asked twice in a row:
    // the second time hits the device, on the pages its host hit loaded.
    let order: Vec<u32> = (1..8).flat_map(|d| [d, d, 0]).collect();
    for (full, input) in workload(&order, 6, 4) {
        e.request(c, true, 9, &full, input);
    }
    assert!(
        e.device_hits > 0 && e.host_hits > 0,
        "device hits {}, host hits {}",
        e.device_hits,
        e.host_hits
    );
    assert!(
        e.landed_rechecked > 0,
        "no page a load filled was hit on the device again"
    );
    let s = tier_stats(c);
    assert_eq!(e.host_hits, s.hits_by_tier[marconi_tier::Host as usize]);
    free(c);
}

/// A store below a host with room for about two documents: the host drops
/// what it evicts, the store receives it (from the engine's host copy)
/// and serves hits; settle runs nothing left waiting.
#[test]
fn a_store_below_a_small_host_receives_what_the_host_drops() {
    let o = tier_options(2 * 6 * 4 * 128 + 2 * 2048 + 4096, 4 << 20);
    let c = new_over_pools(Some(&o));
    let mut e = Engine::default();
    for (full, input) in workload(&CYCLE, 6, 4) {
        e.request(c, true, 3, &full, input);
        // SAFETY: live handle.
        ok(unsafe { marconi_cache_settle(c) });
        assert!(drain_ops(c).is_empty(), "settle found moves left waiting");
    }
    let s = tier_stats(c);
    assert!(e.drops > 0, "the host dropped nothing");
    assert!(e.store_writes > 0, "nothing reached the store");
    assert!(e.store_hits > 0, "no hit came from the store: {s:?}");
    assert_eq!(e.store_hits, s.hits_by_tier[marconi_tier::Store as usize]);
    assert_eq!(e.host_hits, s.hits_by_tier[marconi_tier::Host as usize]);
    assert_eq!(s.writes[marconi_tier::Store as usize], e.store_writes);
    assert!(s.used_bytes[marconi_tier::Host as usize] <= o.host.capacity_bytes);
    free(c);
}

/// On a cache over pools with tiers: lookup_tiered refused naming
/// marconi_cache_lookup_pooled, nothing written; a load failure is
/// reported on a live lease only and counted.
#[test]
fn lookup_tiered_is_refused_and_load_failures_count() {
    let o = tier_options(4 << 20, 0);
    let c = new_over_pools(Some(&o));
    let toks: Vec<u32> = (0..40).collect();
    let mut hit = marconi_tiered_hit::default();
    let before = hit;
    // SAFETY: live handle, toks readable, hit writable.
    let st = unsafe {
        marconi_cache_lookup_tiered(
            c,
            0,
            toks.as_ptr(),
            toks.len(),
            ptr::null(),
            0,
            ptr::null(),
            &mut hit,
        )
    };
    unsupported(st, &["marconi_cache_lookup_pooled"]);
    assert_eq!(hit, before, "nothing written");
    assert_eq!(pool_stats(c).requests, 0, "nothing looked up");
    // SAFETY: live handle; no such lease.
    let st = unsafe { marconi_cache_report_load_failure(c, 12345) };
    assert_eq!(st, marconi_status::UnknownLease, "{}", last_error());
    let mut l = marconi_pooled_lookup::default();
    // SAFETY: live handle, toks readable.
    ok(unsafe { marconi_cache_lookup_pooled(c, 0, toks.as_ptr(), toks.len(), &mut l) });
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_report_load_failure(c, l.lease) });
    assert_eq!(tier_stats(c).load_failures, 1);
    // SAFETY: as above.
    ok(unsafe { marconi_cache_release(c, l.lease) });
    check_all(c);
    free(c);
}
