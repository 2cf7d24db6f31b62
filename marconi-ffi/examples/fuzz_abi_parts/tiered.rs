//! The tiered cache driven as an engine drives it (`op_tiered`): random
//! tier shapes (page size 1 or 4, write-back or write-through, exclusive or
//! inclusive, moves deferred or not, with or without a store tier), chat
//! sessions in two or three namespaces served by two handles that share a
//! directory store (two engine processes), every op replayed in order on a
//! model of the engine's copies and the device slots handed back reused.
//!
//! Each engine is built either through the deprecated tiered handle
//! (`marconi_tiered_new`, its uint32 calls) or as the one cache handle with
//! tiers (`marconi_cache_new` with `marconi_cache_config.tiers`): int64
//! lookups with random flags (the tier lookup or the device view),
//! `marconi_cache_admit_i64`, the `marconi_cache_*` tier calls, and the
//! device's event stream drained after each request on some.
//!
//! Checked after every request (after `settle` when moves are deferred):
//! - the engine's copies equal each lower tier's claims byte for byte (the
//!   KV of the union of their chains plus one state each == `used_bytes`);
//! - a WRITE's bytes are the chain's (its KV and its state), and
//!   `bytes_written` sums them;
//! - a host WRITE reads a device slot the engine still holds (never one
//!   `drain_freed` already handed back), a store WRITE a host copy;
//! - a DROP drops a copy that exists; a freed slot was the cache's, once;
//! - namespaces never meet: a hit in namespace n resumes from a prefix
//!   admitted in n, a shared (store probe) hit from a state written in n.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::mem::{size_of, MaybeUninit};
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::events::*;
use marconi::status::marconi_status as St;
use marconi::store::*;
use marconi::tiered::*;

use super::Rng;
use crate::common::{admit_by, drain_freed, versioned};

type Chain = (u64, Vec<u32>);

struct Model {
    kv: u64,
    state: u64,
}

impl Model {
    fn chain(&self, tokens: u64) -> u64 {
        tokens * self.kv + self.state
    }

    /// Bytes of a set of chains: the KV of the union of their prefixes and
    /// one state each. KV is shared in whole pages only (two chains share
    /// the pages of their common prefix rounded down to `page`).
    fn bytes(&self, chains: &BTreeSet<Chain>, page: usize) -> u64 {
        let mut tokens = 0u64;
        let mut prev: Option<&Chain> = None;
        for c in chains {
            let lcp = match prev {
                Some(p) if p.0 == c.0 => {
                    p.1.iter().zip(&c.1).take_while(|(a, b)| a == b).count() / page * page
                }
                _ => 0,
            };
            tokens += (c.1.len() - lcp) as u64;
            prev = Some(c);
        }
        tokens * self.kv + chains.len() as u64 * self.state
    }
}

/// One engine process: its handle, its device slots and its copies.
struct Engine {
    t: *mut marconi_tiered,
    /// Built as the one cache handle with tiers (`t` is that cache).
    one: bool,
    /// The device's event stream (one handle only; NULL when off).
    events: *mut marconi_events,
    defer: bool,
    page: usize,
    slots: BTreeMap<u32, Chain>,
    /// States the cache did not take: still in the engine's slots until
    /// the admission's ops are replayed (a state the device could not hold
    /// goes to the host from there).
    untaken: Vec<Chain>,
    next_slot: u32,
    host: BTreeSet<Chain>,
    store: BTreeSet<Chain>,
    written: [u64; 3],
    /// Sequences admitted, per namespace.
    admitted: BTreeMap<u64, Vec<Vec<u32>>>,
}

/// A call that takes only the handle: as the cache the one handle is, and
/// as the deprecated tiered handle.
type HandleCall = (
    unsafe extern "C" fn(*const marconi_cache) -> St,
    unsafe extern "C" fn(*const marconi_tiered) -> St,
);

impl Engine {
    /// `call` on the handle, in the form the handle was built for.
    fn on_handle(&self, call: HandleCall) -> St {
        // SAFETY: a live handle of the kind each form takes.
        unsafe {
            if self.one {
                call.0(self.t.cast())
            } else {
                call.1(self.t)
            }
        }
    }
}

/// What one life found, and the calls it made.
pub(crate) struct Life {
    pub(crate) calls: u64,
    pub(crate) findings: Vec<String>,
    pub(crate) requests: u64,
    /// Requests served through the one cache handle with tiers.
    pub(crate) one_handle_requests: u64,
}

struct Ctx<'a> {
    life: &'a mut Life,
    m: Model,
    store: *mut marconi_store,
    /// (ns, chain) written into the shared store, by any engine.
    shared: BTreeSet<Chain>,
    /// The int64 lookup flags of the current request (one handle).
    rng_flags: u32,
    /// The current request takes the device view (one handle).
    device_view: bool,
}

impl Ctx<'_> {
    fn find(&mut self, s: String) {
        if self.life.findings.len() < 20 {
            self.life.findings.push(s);
        }
    }

    fn ok(&mut self, what: &str, st: St) -> bool {
        self.life.calls += 1;
        if st != St::Ok {
            let e = super::last_error();
            self.find(format!("tiered {what}: {st:?} ({e})"));
            return false;
        }
        true
    }

    /// A struct as its `*_init` call (`what`) fills it at its full size;
    /// None, noted, where the call fails.
    fn init<T>(
        &mut self,
        what: &str,
        init: unsafe extern "C" fn(*mut T, usize) -> St,
    ) -> Option<T> {
        let mut v = MaybeUninit::<T>::uninit();
        // SAFETY: v has sizeof(T) writable bytes.
        let st = unsafe { init(v.as_mut_ptr(), size_of::<T>()) };
        // SAFETY: the init call succeeded: every field is set.
        self.ok(what, st).then(|| unsafe { v.assume_init() })
    }
}

fn new_tiered(
    ctx: &mut Ctx<'_>,
    rng: &mut Rng,
    shape: &mut String,
) -> Option<(Engine, Box<marconi_cache_config>)> {
    let page = if rng.below(2) == 0 { 1 } else { 4 };
    let mut dev = Box::new(ctx.init("cache_config_init", marconi_cache_config_init)?);
    dev.capacity_bytes = ctx.m.chain(rng.range(80, 400));
    dev.page_size = page;
    dev.checkpoint_grid = page;
    let mut cfg = ctx.init("tiered_config_init", marconi_tiered_config_init)?;
    cfg.device = &*dev;
    cfg.write_mode = rng.below(2) as u32;
    cfg.exclusive = rng.below(2) as u32;
    cfg.defer_moves = rng.below(2) as u32;
    cfg.store_states_hold_kv = 1;
    cfg.host.capacity_bytes = ctx.m.chain(rng.range(100, 900));
    if rng.below(3) > 0 {
        cfg.store.capacity_bytes = ctx.m.chain(rng.range(200, 2000));
        cfg.store.bandwidth_bytes_per_s = 20e9;
        cfg.store.latency_s = 10e-6;
    }
    *shape = format!(
        "page {page} write {} exclusive {} defer {} device {} host {} store {}",
        cfg.write_mode,
        cfg.exclusive,
        cfg.defer_moves,
        dev.capacity_bytes,
        cfg.host.capacity_bytes,
        cfg.store.capacity_bytes
    );
    let one = rng.below(2) == 0;
    let mut t = ptr::null_mut();
    let mut events = ptr::null_mut();
    if one {
        let mut o = ctx.init("tier_options_init", marconi_tier_options_init)?;
        o.write_mode = cfg.write_mode;
        o.exclusive = cfg.exclusive;
        o.defer_moves = cfg.defer_moves;
        o.store_states_hold_kv = cfg.store_states_hold_kv;
        o.host = cfg.host;
        o.store = cfg.store;
        dev.tiers = &o;
        let mut c = ptr::null_mut();
        // SAFETY: valid config (the options live during the call) and out.
        let st = unsafe { marconi_cache_new(&*dev, &mut c) };
        dev.tiers = ptr::null();
        if !ctx.ok("cache_new (tiers)", st) {
            return None;
        }
        t = c.cast();
        if rng.below(2) == 0 {
            if let Some(ecfg) = ctx.init("events_config_init", marconi_events_config_init) {
                // SAFETY: a live cache, a valid config and out.
                let st = unsafe { marconi_events_new(c, &ecfg, &mut events) };
                ctx.ok("events_new (tiers)", st);
            }
        }
        shape.push_str(&format!(
            " one-handle events {}",
            u32::from(!events.is_null())
        ));
    } else {
        // SAFETY: valid config (its device lives in the Box) and out.
        let st = unsafe { marconi_tiered_new(&cfg, &mut t) };
        if !ctx.ok("tiered_new", st) {
            return None;
        }
    }
    Some((
        Engine {
            t,
            one,
            events,
            defer: cfg.defer_moves != 0,
            page: page as usize,
            slots: BTreeMap::new(),
            untaken: Vec::new(),
            next_slot: 0,
            host: BTreeSet::new(),
            store: BTreeSet::new(),
            written: [0; 3],
            admitted: BTreeMap::new(),
        },
        dev,
    ))
}

fn drain_ops(
    ctx: &mut Ctx<'_>,
    t: *const marconi_tiered,
    one: bool,
) -> Vec<(marconi_tier_op, Vec<u32>)> {
    let (mut no, mut nt) = (0usize, 0usize);
    let drain = if one {
        // SAFETY: the same arguments, the handle seen as the cache it is.
        |t: *const marconi_tiered, o, oc, on, k, kc, kn| unsafe {
            marconi_cache_drain_ops(t.cast(), o, oc, on, k, kc, kn)
        }
    } else {
        // SAFETY: as above.
        |t, o, oc, on, k, kc, kn| unsafe { marconi_tiered_drain_ops(t, o, oc, on, k, kc, kn) }
    };
    let st = drain(t, ptr::null_mut(), 0, &mut no, ptr::null_mut(), 0, &mut nt);
    ctx.life.calls += 1;
    if no == 0 {
        ctx.ok("drain_ops (size)", st);
        return Vec::new();
    }
    if st != St::BufferTooSmall {
        ctx.find(format!("drain_ops size query of {no} ops: {st:?}"));
        return Vec::new();
    }
    let mut ops = vec![marconi_tier_op::default(); no];
    let mut toks = vec![0u32; nt];
    let st = drain(
        t,
        ops.as_mut_ptr(),
        no,
        &mut no,
        toks.as_mut_ptr(),
        nt,
        &mut nt,
    );
    if !ctx.ok("drain_ops", st) {
        return Vec::new();
    }
    ops.truncate(no);
    ops.into_iter()
        .map(|o| {
            let s = o.tokens_offset as usize;
            let tokens = toks
                .get(s..s + o.position as usize)
                .map(<[u32]>::to_vec)
                .unwrap_or_default();
            (o, tokens)
        })
        .collect()
}

/// Replays the ops, then takes the freed ids (in that order, as the header
/// asks).
fn replay(ctx: &mut Ctx<'_>, e: &mut Engine, what: &str) {
    for (o, tokens) in drain_ops(ctx, e.t, e.one) {
        let chain = (o.ns, tokens);
        let host = o.tier == marconi_tier::Host as u32;
        if o.kind == marconi_tier_op_kind::Write as u32 {
            let want = ctx.m.chain(o.position as u64);
            if o.bytes != want {
                ctx.find(format!(
                    "{what}: a WRITE of {} tokens charges {} bytes, the chain is {want}",
                    o.position, o.bytes
                ));
            }
            e.written[o.tier as usize] += o.bytes;
            if host {
                if !e.slots.values().chain(&e.untaken).any(|c| *c == chain) {
                    ctx.find(format!(
                        "{what}: a host WRITE (ns {}, {} tokens) of a chain no device slot of the engine holds (handed back already?)",
                        chain.0,
                        chain.1.len()
                    ));
                }
                e.host.insert(chain);
            } else {
                if !e.host.contains(&chain) {
                    ctx.find(format!(
                        "{what}: a store WRITE of a chain the host copy lacks"
                    ));
                }
                if !ctx.store.is_null() {
                    let v = blob(&chain);
                    // SAFETY: valid store, tokens and data.
                    let st = unsafe {
                        marconi_store_put_state_ns(
                            ctx.store,
                            chain.0,
                            chain.1.as_ptr(),
                            chain.1.len(),
                            chain.1.len(),
                            v.as_ptr(),
                            v.len(),
                        )
                    };
                    if ctx.ok("store_put_state_ns", st) {
                        ctx.shared.insert(chain.clone());
                    }
                }
                e.store.insert(chain);
            }
        } else {
            let set = if host { &mut e.host } else { &mut e.store };
            if !set.remove(&chain) {
                ctx.find(format!(
                    "{what}: a DROP of a chain never written (tier {})",
                    o.tier
                ));
            }
        }
    }
    let mut slots = vec![0u32; 8192];
    let mut pages = vec![0u32; 1];
    // A tiered handle is a cache.
    let (st, _, ns) = drain_freed(e.t.cast(), &mut pages, &mut slots);
    if !ctx.ok("drain_freed", st) {
        return;
    }
    for s in &slots[..ns] {
        if e.slots.remove(s).is_none() {
            ctx.find(format!("{what}: slot {s} freed twice or never taken"));
        }
    }
}

fn stats(ctx: &mut Ctx<'_>, t: *const marconi_tiered, one: bool) -> Option<marconi_tiered_stats> {
    let mut s = versioned::<marconi_tiered_stats>();
    // SAFETY: valid handle and out.
    let st = unsafe {
        if one {
            marconi_cache_tier_stats(t.cast(), &mut s)
        } else {
            marconi_tiered_get_stats(t, &mut s)
        }
    };
    ctx.ok("get_stats", st).then_some(s)
}

fn check_copies(ctx: &mut Ctx<'_>, e: &Engine, what: &str) {
    let Some(s) = stats(ctx, e.t, e.one) else {
        return;
    };
    let (h, st) = (ctx.m.bytes(&e.host, e.page), ctx.m.bytes(&e.store, e.page));
    if h != s.used_bytes[1] || st != s.used_bytes[2] {
        ctx.find(format!(
            "{what}: the engine's copies hold host {h} / store {st} bytes, the tiers claim {} / {}",
            s.used_bytes[1], s.used_bytes[2]
        ));
    }
    if e.written[1] != s.bytes_written[1] || e.written[2] != s.bytes_written[2] {
        ctx.find(format!(
            "{what}: WRITE bytes sum to {:?}, bytes_written says {:?}",
            e.written, s.bytes_written
        ));
    }
    let st = e.on_handle((marconi_cache_check, marconi_tiered_check));
    ctx.ok("check", st);
}

fn blob(c: &Chain) -> Vec<u8> {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ c.0;
    for &t in &c.1 {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    h.to_le_bytes().repeat(4)
}

fn serve(
    ctx: &mut Ctx<'_>,
    e: &mut Engine,
    ns: u64,
    input: &[u32],
    output: &[u32],
    page: u32,
    what: &str,
) {
    let mut l = marconi_tiered_hit::default();
    let ids: Vec<i64> = input.iter().map(|&t| i64::from(t)).collect();
    let flags = if e.one { ctx.rng_flags } else { 0 };
    let view = e.one && ctx.device_view;
    let st = if !e.one {
        // SAFETY: valid handles, arrays and out.
        unsafe {
            marconi_tiered_lookup(
                e.t,
                ns,
                input.as_ptr(),
                input.len(),
                ptr::null(),
                0,
                ctx.store,
                &mut l,
            )
        }
    } else if view {
        // The device's view: no lower-tier hit, no loads.
        let mut d = marconi_lookup::default();
        // SAFETY: valid handle, ids and out.
        let st = unsafe {
            marconi_cache_lookup_i64_flags(
                e.t.cast(),
                ns,
                ids.as_ptr(),
                ids.len(),
                MARCONI_NO_SLOT,
                flags,
                &mut d,
            )
        };
        l.lease = d.lease;
        l.hit_tokens = d.hit_tokens;
        l.device_hit_tokens = d.hit_tokens;
        st
    } else {
        // SAFETY: valid handles, ids and out.
        unsafe {
            marconi_cache_lookup_tiered_i64_flags(
                e.t.cast(),
                ns,
                ids.as_ptr(),
                ids.len(),
                flags,
                ctx.store,
                &mut l,
            )
        }
    };
    if !ctx.ok("lookup", st) {
        return;
    }
    if e.one {
        let mut n = usize::MAX;
        // SAFETY: a size query on a valid handle and lease.
        let st =
            unsafe { marconi_cache_lease_loads(e.t.cast(), l.lease, ptr::null_mut(), 0, &mut n) };
        ctx.life.calls += 1;
        let want = if view { 0 } else { l.n_loads as usize };
        if !matches!(st, St::Ok | St::BufferTooSmall) || n != want {
            ctx.find(format!(
                "{what}: lease_loads size query: {st:?}, {n} orders, the lookup said {want}"
            ));
        }
        // SAFETY: a size query on a valid handle and lease.
        let st = unsafe {
            marconi_cache_lease_kv_pages(e.t.cast(), l.lease, ptr::null_mut(), 0, &mut n)
        };
        ctx.life.calls += 1;
        let want = (l.device_hit_tokens as usize).div_ceil(page as usize);
        let fine = match st {
            St::Ok => n == 0,
            St::BufferTooSmall => n > 0,
            _ => false,
        };
        if !fine || n > want {
            ctx.find(format!(
                "{what}: lease_kv_pages size query: {st:?}, {n} pages for a device hit of {} tokens",
                l.device_hit_tokens
            ));
        }
    }
    let hit = l.hit_tokens as usize;
    if hit > 0 {
        let prefix = &input[..hit];
        let own = e
            .admitted
            .get(&ns)
            .is_some_and(|v| v.iter().any(|s| s.starts_with(prefix)));
        let shared = l.shared == 1 && ctx.shared.contains(&(ns, prefix.to_vec()));
        if !own && !shared {
            ctx.find(format!(
                "{what}: a hit of {hit} tokens in namespace {ns} (tier {}, shared {}) on a prefix never admitted or written in it",
                l.tier, l.shared
            ));
        }
    }
    let mut full = input.to_vec();
    full.extend_from_slice(output);
    let mut plan = vec![0u32; 512];
    let mut n = 0usize;
    // SAFETY: valid handle, lease and buffer.
    let st =
        unsafe { marconi_tiered_lease_plan(e.t, l.lease, plan.as_mut_ptr(), plan.len(), &mut n) };
    ctx.ok("lease_plan", st);
    plan.truncate(n);
    let mut positions: Vec<u32> = plan
        .into_iter()
        .filter(|&p| p as usize > hit && p as usize <= full.len())
        .collect();
    let last = full.len() as u32 / page * page;
    if last as usize > hit {
        positions.push(last);
    }
    positions.sort_unstable();
    positions.dedup();
    let states: Vec<marconi_saved_state> = positions
        .iter()
        .map(|&p| {
            e.next_slot += 1;
            marconi_saved_state {
                position: p,
                slot: e.next_slot,
            }
        })
        .collect();
    let mut taken = vec![0u8; states.len()];
    let mut r = marconi_admit_result::default();
    let full_ids: Vec<i64> = full.iter().map(|&t| i64::from(t)).collect();
    let t = Some(&mut taken[..]);
    let st = if e.one {
        let f = marconi_cache_admit_i64;
        admit_by(
            f,
            e.t.cast(),
            l.lease,
            &full_ids,
            &states,
            None::<&[i64]>,
            t,
            &mut r,
        )
    } else {
        let f = marconi_tiered_admit;
        admit_by(f, e.t, l.lease, &full, &states, None::<&[u32]>, t, &mut r)
    };
    if ctx.ok("admit", st) {
        for (s, &tk) in states.iter().zip(&taken) {
            let chain = (ns, full[..s.position as usize].to_vec());
            if tk != 0 {
                e.slots.insert(s.slot, chain);
            } else {
                e.untaken.push(chain);
            }
        }
        e.admitted.entry(ns).or_default().push(full.clone());
    }
    // The ops of the admission first: a state the device could not take
    // goes to the host from the engine's slot, which it still holds.
    replay(ctx, e, what);
    // The engine frees the states the cache did not take.
    e.untaken.clear();
    // SAFETY: valid handle and lease.
    let st = unsafe {
        if e.one {
            marconi_cache_release(e.t.cast(), l.lease)
        } else {
            marconi_tiered_release(e.t, l.lease)
        }
    };
    ctx.ok("release", st);
    replay(ctx, e, what);
    if !e.defer {
        check_copies(ctx, e, what);
    }
    let st = e.on_handle((marconi_cache_settle, marconi_tiered_settle));
    ctx.ok("settle", st);
    replay(ctx, e, what);
    check_copies(ctx, e, what);
    if !e.events.is_null() {
        let mut n = 0usize;
        // SAFETY: live handles; a size query.
        let st =
            unsafe { marconi_events_drain(e.events, e.t.cast(), 1.0, ptr::null_mut(), 0, &mut n) };
        ctx.life.calls += 1;
        if st == St::BufferTooSmall {
            let mut buf = vec![0u8; n];
            // SAFETY: live handles; buf has its length in bytes.
            let st = unsafe {
                marconi_events_drain(
                    e.events,
                    e.t.cast(),
                    1.0,
                    buf.as_mut_ptr(),
                    buf.len(),
                    &mut n,
                )
            };
            ctx.ok("events_drain (tiers)", st);
        } else {
            ctx.ok("events_drain size (tiers)", st);
        }
    }
    ctx.life.requests += 1;
    if e.one {
        ctx.life.one_handle_requests += 1;
    }
}

/// One life: two engines over a shared directory store, `requests`
/// requests. `dir` is a fresh directory for the store.
pub(crate) fn life(rng: &mut Rng, dir: &std::path::Path, requests: u32) -> Life {
    let mut life = Life {
        calls: 0,
        findings: Vec::new(),
        requests: 0,
        one_handle_requests: 0,
    };
    let m = marconi_core::ModelSpec::preset("paper-7b").expect("preset");
    let mut ctx = Ctx {
        life: &mut life,
        m: Model {
            kv: m.kv_bytes_per_token(),
            state: m.state_bytes(),
        },
        store: ptr::null_mut(),
        shared: BTreeSet::new(),
        rng_flags: 0,
        device_view: false,
    };
    let loc = CString::new(dir.to_str().unwrap_or(".")).unwrap_or_default();
    let model = CString::new("fuzz tiered").unwrap_or_default();
    if let Some(mut scfg) = ctx.init("store_config_init", marconi_store_config_init) {
        scfg.location = loc.as_ptr();
        scfg.model = model.as_ptr();
        scfg.block_size = 4;
        scfg.timeout_ms = 1000;
        // SAFETY: valid config; the strings live during the call.
        let st = unsafe { marconi_store_new(&scfg, &mut ctx.store) };
        ctx.ok("store_new", st);
    }
    let mut shapes = [String::new(), String::new()];
    let mut engines = Vec::new();
    for s in shapes.iter_mut() {
        if let Some(e) = new_tiered(&mut ctx, rng, s) {
            engines.push(e);
        }
    }
    let pages: Vec<u32> = engines.iter().map(|(_, d)| d.page_size).collect();
    let namespaces = rng.range(2, 3);
    let sessions = rng.range(2, 6) as usize;
    let system: Vec<u32> = (0..rng.range(8, 64) as u32)
        .map(|i| 1_000_000 + i)
        .collect();
    let mut hist: Vec<(u64, Vec<u32>)> = (0..sessions)
        .map(|k| (k as u64 % namespaces, system.clone()))
        .collect();
    for r in 0..requests {
        if engines.is_empty() || ctx.life.findings.len() >= 5 {
            break;
        }
        let k = rng.below(sessions as u64) as usize;
        let ei = rng.below(engines.len() as u64) as usize;
        let (ns, h) = &mut hist[k];
        if h.len() > 1500 {
            h.truncate(system.len());
        }
        let n = rng.range(1, 60) as u32;
        h.extend((0..n).map(|_| rng.below(500) as u32));
        let output: Vec<u32> = (0..rng.range(0, 30))
            .map(|_| rng.below(500) as u32)
            .collect();
        let input = h.clone();
        let ns = *ns;
        let what = format!("request {r} engine {ei} ({})", shapes[ei]);
        ctx.rng_flags = rng.below(4) as u32;
        ctx.device_view = rng.below(4) == 0;
        let (e, _) = &mut engines[ei];
        serve(&mut ctx, e, ns, &input, &output, pages[ei], &what);
        hist[k].1.extend(output);
    }
    for (e, _dev) in engines {
        // SAFETY: from their _new, freed once (the events handle first).
        unsafe {
            if !e.events.is_null() {
                marconi_events_free(e.events, e.t.cast());
            }
            if e.one {
                marconi_cache_free(e.t.cast());
            } else {
                marconi_tiered_free(e.t);
            }
        }
    }
    if !ctx.store.is_null() {
        // SAFETY: from marconi_store_new, freed once.
        unsafe { marconi_store_free(ctx.store) };
    }
    life
}
