//! A seeded random driver over the C ABI: it calls the exported
//! `extern "C"` functions the way an engine (and a careless one) would, keeps
//! a model of what each cache owns, and checks invariants after every call.
//!
//! ```text
//! cargo run --release -p marconi-ffi --example fuzz_abi -- --seed 1 --seeds 8 --calls 20000
//! cargo run --release -p marconi-ffi --example fuzz_abi -- --seconds 3600 --threads 4
//! ```
//!
//! What it drives: several caches at once (page sizes 1, 4 and 16; α tuned
//! online or fixed; every admission and eviction policy; slot and page
//! tracking on or off; small capacities so that eviction and tuning run),
//! every exported function with valid arguments and with invalid ones (NULL
//! pointers, NULL first whatever else is wrong, zero and oversized lengths,
//! misaligned buffers, unknown / released / foreign / made-up leases, bad
//! positions, slots and pages, undersized output buffers, bad struct sizes,
//! bad configurations). Never undefined behaviour: a freed handle is never
//! used again (the ABI does not promise to detect it).
//!
//! What it checks: statuses (valid calls succeed, invalid ones fail with the
//! expected status and change nothing), the ownership of every engine id
//! (a page or slot comes back through marconi_cache_drain_freed only if the
//! cache took it and only once; cached hits point at ids the cache owns),
//! stats (used = kv + states <= capacity, counts match the model) and
//! marconi_cache_check after calls. The event stream (marconi_events_*):
//! every drained batch decodes and, applied in order, rebuilds exactly the
//! blocks and states of a snapshot of the cache, with no removal of a block
//! never stored, on caches over engine ids, over pools and with tiers;
//! refused configurations and calls change nothing. Caches over pools with
//! lower tiers (a third of the pooled runs, over memfd): every lease load
//! and drained tier op carried out on a model of the engine's copies (a
//! host WRITE reads units of the admission just made, a STORE write a host
//! copy, a DROP a copy, a load a copy held), units signed by the tokens
//! they stand for, and after each step the units in use are the cache's
//! plus the caller's (fuzz_abi_parts/pooled_tiers.rs). A call that takes
//! longer than `--watchdog` seconds is reported as a deadlock (the process then exits,
//! since a blocked thread cannot be stopped).
//!
//! A finding prints its seed and call index; with `--threads 1` (the default)
//! a run is deterministic, and `--seed S --calls N` replays it. Exits 1 when
//! anything was found, 3 on a deadlock.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, CStr};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use marconi::cache::*;
use marconi::config::*;
use marconi::cycle::*;
use marconi::events::*;
use marconi::host_pool::*;
use marconi::lookup::*;
use marconi::pool::*;
use marconi::pooled::*;
use marconi::status::marconi_status as St;
use marconi::tiered::{
    marconi_cache_lookup_tiered, marconi_cache_report_load_failure, marconi_cache_settle,
    marconi_cache_tier_stats, marconi_tier_options, marconi_tier_options_init, marconi_tier_write,
    marconi_tiered_hit, marconi_tiered_stats,
};
use marconi::{marconi_last_error, marconi_status_message, marconi_version};

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "fuzz_abi_parts/rng.rs"]
mod rng;

use common::{init, last_error, versioned};
#[path = "fuzz_abi_parts/pooled_tiers.rs"]
mod pooled_tiers;
#[path = "fuzz_abi_parts/tiered.rs"]
mod tiered_life;
use rng::Rng;

/// Whether a pool handle names a state unit (marconi-gpu's handle layout:
/// the fuzzer is this project's own code and may read it).
fn is_state(h: u64) -> bool {
    marconi_gpu::VirtualHandle::from_raw(h).pool() == marconi_gpu::PoolKind::Ssm
}

// ---------------------------------------------------------------- rng ----

/// This fuzzer's stream of the shared SplitMix64 (see rng.rs).
const RNG_SALT: u64 = 0x5851_f42d_4c95_7f2d;

// ----------------------------------------------------------- watchdog ----

/// What a worker is doing, for the watchdog: the start of its current call
/// (ms since the run began, 0 when idle) and which call it is.
struct Beat {
    started_ms: AtomicU64,
    call: AtomicU64,
    seed: AtomicU64,
    what: Mutex<&'static str>,
}

struct Watch {
    t0: Instant,
    beats: Vec<Beat>,
    limit: Duration,
    done: AtomicBool,
}

impl Watch {
    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64 + 1
    }
    fn enter(&self, w: usize, seed: u64, call: u64, what: &'static str) {
        let b = &self.beats[w];
        b.call.store(call, Ordering::Relaxed);
        b.seed.store(seed, Ordering::Relaxed);
        *b.what.lock().unwrap() = what;
        b.started_ms.store(self.now_ms(), Ordering::Release);
    }
    fn leave(&self, w: usize) {
        self.beats[w].started_ms.store(0, Ordering::Release);
    }
    fn spawn(self: &Arc<Self>) -> std::thread::JoinHandle<()> {
        let me = Arc::clone(self);
        std::thread::spawn(move || {
            while !me.done.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(100));
                let now = me.now_ms();
                for (w, b) in me.beats.iter().enumerate() {
                    let s = b.started_ms.load(Ordering::Acquire);
                    if s != 0 && now.saturating_sub(s) > me.limit.as_millis() as u64 {
                        eprintln!(
                            "FINDING deadlock: seed {} worker {w} call #{} ({}) blocked for more than {:?}",
                            b.seed.load(Ordering::Relaxed),
                            b.call.load(Ordering::Relaxed),
                            b.what.lock().map(|w| *w).unwrap_or("?"),
                            me.limit
                        );
                        eprintln!(
                            "fuzz_abi: deadlock; reproduce with --seed {} --calls {}",
                            b.seed.load(Ordering::Relaxed),
                            b.call.load(Ordering::Relaxed) + 1
                        );
                        std::process::exit(3);
                    }
                }
            }
        })
    }
}

// -------------------------------------------------------------- model ----

/// Where an engine id (page or slot) is, as far as the engine knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IdState {
    /// Offered in an admission that has not returned (to the model) yet.
    Offered,
    /// Taken by the cache.
    Owned,
    /// Offered, and already drained by another thread before the offering
    /// thread learnt it was taken.
    FreedEarly,
}

#[derive(Default)]
struct Ids {
    pages: HashMap<u32, IdState>,
    slots: HashMap<u32, IdState>,
}

/// A raw handle shared between workers (the ABI documents it as thread-safe).
#[derive(Clone, Copy)]
struct Handle(*mut marconi_cache);
// SAFETY: marconi_cache is internally locked; concurrent calls are allowed.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// What the fuzzer chose for a cache (printed with every finding).
#[derive(Clone, Debug)]
#[expect(dead_code, reason = "some fields are only printed, through Debug")]
struct Shape {
    page: u32,
    preset: &'static str,
    admission: u32,
    block: u32,
    eviction: u32,
    auto: bool,
    log: bool,
    pages: bool,
    slots: bool,
    capacity: u64,
}

struct CacheModel {
    handle: Handle,
    shape: Shape,
    stateless: bool,
    ids: Mutex<Ids>,
    /// Every lease id this cache issued (for log records and foreign leases).
    issued: Mutex<HashSet<u64>>,
    /// Released lease ids of this cache.
    released: Mutex<Vec<u64>>,
    /// Admitted sequences, for requests that share prefixes.
    seqs: Mutex<Vec<Vec<u32>>>,
    next_id: AtomicU32,
    lookups_ok: AtomicU64,
    poisoned: AtomicBool,
}

struct LeaseRec {
    cache: usize,
    id: u64,
    ns: u64,
    input: Vec<u32>,
    /// What the request decodes: admitted after the input, sometimes.
    output: Vec<u32>,
    hit: u32,
    plan: Vec<u32>,
    pages: Vec<u32>,
    admitted: usize,
}

struct Finding {
    seed: u64,
    worker: usize,
    call: u64,
    cache: Option<usize>,
    text: String,
}

/// A run: the caches of one seed and what the workers share.
struct Run {
    seed: u64,
    strict: bool,
    caches: Vec<CacheModel>,
    /// Leases of freed caches (never valid anywhere again).
    dead_leases: Mutex<Vec<u64>>,
    findings: Mutex<Vec<Finding>>,
    calls: AtomicU64,
    watch: Arc<Watch>,
    check_every: u64,
    only_tiered: bool,
}

struct Worker<'r> {
    run: &'r Run,
    w: usize,
    rng: Rng,
    /// Which requests go through the one lookup, admit and drain
    /// (marconi_cache_*_with) instead of the shorthands: a stream of its
    /// own, so the other draws are those of a run without it.
    via: Rng,
    call: u64,
    leases: Vec<LeaseRec>,
    free_pages: Vec<Vec<u32>>,
    free_slots: Vec<Vec<u32>>,
    cur_cache: Option<usize>,
    steps: u64,
}

/// The salt of the stream choosing the one lookup, admit and drain.
const VIA_SALT: u64 = 0x7769_7468_5f76_6961;

/// Lookups, admits and drains made through the `_with` calls, all seeds,
/// and of the drains those of caches over pools.
static VIA_WITH: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Requests served by `op_tiered` lives, all seeds.
static TIERED_REQUESTS: AtomicU64 = AtomicU64::new(0);

/// Of those, requests served through the one cache handle with tiers.
static ONE_HANDLE_REQUESTS: AtomicU64 = AtomicU64::new(0);

/// Requests served by caches over pools with lower tiers
/// (`op_pooled_admits`), all seeds: [requests, lower-tier hits loaded,
/// host writes, store writes, drops, device hits].
static POOLED_TIERS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

/// Salt of the stream that draws the lower tiers of `op_pooled_admits`
/// (a stream of their own: the runs without tiers keep their draws).
const TIERS_SALT: u64 = 0x7469_6572_7370_6f6f;

/// The arrays of one marconi_cache_admit call as (pointer, length) pairs
/// (the fuzzer passes pointers and lengths that disagree on purpose), and
/// the taken flags (NULL: not asked for).
#[derive(Clone, Copy)]
struct AdmitArgs {
    tokens: (*const u32, usize),
    states: (*const marconi_saved_state, usize),
    pages: (*const u32, usize),
    taken: *mut u8,
}

impl AdmitArgs {
    /// No arrays at all.
    const NONE: AdmitArgs = AdmitArgs {
        tokens: (ptr::null(), 0),
        states: (ptr::null(), 0),
        pages: (ptr::null(), 0),
        taken: ptr::null_mut(),
    };

    /// `tokens`, no states, no pages.
    fn of(tokens: &[u32]) -> Self {
        AdmitArgs {
            tokens: (tokens.as_ptr(), tokens.len()),
            ..Self::NONE
        }
    }

    fn states(self, s: &[marconi_saved_state]) -> Self {
        AdmitArgs {
            states: (s.as_ptr(), s.len()),
            ..self
        }
    }

    fn pages(self, p: &[u32]) -> Self {
        AdmitArgs {
            pages: (p.as_ptr(), p.len()),
            ..self
        }
    }

    /// marconi_cache_admit of these arrays on `lease` of `h`.
    ///
    /// # Safety
    /// Each pointer is readable (taken: writable) for its length, or the
    /// library refuses that length before reading it.
    unsafe fn call(
        self,
        h: *const marconi_cache,
        lease: u64,
        out: *mut marconi_admit_result,
    ) -> St {
        marconi_cache_admit(
            h,
            lease,
            self.tokens.0,
            self.tokens.1,
            self.states.0,
            self.states.1,
            self.pages.0,
            self.pages.1,
            self.taken,
            out,
        )
    }
}

/// marconi_cache_lookup(_hinted) through marconi_cache_lookup_with (the
/// device's view, as the shorthands give it; `wide`: int64 ids), its
/// result narrowed to a marconi_lookup the way the shorthand writes it.
fn lookup_via_with(
    h: *const marconi_cache,
    ns: u64,
    input: &[u32],
    hints: Option<&[u32]>,
    dst: u32,
    wide: bool,
    l: &mut marconi_lookup,
) -> St {
    let flags = MARCONI_LOOKUP_DEVICE_ONLY;
    let (st, r) = common::lookup_with(h, ns, (input, wide), hints.unwrap_or(&[]), flags, dst);
    if st == St::Ok {
        *l = marconi_lookup::from(&r);
    }
    st
}

/// marconi_cache_admit through marconi_cache_admit_with: the states as
/// 64-bit units, `wide`: the tokens and pages as int64 ids.
#[allow(clippy::too_many_arguments)]
fn admit_via_with(
    h: *const marconi_cache,
    lease: u64,
    tokens: &[u32],
    states: &[marconi_saved_state],
    kv: &[u32],
    taken: Option<&mut [u8]>,
    wide: bool,
    r: &mut marconi_admit_result,
) -> St {
    let units: Vec<(u32, u64)> = states
        .iter()
        .map(|s| (s.position, u64::from(s.slot)))
        .collect();
    let pages: Vec<u64> = kv.iter().map(|&p| u64::from(p)).collect();
    let width = if wide {
        marconi_id_width::I64
    } else {
        marconi_id_width::U32
    };
    common::admit_with(
        h,
        lease,
        (tokens, wide),
        &units,
        &pages,
        width as u32,
        taken,
        r,
    )
}

/// An enum field of a config struct `C`: (the case's name, its first
/// value past the last valid one, the field).
type EnumField<C> = (&'static str, u32, fn(&mut C) -> &mut u32);

fn default_config() -> marconi_cache_config {
    init(marconi_cache_config_init)
}

fn pool_config() -> marconi_pool_config {
    init(marconi_pool_config_init)
}

fn pool_free_units(p: *const marconi_pool) -> (u64, u64) {
    let mut s = versioned::<marconi_pool_stats>();
    // SAFETY: live pool, s writable.
    unsafe { marconi_pool_get_stats(p, &mut s) };
    (s.kv_free, s.state_free)
}

/// The bytes of a live memfd unit, or None when the pool refuses the handle.
fn unit_bytes<'a>(p: *const marconi_pool, h: u64) -> Option<&'a mut [u8]> {
    let mut l = marconi_unit_location::default();
    // SAFETY: one handle, one location.
    let st = unsafe { marconi_pool_resolve(p, &h, 1, &mut l, 1) };
    // SAFETY: a live unit's address is mapped for unit_bytes while its
    // handle is live; only the calling worker uses it.
    (st == St::Ok && l.address != 0).then(|| unsafe {
        std::slice::from_raw_parts_mut(l.address as *mut u8, l.unit_bytes as usize)
    })
}

/// The bytes of a live host pool unit, or None when it refuses the handle.
fn host_unit_bytes<'a>(p: *const marconi_host_pool, h: u64) -> Option<&'a mut [u8]> {
    let mut l = marconi_unit_location::default();
    // SAFETY: one handle, one location.
    let st = unsafe { marconi_host_pool_resolve(p, &h, 1, &mut l, 1) };
    // SAFETY: a live unit's address is mapped for unit_bytes while its
    // handle is live; only the calling worker uses it.
    (st == St::Ok && l.address != 0).then(|| unsafe {
        std::slice::from_raw_parts_mut(l.address as *mut u8, l.unit_bytes as usize)
    })
}

/// The handles a cache over pools holds (`held`) or drains as evicted.
fn pooled_list(c: *const marconi_cache, held: bool) -> Vec<u64> {
    let mut n = 0usize;
    type List = unsafe extern "C" fn(*const marconi_cache, *mut u64, usize, *mut usize) -> St;
    let f: List = if held {
        marconi_cache_held
    } else {
        marconi_cache_drain_freed_units
    };
    // SAFETY: NULL with cap 0 asks for the count.
    unsafe { f(c, ptr::null_mut(), 0, &mut n) };
    let mut v = vec![0u64; n];
    // SAFETY: v has n writable handles.
    let st = unsafe { f(c, v.as_mut_ptr(), n, &mut n) };
    if st != St::Ok {
        v.clear();
    }
    v
}

const POLICY_PRESETS: [&CStr; 6] = [
    c"marconi",
    c"marconi-paper",
    c"marconi-tuned",
    c"marconi-shadow",
    c"sglang-plus",
    c"vllm-plus",
];

const PRESETS: [&CStr; 5] = [
    c"paper-7b",
    c"paper-7b-attn",
    c"paper-7b-ssm",
    c"jamba-1.5-mini",
    c"nemotron-h-8b",
];

fn preset_name(p: &'static CStr) -> &'static str {
    p.to_str().unwrap()
}

fn stats_of(h: *const marconi_cache) -> Result<marconi_stats, St> {
    let mut s = versioned::<marconi_stats>();
    // SAFETY: live handle, writable stats.
    match unsafe { marconi_cache_stats(h, &mut s) } {
        St::Ok => Ok(s),
        e => Err(e),
    }
}

impl Run {
    fn new_cache(rng: &mut Rng, index: usize, seed: u64) -> Option<CacheModel> {
        let page = [1u32, 4, 16][((seed as usize) + index) % 3];
        let preset = rng.pick(&PRESETS);
        let admission = rng.pick(&[0u32, 0, 0, 1, 2]);
        let block = page * rng.range(1, 4) as u32 * if page == 1 { 8 } else { 1 };
        let eviction = if rng.chance(3, 4) { 1 } else { 0 };
        let auto = rng.chance(2, 3);
        let mut cfg = default_config();
        cfg.model_preset = preset.as_ptr();
        cfg.page_size = page;
        cfg.admission = admission;
        cfg.block_size = block;
        cfg.eviction = eviction;
        cfg.alpha_mode = u32::from(auto);
        cfg.alpha = rng.below(20) as f64 / 10.0;
        cfg.decision_log = u32::from(rng.chance(1, 3));
        cfg.tuner_min_window = rng.range(2, 12) as u32;
        cfg.tuner_bootstrap_factor = rng.range(1, 3) as u32;
        cfg.tuner_threads = rng.range(1, 2) as u32;
        cfg.tuner_retune = u32::from(rng.chance(3, 4));
        cfg.tuner_objective = rng.below(2) as u32;
        cfg.capacity_bytes = 1 << 50;
        // Sizes of this model, from a throwaway cache.
        let mut probe = ptr::null_mut();
        // SAFETY: valid config and out pointer.
        if unsafe { marconi_cache_new(&cfg, &mut probe) } != St::Ok {
            return None;
        }
        let s = stats_of(probe).ok()?;
        // SAFETY: freed once.
        unsafe { marconi_cache_free(probe) };
        let kv = s.kv_bytes_per_token.max(1);
        let state = s.state_bytes_per_entry;
        cfg.capacity_bytes = kv * rng.range(64, 3000) + state * rng.range(1, 24);
        let mut handle = ptr::null_mut();
        // SAFETY: valid config and out pointer.
        let st = unsafe { marconi_cache_new(&cfg, &mut handle) };
        if st != St::Ok {
            return None;
        }
        let shape = Shape {
            page,
            preset: preset_name(preset),
            admission,
            block,
            eviction,
            auto,
            log: cfg.decision_log != 0,
            pages: rng.chance(2, 3),
            slots: rng.chance(3, 4),
            capacity: cfg.capacity_bytes,
        };
        let stateless = admission == 2 || preset_name(preset) == "paper-7b-attn";
        Some(CacheModel {
            handle: Handle(handle),
            shape,
            stateless,
            ids: Mutex::new(Ids::default()),
            issued: Mutex::new(HashSet::new()),
            released: Mutex::new(Vec::new()),
            seqs: Mutex::new(Vec::new()),
            next_id: AtomicU32::new(1),
            lookups_ok: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
        })
    }
}

/// Writes `what` with this call's coordinates into the findings.
macro_rules! finding {
    ($w:expr, $($fmt:tt)*) => {
        $w.find(format!($($fmt)*))
    };
}

impl<'r> Worker<'r> {
    fn find(&mut self, text: String) {
        let cache = self.cur_cache;
        let shape = cache
            .map(|c| format!(" {:?}", self.run.caches[c].shape))
            .unwrap_or_default();
        eprintln!(
            "FINDING seed {} worker {} call #{} cache {:?}{shape}: {text}",
            self.run.seed, self.w, self.call, cache
        );
        self.run.findings.lock().unwrap().push(Finding {
            seed: self.run.seed,
            worker: self.w,
            call: self.call,
            cache,
            text,
        });
    }

    /// Runs one ABI call under the watchdog and counts it.
    fn call<T>(&mut self, what: &'static str, f: impl FnOnce() -> T) -> T {
        self.call += 1;
        self.run.calls.fetch_add(1, Ordering::Relaxed);
        self.run.watch.enter(self.w, self.run.seed, self.call, what);
        let r = f();
        self.run.watch.leave(self.w);
        r
    }

    /// Checks a status; PANIC and POISONED are always findings.
    fn expect(&mut self, what: &str, got: St, want: &[St]) -> bool {
        if got == St::Panic || got == St::Poisoned {
            let e = last_error();
            finding!(self, "{what}: {got:?} ({e})");
            if let Some(c) = self.cur_cache {
                self.run.caches[c].poisoned.store(true, Ordering::Relaxed);
            }
            return false;
        }
        if !want.contains(&got) {
            let e = last_error();
            finding!(self, "{what}: got {got:?}, expected one of {want:?} ({e})");
            return false;
        }
        true
    }

    fn h(&self, c: usize) -> *mut marconi_cache {
        self.run.caches[c].handle.0
    }

    fn fresh_id(&mut self, c: usize, slot: bool) -> u32 {
        let pool = if slot {
            &mut self.free_slots[c]
        } else {
            &mut self.free_pages[c]
        };
        if !pool.is_empty() && self.rng.chance(1, 3) {
            let i = self.rng.below(pool.len() as u64) as usize;
            return pool.swap_remove(i);
        }
        // Each worker draws from its own part of the id space.
        let n = self.run.caches[c].next_id.fetch_add(1, Ordering::Relaxed);
        (n % 0x0100_0000) | ((self.w as u32 & 0x7f) << 24)
    }

    // ------------------------------------------------------ invariants --

    fn check_stats(&mut self, c: usize) -> Option<marconi_stats> {
        let h = self.h(c);
        let s = match self.call("stats", || stats_of(h)) {
            Ok(s) => s,
            Err(e) => {
                self.expect("marconi_cache_stats", e, &[St::Ok]);
                return None;
            }
        };
        let m = &self.run.caches[c];
        let mut bad = Vec::new();
        if s.used_bytes != s.kv_bytes + s.state_bytes {
            bad.push(format!(
                "used {} != kv {} + states {}",
                s.used_bytes, s.kv_bytes, s.state_bytes
            ));
        }
        if s.used_bytes > s.capacity_bytes {
            bad.push(format!(
                "used {} > capacity {}",
                s.used_bytes, s.capacity_bytes
            ));
        }
        if s.capacity_bytes != m.shape.capacity {
            bad.push(format!(
                "capacity {} != configured {}",
                s.capacity_bytes, m.shape.capacity
            ));
        }
        if s.evictable_bytes > s.used_bytes {
            bad.push(format!(
                "evictable {} > used {}",
                s.evictable_bytes, s.used_bytes
            ));
        }
        if s.hit_tokens > s.input_tokens || s.hit_requests > s.requests {
            bad.push("more hits than inputs".into());
        }
        if s.kv_bytes_per_token > 0 && s.kv_bytes % s.kv_bytes_per_token != 0 {
            bad.push("kv_bytes is not whole tokens".into());
        }
        if s.states > 0 && s.state_bytes != s.states * s.state_bytes_per_entry {
            bad.push(format!(
                "state_bytes {} != states {} x {}",
                s.state_bytes, s.states, s.state_bytes_per_entry
            ));
        }
        if self.run.strict {
            let live = self.leases.iter().filter(|l| l.cache == c).count() as u64;
            if s.leases != live {
                bad.push(format!(
                    "{} leases outstanding, the engine holds {live}",
                    s.leases
                ));
            }
            let ok = m.lookups_ok.load(Ordering::Relaxed);
            if s.requests != ok {
                bad.push(format!(
                    "{} requests counted, {ok} lookups succeeded",
                    s.requests
                ));
            }
        }
        for b in bad {
            finding!(self, "stats: {b}: {s:?}");
        }
        Some(s)
    }

    fn check_cache(&mut self, c: usize) {
        let h = self.h(c);
        // SAFETY: live handle.
        let st = self.call("check", || unsafe { marconi_cache_check(h) });
        if st != St::Ok {
            let e = last_error();
            finding!(self, "marconi_cache_check: {st:?}: {e}");
            self.run.caches[c].poisoned.store(true, Ordering::Relaxed);
        }
    }

    // ----------------------------------------------------------- tokens --

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        let alphabet = if self.rng.chance(1, 2) { 8 } else { 100_000 };
        (0..n).map(|_| self.rng.below(alphabet) as u32).collect()
    }

    /// An input and a decoded output: often a prefix of a cached sequence
    /// (ending inside a page) with the output continuing along it.
    fn request(&mut self, c: usize) -> (Vec<u32>, Vec<u32>) {
        let page = self.run.caches[c].shape.page as u64;
        let base = {
            let seqs = self.run.caches[c].seqs.lock().unwrap();
            if seqs.is_empty() || self.rng.chance(1, 4) {
                None
            } else {
                Some(seqs[self.rng.below(seqs.len() as u64) as usize].clone())
            }
        };
        match base {
            None => {
                let n = if self.rng.chance(1, 20) {
                    self.rng.range(300, 2000)
                } else {
                    self.rng.range(1, 200)
                } as usize;
                let input = self.tokens(n);
                let m = self.rng.below(40) as usize;
                (input, self.tokens(m))
            }
            Some(b) => {
                let cut = if self.rng.chance(1, 2) {
                    self.rng.range(1, (2 * page).min(b.len() as u64)) as usize
                } else {
                    self.rng.range(1, b.len() as u64) as usize
                };
                let mut input = b[..cut].to_vec();
                let extra = if self.rng.chance(1, 2) {
                    0
                } else {
                    self.rng.below(30) as usize
                };
                input.extend(self.tokens(extra));
                let m = self.rng.below(48) as usize;
                let output = if extra == 0 && self.rng.chance(2, 3) {
                    let mut o: Vec<u32> = b[cut..].iter().take(m).copied().collect();
                    if self.rng.chance(1, 3) {
                        let k = self.rng.below(8) as usize;
                        o.extend(self.tokens(k));
                    }
                    o
                } else {
                    self.tokens(m)
                };
                (input, output)
            }
        }
    }

    // -------------------------------------------------------- the cycle --

    fn op_lookup(&mut self, c: usize) {
        let (input, output) = self.request(c);
        let ns = self.rng.pick(&[0u64, 0, 0, 1, u64::MAX]);
        let m = &self.run.caches[c];
        let dst = if m.shape.slots && self.rng.chance(3, 4) {
            self.fresh_id(c, true)
        } else {
            MARCONI_NO_SLOT
        };
        let h = self.h(c);
        let mut l = marconi_lookup::default();
        // A third of the lookups pass application checkpoint hints: in and
        // out of range, duplicated, unaligned; the plan checks below and
        // the admission of every planned position hold for them too.
        let hints: Option<Vec<u32>> = self.rng.chance(1, 3).then(|| {
            let n = input.len() as u32;
            let k = self.rng.below(5);
            (0..k)
                .map(|_| match self.rng.below(5) {
                    0 => self.rng.below(u64::from(n) + 2) as u32,
                    1 => n,
                    2 => u32::MAX,
                    3 => 0,
                    _ => n / 2,
                })
                .collect()
        });
        let with = self.via.chance(1, 2).then(|| self.via.chance(1, 2));
        // SAFETY: live handle, input and hints outlive the call, l is writable.
        let st = self.call("lookup", || unsafe {
            match (&hints, with) {
                (_, Some(wide)) => {
                    VIA_WITH[0].fetch_add(1, Ordering::Relaxed);
                    lookup_via_with(h, ns, &input, hints.as_deref(), dst, wide, &mut l)
                }
                (None, None) => {
                    marconi_cache_lookup(h, ns, input.as_ptr(), input.len(), dst, &mut l)
                }
                (Some(hs), None) => marconi_cache_lookup_hinted(
                    h,
                    ns,
                    input.as_ptr(),
                    input.len(),
                    if hs.is_empty() {
                        ptr::null()
                    } else {
                        hs.as_ptr()
                    },
                    hs.len(),
                    dst,
                    &mut l,
                ),
            }
        });
        if !self.expect("lookup", st, &[St::Ok]) {
            return;
        }
        m.lookups_ok.fetch_add(1, Ordering::Relaxed);
        if !m.issued.lock().unwrap().insert(l.lease) || l.lease == 0 {
            finding!(self, "lookup issued lease {} twice (or 0)", l.lease);
        }
        let n = input.len() as u32;
        let page = m.shape.page;
        let mut bad = Vec::new();
        if l.hit_tokens >= n || l.hit_tokens > l.kv_matched_tokens || l.kv_matched_tokens > n {
            bad.push("hit / kv_matched out of order".to_owned());
        }
        if l.kv_matched_tokens % page != 0 {
            bad.push("kv_matched not page-aligned".into());
        }
        let copy_expected = dst != MARCONI_NO_SLOT && l.state_slot != MARCONI_NO_SLOT;
        if (l.n_copy_orders == 1) != copy_expected
            || (copy_expected
                && (l.copy_order.src_slot != l.state_slot || l.copy_order.dst_slot != dst))
        {
            bad.push("copy order inconsistent".into());
        }
        if l.state_slot != MARCONI_NO_SLOT {
            let ids = m.ids.lock().unwrap();
            match ids.slots.get(&l.state_slot) {
                Some(IdState::Owned) => {}
                Some(IdState::Offered) if !self.run.strict => {}
                other => bad.push(format!(
                    "hit resumes from slot {} the cache does not own ({other:?})",
                    l.state_slot
                )),
            }
        }
        // The plan and the pages, with undersized buffers first.
        let mut plan = vec![0u32; l.n_plan as usize];
        let mut pages = vec![0u32; l.n_kv_pages as usize];
        let mut got = usize::MAX;
        if l.n_plan > 0 && self.rng.chance(1, 3) {
            // SAFETY: a NULL buffer with capacity 0 is a size query.
            let st = self.call("lease_plan", || unsafe {
                marconi_cache_lease_plan(h, l.lease, ptr::null_mut(), 0, &mut got)
            });
            self.expect("lease_plan size query", st, &[St::BufferTooSmall]);
            if got != plan.len() {
                bad.push(format!("plan size query says {got}, lookup {}", plan.len()));
            }
        }
        // SAFETY: plan has its length in writable u32.
        let st = self.call("lease_plan", || unsafe {
            marconi_cache_lease_plan(h, l.lease, plan.as_mut_ptr(), plan.len(), &mut got)
        });
        self.expect("lease_plan", st, &[St::Ok]);
        if got != plan.len() {
            bad.push("plan length differs from n_plan".into());
        }
        // SAFETY: pages has its length in writable u32.
        let st = self.call("lease_kv_pages", || unsafe {
            marconi_cache_lease_kv_pages(h, l.lease, pages.as_mut_ptr(), pages.len(), &mut got)
        });
        self.expect("lease_kv_pages", st, &[St::Ok]);
        if got != pages.len() {
            bad.push("page list length differs from n_kv_pages".into());
        }
        if plan.windows(2).any(|w| w[0] >= w[1])
            || plan.iter().any(|&p| p == 0 || p > n || p <= l.hit_tokens)
        {
            bad.push(format!("plan {plan:?} not ascending within (hit, input]"));
        }
        if m.shape.pages {
            if pages.len() as u32 != l.hit_tokens / page {
                bad.push(format!(
                    "{} kv pages for a hit of {} tokens (page {page})",
                    pages.len(),
                    l.hit_tokens
                ));
            }
            let ids = m.ids.lock().unwrap();
            for p in &pages {
                match ids.pages.get(p) {
                    Some(IdState::Owned) => {}
                    Some(IdState::Offered) if !self.run.strict => {}
                    other => bad.push(format!("hit page {p} not owned by the cache ({other:?})")),
                }
            }
        } else if !pages.is_empty() {
            bad.push("kv pages reported though none were ever given".into());
        }
        for b in bad {
            finding!(self, "lookup of {} tokens -> {l:?}: {b}", input.len());
        }
        if dst != MARCONI_NO_SLOT {
            self.free_slots[c].push(dst);
        }
        self.leases.push(LeaseRec {
            cache: c,
            id: l.lease,
            ns,
            input,
            output,
            hit: l.hit_tokens,
            plan,
            pages,
            admitted: 0,
        });
    }

    /// The states an engine following the plan saves for `len` tokens.
    fn states_for(&self, lr: &LeaseRec, len: usize) -> Vec<u32> {
        let m = &self.run.caches[lr.cache];
        if m.stateless {
            return Vec::new();
        }
        let page = m.shape.page;
        let aligned = len as u32 / page * page;
        match m.shape.admission {
            0 => {
                let mut v: Vec<u32> = lr
                    .plan
                    .iter()
                    .copied()
                    .filter(|&p| p as usize <= len)
                    .collect();
                if aligned > 0 && !v.contains(&aligned) {
                    v.push(aligned);
                }
                v
            }
            1 => {
                let b = m.shape.block;
                ((lr.hit / b + 1)..)
                    .map(|k| k * b)
                    .take_while(|&p| p as usize <= len)
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    fn op_admit(&mut self) {
        if self.leases.is_empty() {
            return;
        }
        let i = self.rng.below(self.leases.len() as u64) as usize;
        let c = self.leases[i].cache;
        self.cur_cache = Some(c);
        let m = &self.run.caches[c];
        let shape = m.shape.clone();
        // The admitted sequence: the input, maybe followed by the output (the
        // continuation of a cached sequence when the request came from one).
        let lr = &self.leases[i];
        let mut full = lr.input.clone();
        if self.rng.chance(2, 3) {
            full.extend(&lr.output);
        }
        let lease = lr.id;
        let mut positions = self.states_for(&self.leases[i], full.len());
        if self.rng.chance(1, 8) {
            positions.clear(); // an engine that saves nothing is valid too
        }
        let states: Vec<marconi_saved_state> = positions
            .iter()
            .map(|&p| marconi_saved_state {
                position: p,
                slot: if shape.slots {
                    self.fresh_id(c, true)
                } else {
                    MARCONI_NO_SLOT
                },
            })
            .collect();
        let mut kv: Vec<u32> = Vec::new();
        if shape.pages {
            kv = self.leases[i].pages.clone();
            let full_pages = full.len() / shape.page as usize;
            kv.truncate(full_pages);
            while kv.len() < full_pages {
                let p = self.fresh_id(c, false);
                kv.push(p);
            }
        }
        let fresh_from = self.leases[i].pages.len().min(kv.len());
        // Mark what is offered before the call: an eviction by another
        // thread may free it before this thread learns it was taken.
        {
            let mut ids = m.ids.lock().unwrap();
            for s in &states {
                if s.slot != MARCONI_NO_SLOT {
                    if let Some(prev) = ids.slots.insert(s.slot, IdState::Offered) {
                        drop(ids);
                        finding!(self, "model: offering slot {} in state {prev:?}", s.slot);
                        return;
                    }
                }
            }
            for &p in &kv[fresh_from..] {
                if let Some(prev) = ids.pages.insert(p, IdState::Offered) {
                    drop(ids);
                    finding!(self, "model: offering page {p} in state {prev:?}");
                    return;
                }
            }
        }
        let before = if self.run.strict {
            self.check_stats(c)
        } else {
            None
        };
        let h = self.h(c);
        let mut taken = vec![7u8; states.len()];
        // An engine that tracks slots needs the flags; others may pass NULL.
        let with_taken = shape.slots || self.rng.chance(1, 2);
        let mut r = marconi_admit_result::default();
        // SAFETY: every buffer is passed with its length; taken has n_states bytes.
        let mut a = AdmitArgs::of(&full).states(&states);
        if !kv.is_empty() {
            a = a.pages(&kv);
        }
        if with_taken {
            a.taken = taken.as_mut_ptr();
        }
        let with = self.via.chance(1, 2).then(|| self.via.chance(1, 2));
        let st = self.call("admit", || unsafe {
            match with {
                Some(wide) => {
                    VIA_WITH[1].fetch_add(1, Ordering::Relaxed);
                    let t = with_taken.then_some(&mut taken[..]);
                    admit_via_with(h, lease, &full, &states, &kv, t, wide, &mut r)
                }
                None => a.call(h, lease, &mut r),
            }
        });
        let ok = self.expect(
            &format!("admit of {} tokens, states {positions:?}", full.len()),
            st,
            &[St::Ok],
        );
        // Settle the offered ids.
        let mut bad = Vec::new();
        let (ts, te) = (
            r.kv_pages_taken_start as usize,
            r.kv_pages_taken_end as usize,
        );
        if ok {
            if ts > te || te > kv.len() || (kv.is_empty() && (ts, te) != (0, 0)) {
                bad.push(format!("taken page range {ts}..{te} of {} pages", kv.len()));
            }
            if ts < fresh_from && ts < te {
                bad.push(format!(
                    "took page indices {ts}..{te}, but 0..{fresh_from} are the cache's own"
                ));
            }
            if with_taken {
                let n = taken.iter().filter(|&&t| t == 1).count() as u32;
                if taken.iter().any(|&t| t > 1) || n != r.states_taken {
                    bad.push(format!(
                        "taken flags {taken:?} vs states_taken {}",
                        r.states_taken
                    ));
                }
            }
            if r.rejected && (r.states_taken > 0 || ts != te) {
                bad.push("rejected but took something".into());
            }
            if r.truncated_to as usize >= full.len() && r.truncated_to != 0 {
                bad.push(format!(
                    "truncated_to {} of {} tokens",
                    r.truncated_to,
                    full.len()
                ));
            }
            let returned = states
                .iter()
                .zip(&taken)
                .filter(|(s, &t)| s.slot != MARCONI_NO_SLOT && t != 1)
                .count() as u32;
            if shape.slots && r.slots_returned != returned {
                bad.push(format!(
                    "slots_returned {} but {returned} slots not taken",
                    r.slots_returned
                ));
            }
        }
        {
            let mut ids = m.ids.lock().unwrap();
            for (k, s) in states.iter().enumerate() {
                if s.slot == MARCONI_NO_SLOT {
                    continue;
                }
                let was_taken = ok && taken[k] == 1;
                let cur = ids.slots.get(&s.slot).copied();
                match (cur, was_taken) {
                    (Some(IdState::Offered), true) => {
                        ids.slots.insert(s.slot, IdState::Owned);
                    }
                    (Some(IdState::Offered), false) => {
                        ids.slots.remove(&s.slot);
                        self.free_slots[c].push(s.slot);
                    }
                    (Some(IdState::FreedEarly), true) => {
                        ids.slots.remove(&s.slot);
                        self.free_slots[c].push(s.slot);
                    }
                    (other, t) => bad.push(format!(
                        "slot {} was {other:?} after admit (taken {t})",
                        s.slot
                    )),
                }
            }
            for (k, &p) in kv.iter().enumerate().skip(fresh_from) {
                let was_taken = ok && k >= ts && k < te;
                match (ids.pages.get(&p).copied(), was_taken) {
                    (Some(IdState::Offered), true) => {
                        ids.pages.insert(p, IdState::Owned);
                    }
                    (Some(IdState::Offered), false) => {
                        ids.pages.remove(&p);
                        self.free_pages[c].push(p);
                    }
                    (Some(IdState::FreedEarly), true) => {
                        ids.pages.remove(&p);
                        self.free_pages[c].push(p);
                    }
                    (other, t) => {
                        bad.push(format!("page {p} was {other:?} after admit (taken {t})"))
                    }
                }
            }
        }
        if ok {
            self.leases[i].admitted = full.len();
            let mut seqs = m.seqs.lock().unwrap();
            if seqs.len() >= 64 {
                let k = self.rng.below(64) as usize;
                seqs.swap_remove(k);
            }
            seqs.push(full.clone());
        } else if let Some(b) = before {
            let now = self.check_stats(c);
            if now.is_some_and(|n| n != b) {
                bad.push("a failed admission changed the stats".into());
            }
        }
        for b in bad {
            finding!(self, "admit of {} tokens -> {r:?}: {b}", full.len());
        }
        if self.run.strict && ok {
            self.check_stats(c);
        }
    }

    /// Releases a live lease (taken out of `self.leases`), which must
    /// succeed, and records it as released.
    fn release_live(&mut self, lr: &LeaseRec) {
        let h = self.h(lr.cache);
        // SAFETY: live handle.
        let st = self.call("release", || unsafe { marconi_cache_release(h, lr.id) });
        self.cur_cache = Some(lr.cache);
        self.expect("release of a live lease", st, &[St::Ok]);
        self.run.caches[lr.cache]
            .released
            .lock()
            .unwrap()
            .push(lr.id);
    }

    fn op_release(&mut self) {
        if self.leases.is_empty() {
            return;
        }
        let i = self.rng.below(self.leases.len() as u64) as usize;
        let lr = self.leases.swap_remove(i);
        self.release_live(&lr);
        if self.rng.chance(1, 4) {
            let h = self.h(lr.cache);
            // SAFETY: live handle.
            let st = self.call("release", || unsafe { marconi_cache_release(h, lr.id) });
            self.expect("double release", st, &[St::UnknownLease]);
        }
    }

    fn op_drain(&mut self, c: usize, exact: bool) {
        if self.via.chance(1, 2) {
            VIA_WITH[2].fetch_add(1, Ordering::Relaxed);
            return self.op_drain_with(c, exact);
        }
        let h = self.h(c);
        let (mut np, mut ns) = (usize::MAX, usize::MAX);
        // SAFETY: NULL buffers with capacity 0 are a size query.
        let st = self.call("drain_freed", || unsafe {
            marconi_cache_drain_freed(h, ptr::null_mut(), 0, &mut np, ptr::null_mut(), 0, &mut ns)
        });
        if !self.drain_size_query("drain_freed", st, (np, ns, 0)) {
            return;
        }
        // Room for more than was pending: other threads may evict meanwhile.
        let extra = if exact { 0 } else { 64 };
        let mut pages = vec![0u32; np + extra];
        let mut slots = vec![0u32; ns + extra];
        let (mut gp, mut gs) = (0usize, 0usize);
        // SAFETY: buffers passed with their capacities.
        let st = self.call("drain_freed", || unsafe {
            marconi_cache_drain_freed(
                h,
                pages.as_mut_ptr(),
                pages.len(),
                &mut gp,
                slots.as_mut_ptr(),
                slots.len(),
                &mut gs,
            )
        });
        if self.drained("drain_freed", st, (gp, gs), (np, ns)) {
            self.settle_freed(c, &pages[..gp], &slots[..gs]);
        }
    }

    /// A drain's size query (`what`) answered `st`: OK or
    /// BUFFER_TOO_SMALL, OK only with nothing `pending` (pages, slots,
    /// ops). False when the drain is not to follow.
    fn drain_size_query(&mut self, what: &str, st: St, pending: (usize, usize, usize)) -> bool {
        let q = format!("{what} size query");
        if !self.expect(&q, st, &[St::Ok, St::BufferTooSmall]) {
            return false;
        }
        let (np, ns, _) = pending;
        if st == St::Ok && pending != (0, 0, 0) {
            finding!(
                self,
                "{what} OK into empty buffers with {np} pages, {ns} slots"
            );
        }
        true
    }

    /// The drain (`what`) into room for what its size query counted
    /// answered `st`: OK (BUFFER_TOO_SMALL too where other threads may
    /// evict meanwhile), and when strict the pages and slots it wrote
    /// (`got`) are the ones counted (`counted`). True when it drained.
    fn drained(
        &mut self,
        what: &str,
        st: St,
        got: (usize, usize),
        counted: (usize, usize),
    ) -> bool {
        let want: &[St] = if self.run.strict {
            &[St::Ok]
        } else {
            &[St::Ok, St::BufferTooSmall]
        };
        if !self.expect(what, st, want) || st != St::Ok {
            return false;
        }
        if self.run.strict && got != counted {
            let ((gp, gs), (np, ns)) = (got, counted);
            finding!(
                self,
                "{what} drained {gp}/{gs}, the size query said {np}/{ns}"
            );
        }
        true
    }

    /// The freed units of a cache over pools without tiers through
    /// marconi_cache_drain_with (`pooled_tiers::drain_with`'s checks): no
    /// op, and nothing left for marconi_cache_drain_freed_units.
    fn pooled_drain_with(&mut self, c: *mut marconi_cache) -> Vec<u64> {
        let d = match self.call("drain_with (pools)", || pooled_tiers::drain_with(c)) {
            Ok(d) => d,
            Err(found) => {
                for f in found {
                    finding!(self, "pools: {f}");
                }
                return Vec::new();
            }
        };
        if !d.ops.is_empty() {
            finding!(
                self,
                "drain_with (pools) gave {} ops without tiers",
                d.ops.len()
            );
        }
        let left = pooled_list(c, false);
        if !left.is_empty() {
            finding!(
                self,
                "drain_with (pools) left {} units for drain_freed_units",
                left.len()
            );
        }
        d.units
    }

    /// op_drain through marconi_cache_drain_with: a size query, then the
    /// drain; a cache over ids has no tier ops here.
    fn op_drain_with(&mut self, c: usize, exact: bool) {
        let h = self.h(c);
        let mut d = marconi_drain {
            n_ops: usize::MAX,
            n_kv_pages: usize::MAX,
            n_state_slots: usize::MAX,
            ..Default::default()
        };
        // SAFETY: a size query: every buffer NULL with capacity 0.
        let st = self.call("drain_with", || unsafe {
            marconi_cache_drain_with(h, &mut d)
        });
        let (np, ns) = (d.n_kv_pages, d.n_state_slots);
        if !self.drain_size_query("drain_with", st, (np, ns, d.n_ops)) {
            return;
        }
        let b = common::drain_buffers(&mut d, if exact { 0 } else { 64 });
        // SAFETY: buffers passed with their capacities.
        let st = self.call("drain_with", || unsafe {
            marconi_cache_drain_with(h, &mut d)
        });
        let got = (d.n_kv_pages, d.n_state_slots);
        if !self.drained("drain_with", st, got, (np, ns)) {
            return;
        }
        let narrow =
            |v: &[u64]| -> Option<Vec<u32>> { v.iter().map(|&x| u32::try_from(x).ok()).collect() };
        let (Some(p), Some(s)) = (narrow(&b.pages[..got.0]), narrow(&b.slots[..got.1])) else {
            finding!(
                self,
                "drain_with gave an id of 2^32 or more on a cache over ids"
            );
            return;
        };
        self.settle_freed(c, &p, &s);
    }

    /// The model's side of a drain: each freed page and slot back to the
    /// engine, checked against what the model says of it.
    fn settle_freed(&mut self, c: usize, pages: &[u32], slots: &[u32]) {
        let m = &self.run.caches[c];
        let mut bad = Vec::new();
        {
            let mut ids = m.ids.lock().unwrap();
            let ids = &mut *ids;
            for (kind, freed, model, free) in [
                ("page", pages, &mut ids.pages, &mut self.free_pages[c]),
                ("slot", slots, &mut ids.slots, &mut self.free_slots[c]),
            ] {
                // An owned id comes back to the engine; one only offered
                // (lenient runs) was freed early; anything else is a finding.
                for &id in freed {
                    match model.get(&id).copied() {
                        Some(IdState::Owned) => {
                            model.remove(&id);
                            free.push(id);
                        }
                        Some(IdState::Offered) if !self.run.strict => {
                            model.insert(id, IdState::FreedEarly);
                        }
                        other => bad.push(format!("freed {kind} {id}, which was {other:?}")),
                    }
                }
            }
        }
        for b in bad {
            finding!(self, "drain: {b}");
        }
        if self.run.strict {
            self.check_ownership(c);
        }
    }

    /// After a complete drain (one thread): the ids the cache owns are
    /// exactly what its bytes say.
    fn check_ownership(&mut self, c: usize) {
        let Some(s) = self.check_stats(c) else { return };
        let m = &self.run.caches[c];
        let (owned_pages, owned_slots) = {
            let ids = m.ids.lock().unwrap();
            (
                ids.pages.values().filter(|&&v| v == IdState::Owned).count() as u64,
                ids.slots.values().filter(|&&v| v == IdState::Owned).count() as u64,
            )
        };
        if m.shape.pages && s.kv_bytes_per_token > 0 {
            let tokens = s.kv_bytes / s.kv_bytes_per_token;
            if owned_pages * u64::from(m.shape.page) != tokens {
                finding!(
                    self,
                    "the cache owns {owned_pages} pages of {} tokens but caches {tokens} KV tokens",
                    m.shape.page
                );
            }
        }
        if m.shape.slots && !m.stateless && owned_slots != s.states {
            finding!(
                self,
                "the cache owns {owned_slots} slots but holds {} states",
                s.states
            );
        }
    }

    fn op_evict(&mut self, c: usize) {
        let cap = self.run.caches[c].shape.capacity;
        let any = self.rng.next() % cap.max(1);
        let bytes = self
            .rng
            .pick(&[0, 1, cap / 3, cap / 2, cap, cap + 1, u64::MAX, any]);
        let h = self.h(c);
        let mut free = u64::MAX;
        // SAFETY: live handle, writable out.
        let st = self.call("evict", || unsafe {
            marconi_cache_evict(h, bytes, &mut free)
        });
        if !self.expect("evict", st, &[St::Ok]) {
            return;
        }
        if self.run.strict {
            if let Some(s) = self.check_stats(c) {
                if free != s.capacity_bytes - s.used_bytes {
                    finding!(
                        self,
                        "evict({bytes}) says {free} free, stats say {}",
                        s.capacity_bytes - s.used_bytes
                    );
                }
                let want = bytes.min(s.capacity_bytes);
                if free < want && s.evictable_bytes > 0 && s.leases == 0 {
                    finding!(
                        self,
                        "evict({bytes}) stopped at {free} free with {} evictable bytes",
                        s.evictable_bytes
                    );
                }
            }
        }
    }

    fn op_drain_log(&mut self, c: usize) {
        let h = self.h(c);
        let cap = self.rng.pick(&[0usize, 1, 64, 4096, 1 << 20]);
        let mut buf = vec![0u8; cap];
        let mut n = usize::MAX;
        // SAFETY: buf has cap writable bytes (or is NULL with 0).
        let st = self.call("drain_log", || unsafe {
            marconi_cache_drain_log(
                h,
                if cap == 0 {
                    ptr::null_mut()
                } else {
                    buf.as_mut_ptr().cast::<c_char>()
                },
                cap,
                &mut n,
            )
        });
        if !self.expect("drain_log", st, &[St::Ok, St::BufferTooSmall]) {
            return;
        }
        let m = &self.run.caches[c];
        if st == St::BufferTooSmall {
            if n <= cap {
                finding!(self, "drain_log: BUFFER_TOO_SMALL but needs {n} <= {cap}");
            }
            if !m.shape.log {
                finding!(self, "drain_log: records pending with the log off");
            }
            return;
        }
        if n > cap || (n > 0 && buf[n - 1] != b'\n') {
            finding!(self, "drain_log: {n} bytes into {cap}, not whole lines");
            return;
        }
        if n > 0 && !m.shape.log {
            finding!(self, "drain_log: {n} bytes with the log off");
        }
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        let issued = m.issued.lock().unwrap().clone();
        for line in text.lines() {
            match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) => {
                    if v.get("kind").is_none() {
                        finding!(self, "log record without a kind: {line}");
                    }
                    if let Some(l) = v.get("lease").and_then(|l| l.as_u64()) {
                        if self.run.strict && !issued.contains(&l) {
                            finding!(
                                self,
                                "log record names lease {l}, never issued by this cache: {line}"
                            );
                        }
                    }
                }
                Err(e) => finding!(self, "log line is not JSON ({e}): {line}"),
            }
        }
    }

    // ----------------------------------------------------- bad arguments --

    /// A lease id that no cache accepts now, of various kinds.
    fn bad_lease(&mut self, c: usize) -> u64 {
        let m = &self.run.caches[c];
        match self.rng.below(6) {
            0 => 0,
            1 => self.rng.next(),
            2 => m.released.lock().unwrap().last().copied().unwrap_or(12345),
            3 => self
                .run
                .dead_leases
                .lock()
                .unwrap()
                .last()
                .copied()
                .unwrap_or(u64::MAX),
            4 => {
                // Foreign: a live lease of another cache.
                self.leases
                    .iter()
                    .find(|l| l.cache != c)
                    .map(|l| l.id)
                    .unwrap_or(1)
            }
            _ => self
                .leases
                .iter()
                .find(|l| l.cache == c)
                .map(|l| l.id ^ 1)
                .unwrap_or(2),
        }
    }

    /// A page list of the right length for a call that must be refused for
    /// another reason: the lease's pages, then ids no one uses (a cache that
    /// was given pages refuses an admission without them).
    fn filler_pages(&self, li: usize, len: usize) -> Vec<u32> {
        let lr = &self.leases[li];
        let m = &self.run.caches[lr.cache];
        if !m.shape.pages {
            return Vec::new();
        }
        let n = len / m.shape.page as usize;
        let mut kv = lr.pages.clone();
        kv.truncate(n);
        while kv.len() < n {
            kv.push(0x7d00_0000 + kv.len() as u32);
        }
        kv
    }

    fn op_bad(&mut self, c: usize) {
        let h = self.h(c);
        let before = if self.run.strict {
            self.check_stats(c)
        } else {
            None
        };
        let t = self.tokens(8);
        let huge = self.rng.pick(&[
            u32::MAX as usize,
            u32::MAX as usize + 1,
            usize::MAX,
            usize::MAX / 4,
        ]);
        let mut l = marconi_lookup::default();
        let mut r = marconi_admit_result::default();
        let mut n = 0usize;
        let mut n2 = 0usize;
        let mut buf = [0u32; 4];
        let mut bytes = 0u64;
        // Misaligned: one byte into a u32 buffer.
        let raw = [0u8; 64];
        let mis = raw.as_ptr().wrapping_add(1).cast::<u32>();
        let mis_mut = buf.as_mut_ptr().cast::<u8>().wrapping_add(1).cast::<u32>();
        let lease = self.bad_lease(c);
        let live = self.leases.iter().position(|x| x.cache == c);
        let kind = self.rng.below(32);
        let null_c: *const marconi_cache = ptr::null();
        // SAFETY (every call below): the library checks NULL, alignment and
        // lengths before touching a buffer; buffers that are read are valid
        // for the length passed, or the length is refused first (oversized
        // lengths, the header's documented checks).
        let (what, st, want): (&str, St, Vec<St>) = unsafe {
            match kind {
                k @ 0..=5 => {
                    // Refused lookups: (what, cache, tokens, length, slot,
                    // out, refused as).
                    let out: *mut marconi_lookup = &mut l;
                    let none = ptr::null_mut();
                    let nothing = if huge % 2 == 0 {
                        ptr::null()
                    } else {
                        t.as_ptr()
                    };
                    let no_slot = MARCONI_NO_SLOT;
                    #[rustfmt::skip]
                    let cases = [
                        ("lookup NULL cache", null_c, ptr::null(), huge, 0, none, St::NullArgument),
                        ("lookup NULL tokens, huge length", h, ptr::null(), huge, no_slot, out, St::NullArgument),
                        ("lookup NULL out, huge length", h, t.as_ptr(), huge, no_slot, none, St::NullArgument),
                        ("lookup 0 tokens", h, nothing, 0, no_slot, out, St::EmptyTokens),
                        ("lookup huge length", h, t.as_ptr(), huge, no_slot, out, St::TooManyTokens),
                        ("lookup misaligned tokens", h, mis, 4, no_slot, out, St::InvalidArgument),
                    ];
                    let (what, c, toks, n, slot, out, want) = cases[k as usize];
                    let st = self.call("lookup", || marconi_cache_lookup(c, 0, toks, n, slot, out));
                    (what, st, vec![want])
                }
                k @ 30..=31 => {
                    // A checkpoint array NULL with a length, or too long.
                    let (what, (cp, n_cp), want) = if k == 30 {
                        (
                            "lookup_hinted NULL checkpoints with a length",
                            (ptr::null(), 1 + huge % 7),
                            St::NullArgument,
                        )
                    } else {
                        (
                            "lookup_hinted huge checkpoint count",
                            (t.as_ptr(), huge),
                            St::TooManyTokens,
                        )
                    };
                    let (tp, tn) = (t.as_ptr(), t.len());
                    let st = self.call("lookup_hinted", || {
                        marconi_cache_lookup_hinted(h, 0, tp, tn, cp, n_cp, MARCONI_NO_SLOT, &mut l)
                    });
                    (what, st, vec![want])
                }
                6 => (
                    "release unknown lease",
                    self.call("release", || marconi_cache_release(h, lease)),
                    vec![St::UnknownLease],
                ),
                7 => (
                    "release NULL cache",
                    self.call("release", || marconi_cache_release(null_c, lease)),
                    vec![St::NullArgument],
                ),
                k @ 8..=12 => {
                    // Admissions on a lease that is not live, with arrays
                    // (pointer, length) that disagree: (what, tokens,
                    // states, pages, out); all but the first have a NULL.
                    let null = ptr::null();
                    let none = (null, 0);
                    let out: *mut marconi_admit_result = &mut r;
                    #[rustfmt::skip]
                    let cases = [
                        ("admit unknown lease", (t.as_ptr(), t.len()), (ptr::null(), 0), none, out),
                        ("admit NULL tokens, huge length, bad lease", (null, huge), (mis.cast(), 3), none, out),
                        ("admit NULL states with a length", (t.as_ptr(), huge), (ptr::null(), 2), none, out),
                        ("admit NULL pages with a length", (mis, 4), (ptr::null(), 0), (null, 5), out),
                        ("admit NULL out", (mis, huge), (ptr::null(), 0), none, ptr::null_mut()),
                    ];
                    let (what, tokens, states, pages, out) = cases[k as usize - 8];
                    let a = AdmitArgs {
                        tokens,
                        states,
                        pages,
                        taken: ptr::null_mut(),
                    };
                    let want = if k == 8 {
                        St::UnknownLease
                    } else {
                        St::NullArgument
                    };
                    (
                        what,
                        self.call("admit", || a.call(h, lease, out)),
                        vec![want],
                    )
                }
                13 => (
                    "lease_plan unknown lease",
                    self.call("lease_plan", || {
                        marconi_cache_lease_plan(h, lease, buf.as_mut_ptr(), 4, &mut n)
                    }),
                    vec![St::UnknownLease],
                ),
                14 => (
                    "lease_kv_pages NULL buf with capacity",
                    self.call("lease_kv_pages", || {
                        marconi_cache_lease_kv_pages(h, lease, ptr::null_mut(), huge, &mut n)
                    }),
                    vec![St::NullArgument],
                ),
                15 => (
                    "lease_plan NULL out_len, misaligned buf",
                    self.call("lease_plan", || {
                        marconi_cache_lease_plan(h, lease, mis_mut, 2, ptr::null_mut())
                    }),
                    vec![St::NullArgument],
                ),
                k @ 16..=17 => {
                    // (pages, capacity), (slots, capacity), n_slots: one NULL
                    // where it may not be.
                    let (what, (pp, pc), (sp, sc), n_slots) = if k == 16 {
                        let n_slots: *mut usize = &mut n2;
                        (
                            "drain_freed NULL pages with capacity",
                            (ptr::null_mut(), 3),
                            (buf.as_mut_ptr(), 4),
                            n_slots,
                        )
                    } else {
                        (
                            "drain_freed NULL n_slots, misaligned pages",
                            (mis_mut, 1),
                            (ptr::null_mut(), 0),
                            ptr::null_mut(),
                        )
                    };
                    let st = self.call("drain_freed", || {
                        marconi_cache_drain_freed(h, pp, pc, &mut n, sp, sc, n_slots)
                    });
                    (what, st, vec![St::NullArgument])
                }
                18 => (
                    "evict NULL out",
                    self.call("evict", || {
                        marconi_cache_evict(h, u64::MAX, ptr::null_mut())
                    }),
                    vec![St::NullArgument],
                ),
                19 => (
                    "evict NULL cache",
                    self.call("evict", || marconi_cache_evict(null_c, 1, &mut bytes)),
                    vec![St::NullArgument],
                ),
                20 => (
                    "stats NULL",
                    self.call("stats", || marconi_cache_stats(h, ptr::null_mut())),
                    vec![St::NullArgument],
                ),
                21 => {
                    let mut s = marconi_stats {
                        struct_size: self.rng.below(16) as u32,
                        ..Default::default()
                    };
                    let copy = s;
                    let st = self.call("stats", || marconi_cache_stats(h, &mut s));
                    if s != copy {
                        finding!(
                            self,
                            "stats with struct_size {} wrote its output",
                            copy.struct_size
                        );
                    }
                    (
                        "stats small struct_size",
                        st,
                        vec![St::UnsupportedStructSize],
                    )
                }
                22 => (
                    "drain_log NULL out_len",
                    self.call("drain_log", || {
                        marconi_cache_drain_log(h, ptr::null_mut(), 0, ptr::null_mut())
                    }),
                    vec![St::NullArgument],
                ),
                23 => (
                    "drain_log NULL buf with capacity",
                    self.call("drain_log", || {
                        marconi_cache_drain_log(h, ptr::null_mut(), huge, &mut n)
                    }),
                    vec![St::NullArgument],
                ),
                24 => (
                    "check NULL",
                    self.call("check", || marconi_cache_check(null_c)),
                    vec![St::NullArgument],
                ),
                25 => {
                    // A partial stats struct: only struct_size bytes written.
                    let size = self.rng.range(16, size_of::<marconi_stats>() as u64 - 1) as u32;
                    let mut raw = [0xA5u8; size_of::<marconi_stats>()];
                    raw[..4].copy_from_slice(&size.to_ne_bytes());
                    let mut s = std::mem::MaybeUninit::<marconi_stats>::uninit();
                    ptr::copy_nonoverlapping(raw.as_ptr(), s.as_mut_ptr().cast::<u8>(), raw.len());
                    let st = self.call("stats", || marconi_cache_stats(h, s.as_mut_ptr()));
                    let mut after = [0u8; size_of::<marconi_stats>()];
                    ptr::copy_nonoverlapping(
                        s.as_ptr().cast::<u8>(),
                        after.as_mut_ptr(),
                        after.len(),
                    );
                    if after[size as usize..].iter().any(|&b| b != 0xA5) {
                        finding!(self, "stats with struct_size {size} wrote past it");
                    }
                    ("stats partial struct", st, vec![St::Ok])
                }
                26 if live.is_some() => {
                    // A live lease with a broken admission: wrong first token.
                    let lr = &self.leases[live.unwrap()];
                    let (id, mut toks) = (lr.id, lr.input.clone());
                    toks[0] = toks[0].wrapping_add(1);
                    (
                        "admit prefix mismatch",
                        self.call("admit", || AdmitArgs::of(&toks).call(h, id, &mut r)),
                        vec![St::PrefixMismatch],
                    )
                }
                27 if live.is_some() => {
                    let lr = &self.leases[live.unwrap()];
                    let (id, toks) = (lr.id, lr.input.clone());
                    let pos = self.rng.pick(&[0u32, toks.len() as u32 + 1, u32::MAX]);
                    let s = [marconi_saved_state {
                        position: pos,
                        slot: MARCONI_NO_SLOT,
                    }];
                    let kv = self.filler_pages(live.unwrap(), toks.len());
                    (
                        "admit position out of range",
                        self.call("admit", || {
                            AdmitArgs::of(&toks)
                                .states(&s)
                                .pages(&kv)
                                .call(h, id, &mut r)
                        }),
                        vec![St::PositionOutOfRange],
                    )
                }
                28 if live.is_some() => {
                    let lr = &self.leases[live.unwrap()];
                    let (id, toks) = (lr.id, lr.input.clone());
                    let page = self.run.caches[c].shape.page as usize;
                    let right = toks.len() / page;
                    let wrong = if right > 1 && self.rng.chance(1, 2) {
                        right - 1
                    } else {
                        right + 1
                    };
                    let pages: Vec<u32> = (0..wrong as u32).map(|k| 0x7f00_0000 + k).collect();
                    (
                        "admit bad page list length",
                        self.call("admit", || {
                            AdmitArgs::of(&toks).pages(&pages).call(h, id, &mut r)
                        }),
                        vec![St::BadPageList],
                    )
                }
                29 if live.is_some() => {
                    // The same fresh slot twice, at the valid positions.
                    let li = live.unwrap();
                    let toks = self.leases[li].input.clone();
                    let id = self.leases[li].id;
                    let pos = self.states_for(&self.leases[li], toks.len());
                    if pos.len() < 2 {
                        return;
                    }
                    let s: Vec<marconi_saved_state> = pos
                        .iter()
                        .map(|&p| marconi_saved_state {
                            position: p,
                            slot: 0x7e00_0000,
                        })
                        .collect();
                    let kv = self.filler_pages(li, toks.len());
                    (
                        "admit duplicate slot",
                        self.call("admit", || {
                            AdmitArgs::of(&toks)
                                .states(&s)
                                .pages(&kv)
                                .call(h, id, &mut r)
                        }),
                        vec![St::DuplicateSlot],
                    )
                }
                _ => return,
            }
        };
        self.expect(what, st, &want);
        if let Some(b) = before {
            if let Some(now) = self.check_stats(c) {
                if now != b && st != St::Ok {
                    finding!(self, "{what}: a failed call changed the stats");
                }
            }
        }
    }

    /// Bad configurations: each refused with its status, `*out` untouched.
    fn op_config(&mut self) {
        let mut cfg = default_config();
        cfg.capacity_bytes = 1 << 30;
        let grid = [0.5f64, 1.0];
        let alphas = [0.0f64, 2.0];
        let enums: [EnumField<marconi_cache_config>; 4] = [
            ("admission out of range", 3, |c| &mut c.admission),
            ("eviction out of range", 2, |c| &mut c.eviction),
            ("alpha_mode out of range", 2, |c| &mut c.alpha_mode),
            ("tuner_objective out of range", 2, |c| {
                &mut c.tuner_objective
            }),
        ];
        let (what, want): (&str, St) = match self.rng.below(18) {
            0 => {
                cfg.capacity_bytes = 0;
                ("capacity 0", St::InvalidConfig)
            }
            1 => {
                cfg.page_size = 0;
                ("page_size 0", St::InvalidConfig)
            }
            k @ 2..=5 => {
                let (name, first, field) = enums[k as usize - 2];
                *field(&mut cfg) = first + self.rng.below(1000) as u32;
                (name, St::InvalidConfig)
            }
            6 => {
                cfg.alpha_mode = 0;
                cfg.alpha = self.rng.pick(&[f64::NAN, -1.0, f64::INFINITY]);
                ("alpha not finite >= 0", St::InvalidConfig)
            }
            7 => {
                cfg.admission = 1;
                cfg.page_size = 16;
                cfg.block_size = 24;
                ("block_size not a multiple of the page", St::InvalidConfig)
            }
            8 => {
                cfg.model_preset = c"no-such-model".as_ptr();
                ("unknown preset", St::UnknownPreset)
            }
            9 => {
                cfg.tuner_grid = ptr::null();
                cfg.tuner_grid_len = self.rng.range(1, u64::MAX) as usize;
                cfg.admission = 77; // NULL is reported first
                ("tuner_grid NULL with a length", St::NullArgument)
            }
            10 => {
                cfg.reserved = 1;
                ("reserved field set", St::InvalidConfig)
            }
            11 => {
                // Smaller than the first version of the struct (it ends before
                // tuner_adoption); version-1 sizes are valid.
                let v1 = std::mem::offset_of!(marconi_cache_config, tuner_adoption);
                cfg.struct_size = self.rng.below(v1 as u64) as u32;
                ("struct_size too small", St::UnsupportedStructSize)
            }
            12 => {
                match self.rng.below(3) {
                    0 => cfg.model.kv_heads = 1 << 63,
                    1 => cfg.model.n_heads = 1 << 63,
                    _ => cfg.model.head_dim = u64::MAX,
                }
                ("model dimensions overflow", St::InvalidConfig)
            }
            13 => {
                // Rule tuning (tuner_tune_rules, on by default) is ignored
                // with a fixed alpha; shadow caches are refused.
                cfg.alpha_mode = 0;
                cfg.shadows = 1;
                cfg.tuner_tune_rules = self.rng.below(2) as u32;
                ("shadows with a fixed alpha", St::InvalidConfig)
            }
            14 => {
                cfg.shadows = 1;
                cfg.shadow_alphas = ptr::null();
                cfg.shadow_alphas_len = 1 + self.rng.below(1 << 20) as usize;
                ("shadow_alphas NULL with a length", St::NullArgument)
            }
            15 => {
                cfg.shadows = 1;
                cfg.shadow_alphas = alphas.as_ptr();
                cfg.shadow_alphas_len = 2;
                cfg.shadow_exact_bytes = self.rng.pick(&[1, 1 << 20, u64::MAX]);
                cfg.tuner_max_window = self.rng.pick(&[0, 8, 100]) as u32;
                ("a valid config with shadows", St::Ok)
            }
            16 => {
                let name = self.rng.pick(&POLICY_PRESETS);
                // SAFETY: a NUL-terminated name and a whole struct.
                let st = self.call("config_preset", || unsafe {
                    marconi_cache_config_preset(
                        &mut cfg,
                        std::mem::size_of::<marconi_cache_config>(),
                        name.as_ptr(),
                    )
                });
                self.expect("config_preset", st, &[St::Ok]);
                cfg.capacity_bytes = 1 << 30;
                ("a policy preset", St::Ok)
            }
            _ => {
                cfg.tuner_grid = grid.as_ptr();
                cfg.tuner_grid_len = 2;
                cfg.page_size = self.rng.pick(&[1, 4, 16]);
                ("a valid config with a custom grid", St::Ok)
            }
        };
        let sentinel = 0x10 as *mut marconi_cache;
        let mut out = sentinel;
        // SAFETY: cfg is a whole struct; its pointers follow their contracts.
        let st = self.call("cache_new", || unsafe { marconi_cache_new(&cfg, &mut out) });
        self.cur_cache = None;
        if self.expect(&format!("cache_new: {what}"), st, &[want]) && st == St::Ok {
            // SAFETY: a fresh handle, freed once.
            self.call("cache_free", || unsafe { marconi_cache_free(out) });
        } else if st == St::Ok {
            // SAFETY: a handle the library returned, freed once.
            unsafe { marconi_cache_free(out) };
        } else if out != sentinel {
            finding!(self, "cache_new: {what}: failed but wrote *out");
        }
        // NULL-first for the other entry points.
        // SAFETY: NULL is checked before anything is touched.
        let st = self.call("config_init", || unsafe {
            marconi_cache_config_init(ptr::null_mut(), 3)
        });
        self.expect("config_init NULL", st, &[St::NullArgument]);
        let mut small = default_config();
        // SAFETY: a size smaller than the struct is refused before writing.
        let st = self.call("config_init", || unsafe {
            marconi_cache_config_init(&mut small, 8)
        });
        self.expect("config_init small", st, &[St::UnsupportedStructSize]);
        // SAFETY: as above.
        let st = self.call("cache_new", || unsafe {
            marconi_cache_new(ptr::null(), ptr::null_mut())
        });
        self.expect("cache_new NULLs", st, &[St::NullArgument]);
        let mut spec = marconi_model_spec::default();
        let name = self.rng.pick(&PRESETS);
        // SAFETY: a NUL-terminated name and a writable spec.
        let st = self.call("model_spec_preset", || unsafe {
            marconi_model_spec_preset(name.as_ptr(), &mut spec)
        });
        self.expect("model_spec_preset", st, &[St::Ok]);
        // SAFETY: NULL is checked first.
        let st = self.call("model_spec_preset", || unsafe {
            marconi_model_spec_preset(ptr::null(), ptr::null_mut())
        });
        self.expect("model_spec_preset NULL", st, &[St::NullArgument]);
    }

    /// A short life of a pool (marconi_pool_*): a random, sometimes bad,
    /// configuration, then random allocate / free (live, freed, made-up and
    /// repeated handles) / resolve / copy / fork / promote / migrate calls
    /// against a model of the live handles and the byte each unit holds,
    /// the counts and the budget checked after each call; then a snapshot
    /// call over a caller's buffer, and the pool freed.
    fn op_pool(&mut self) {
        let mut cfg = std::mem::MaybeUninit::<marconi_pool_config>::uninit();
        // SAFETY: cfg has size_of writable bytes.
        let st = self.call("pool_config_init", || unsafe {
            marconi_pool_config_init(cfg.as_mut_ptr(), std::mem::size_of::<marconi_pool_config>())
        });
        if !self.expect("pool_config_init", st, &[St::Ok]) {
            return;
        }
        // SAFETY: initialised by marconi_pool_config_init.
        let mut cfg = unsafe { cfg.assume_init() };
        let memfd = self.rng.chance(3, 4);
        cfg.backend = u32::from(memfd);
        cfg.chunk_bytes = 64 << 10;
        cfg.budget_bytes = self.rng.range(2, 48) * (64 << 10);
        cfg.kv_page_bytes = self.rng.pick(&[4u64 << 10, 8 << 10, 6000]);
        cfg.state_slot_bytes = self.rng.pick(&[16u64 << 10, 24 << 10, 40000]);
        cfg.state_fraction = self.rng.pick(&[0.1, 0.3, 0.5, 0.9]);
        cfg.migration = self.rng.below(2) as u32;
        cfg.migration_batch_units = self.rng.pick(&[0u32, 1, 8, 64]);
        let (what, want) = match self.rng.below(12) {
            0 => {
                cfg.budget_bytes = 0;
                ("budget 0", St::InvalidConfig)
            }
            1 => {
                cfg.state_fraction = self.rng.pick(&[0.0, 1.0, f64::NAN, -3.0]);
                ("state_fraction outside (0, 1)", St::InvalidConfig)
            }
            2 => {
                cfg.backend = 3 + self.rng.below(1000) as u32;
                ("backend out of range", St::InvalidConfig)
            }
            3 => {
                cfg.backend = 2;
                ("backend CUDA without a GPU", St::Unsupported)
            }
            _ => ("a pool", St::Ok),
        };
        let mut p: *mut marconi_pool = 0x10 as *mut marconi_pool;
        // SAFETY: cfg is a whole struct; p writable.
        let st = self.call("pool_new", || unsafe { marconi_pool_new(&cfg, &mut p) });
        let want: &[St] = if want == St::Ok {
            // A budget too small for two pools of whole units or chunks.
            &[St::Ok, St::InvalidConfig]
        } else {
            &[want]
        };
        if !self.expect(&format!("pool_new: {what}"), st, want) || st != St::Ok {
            if p != 0x10 as *mut marconi_pool {
                finding!(self, "pool_new: {what}: *out written on failure");
            }
            return;
        }
        let mut live: HashMap<u64, u8> = HashMap::new();
        let mut freed: Vec<u64> = Vec::new();
        let mut byte = 1u8;
        let stats = |w: &mut Self| -> Option<marconi_pool_stats> {
            let mut s = marconi_pool_stats {
                struct_size: std::mem::size_of::<marconi_pool_stats>() as u32,
                ..Default::default()
            };
            // SAFETY: live pool, s writable.
            let st = w.call("pool_get_stats", || unsafe {
                marconi_pool_get_stats(p, &mut s)
            });
            w.expect("pool_get_stats", st, &[St::Ok]).then_some(s)
        };
        let unit = |l: &marconi_unit_location| -> &mut [u8] {
            // SAFETY: a live unit's address is mapped for unit_bytes while its
            // handle is live (the ABI's contract); only this worker uses it.
            unsafe { std::slice::from_raw_parts_mut(l.address as *mut u8, l.unit_bytes as usize) }
        };
        for _ in 0..self.rng.range(1, 24) {
            let pick = |w: &mut Self, state_only: bool| -> Option<u64> {
                let mut v: Vec<u64> = live
                    .keys()
                    .copied()
                    .filter(|&h| !state_only || is_state(h))
                    .collect();
                v.sort_unstable();
                (!v.is_empty()).then(|| v[w.rng.below(v.len() as u64) as usize])
            };
            match self.rng.below(8) {
                0 | 1 => {
                    let kind = self.rng.below(2) as u32;
                    let n = self.rng.below(20) as usize;
                    let mut out = vec![0u64; n];
                    // SAFETY: out has n writable handles.
                    let st = self.call("pool_allocate", || unsafe {
                        marconi_pool_allocate(p, kind, n, out.as_mut_ptr(), n)
                    });
                    if self.expect("pool_allocate", st, &[St::Ok, St::OutOfMemory]) && st == St::Ok
                    {
                        let mut locs = vec![marconi_unit_location::default(); n];
                        // SAFETY: out has n handles, locs n slots.
                        let st = self.call("pool_resolve", || unsafe {
                            marconi_pool_resolve(p, out.as_ptr(), n, locs.as_mut_ptr(), n)
                        });
                        self.expect("pool_resolve after allocate", st, &[St::Ok]);
                        for (h, l) in out.iter().zip(&locs) {
                            if live.insert(*h, byte).is_some() {
                                finding!(self, "pool_allocate: handle {h:#x} issued twice");
                            }
                            if memfd && st == St::Ok {
                                unit(l).fill(byte);
                            }
                        }
                        byte = byte.wrapping_add(1).max(1);
                    }
                }
                2 => {
                    let mut hs: Vec<u64> = (0..self.rng.below(4))
                        .filter_map(|_| pick(self, false))
                        .collect();
                    let distinct = hs.iter().collect::<HashSet<_>>().len() == hs.len();
                    if self.rng.chance(1, 4) && !freed.is_empty() {
                        hs.push(self.rng.pick(&freed));
                    }
                    let fresh = hs.iter().all(|h| live.contains_key(h));
                    // SAFETY: hs readable.
                    let st = self.call("pool_free_units", || unsafe {
                        marconi_pool_free_units(p, hs.as_ptr(), hs.len())
                    });
                    let want: &[St] = if fresh && distinct {
                        &[St::Ok]
                    } else {
                        &[St::DoubleFree, St::UnknownHandle]
                    };
                    if self.expect("pool_free_units", st, want) && st == St::Ok {
                        for h in hs {
                            live.remove(&h);
                            freed.push(h);
                        }
                    }
                }
                3 => {
                    let raw = self.rng.next();
                    if !live.contains_key(&raw) {
                        let mut l = marconi_unit_location::default();
                        // SAFETY: one handle, one location.
                        let st = self.call("pool_resolve", || unsafe {
                            marconi_pool_resolve(p, &raw, 1, &mut l, 1)
                        });
                        self.expect(
                            "pool_resolve made-up",
                            st,
                            &[St::UnknownHandle, St::DoubleFree],
                        );
                    }
                }
                4 => {
                    let pairs: Vec<marconi_state_copy> = (0..self.rng.below(4))
                        .filter_map(|_| {
                            Some(marconi_state_copy {
                                src_state: pick(self, true)?,
                                dst_state: pick(self, true)?,
                            })
                        })
                        .collect();
                    let dsts: Vec<u64> = pairs.iter().map(|q| q.dst_state).collect();
                    let valid = pairs.iter().all(|q| q.src_state != q.dst_state)
                        && dsts.iter().collect::<HashSet<_>>().len() == dsts.len()
                        && !pairs.iter().any(|q| dsts.contains(&q.src_state));
                    // SAFETY: pairs readable.
                    let st = self.call("pool_copy_states", || unsafe {
                        marconi_pool_copy_states(p, pairs.as_ptr(), pairs.len())
                    });
                    let want: &[St] = if !valid {
                        &[St::InvalidArgument]
                    } else if memfd || pairs.is_empty() {
                        &[St::Ok]
                    } else {
                        &[St::Unsupported]
                    };
                    if self.expect("pool_copy_states", st, want) && st == St::Ok {
                        let moved: Vec<(u64, u8)> = pairs
                            .iter()
                            .map(|q| (q.dst_state, live[&q.src_state]))
                            .collect();
                        live.extend(moved);
                    }
                }
                5 => {
                    if let Some(s) = pick(self, true) {
                        let c: Vec<u64> = (0..self.rng.below(3))
                            .filter_map(|_| pick(self, true))
                            .collect();
                        let accepted = self.rng.below(c.len() as u64 + 1) as usize;
                        let mode = self.rng.below(3) as u32;
                        let mut all = c.clone();
                        all.push(s);
                        let valid = accepted < c.len()
                            && mode < 2
                            && all.iter().collect::<HashSet<_>>().len() == all.len();
                        let mut now = 0u64;
                        // SAFETY: c readable, now writable.
                        let st = self.call("pool_promote_state", || unsafe {
                            marconi_pool_promote_state(
                                p,
                                s,
                                c.as_ptr(),
                                c.len(),
                                accepted,
                                mode,
                                &mut now,
                            )
                        });
                        let want: &[St] = if !valid {
                            &[St::InvalidArgument]
                        } else if memfd || mode == 0 {
                            &[St::Ok]
                        } else {
                            &[St::Unsupported]
                        };
                        if self.expect("pool_promote_state", st, want) && st == St::Ok && mode == 1
                        {
                            let b = live[&c[accepted]];
                            live.insert(s, b);
                        }
                    }
                }
                6 => {
                    let to = self.rng.below(2) as u32;
                    let units = self.rng.pick(&[0u32, 1, 16, 1000]);
                    let before = stats(self);
                    // SAFETY: NULL out is allowed.
                    let st = self.call("pool_migrate", || unsafe {
                        marconi_pool_migrate(p, to, units, ptr::null_mut())
                    });
                    let want: &[St] = if cfg.migration == 0 {
                        &[St::Unsupported]
                    } else {
                        &[St::Ok, St::OutOfMemory]
                    };
                    if self.expect("pool_migrate", st, want) && st != St::Ok {
                        if let (Some(b), Some(a)) = (before, stats(self)) {
                            if (a.kv_capacity, a.state_capacity)
                                != (b.kv_capacity, b.state_capacity)
                            {
                                finding!(self, "pool_migrate: a refused migration moved capacity");
                            }
                        }
                    }
                }
                _ => {
                    // NULL where a buffer is needed: NULL_ARGUMENT first.
                    // SAFETY: NULL pointers are checked before use.
                    let st = self.call("pool_allocate NULL", || unsafe {
                        marconi_pool_allocate(p, 9, 3, ptr::null_mut(), 3)
                    });
                    self.expect("pool_allocate NULL out", st, &[St::NullArgument]);
                    // SAFETY: as above.
                    let st = self.call("pool_free_units NULL", || unsafe {
                        marconi_pool_free_units(p, ptr::null(), 2)
                    });
                    self.expect("pool_free_units NULL", st, &[St::NullArgument]);
                }
            }
            // The model against the pool after every call.
            let Some(s) = stats(self) else { return };
            let live_kv = live.keys().filter(|&&h| !is_state(h)).count() as u64;
            let live_st = live.len() as u64 - live_kv;
            if s.kv_free + live_kv != s.kv_capacity || s.state_free + live_st != s.state_capacity {
                finding!(
                    self,
                    "pool: free + live != capacity ({s:?}, {live_kv} KV and {live_st} states live)"
                );
            }
            if s.physical_bytes > s.budget_bytes || s.mapped_chunks > s.budget_chunks {
                finding!(self, "pool: over the budget ({s:?})");
            }
            if memfd {
                for (&h, &b) in &live {
                    let mut l = marconi_unit_location::default();
                    // SAFETY: one handle, one location.
                    let st = unsafe { marconi_pool_resolve(p, &h, 1, &mut l, 1) };
                    if st != St::Ok || unit(&l).iter().any(|&x| x != b) {
                        finding!(
                            self,
                            "pool: unit {h:#x} lost its bytes or its mapping ({st:?})"
                        );
                        break;
                    }
                }
            }
        }
        // A snapshot over a caller's buffer, sometimes bad.
        let mut mem = vec![0u8; 4 * 8 * 24];
        let buf = marconi_state_buffer {
            base: if self.rng.chance(1, 8) {
                ptr::null_mut()
            } else {
                mem.as_mut_ptr()
            },
            slot_bytes: 24,
            slots: self.rng.pick(&[0u32, 8]),
            layers: 4,
        };
        let pairs = [marconi_copy_order {
            src_slot: self.rng.below(9) as u32,
            dst_slot: self.rng.below(9) as u32,
        }];
        // SAFETY: buf describes mem (or is NULL-based, refused); pairs readable.
        let st = self.call("snapshot_copy", || unsafe {
            marconi_snapshot_copy(&buf, pairs.as_ptr(), 1)
        });
        let ok = !buf.base.is_null()
            && buf.slots == 8
            && pairs[0].src_slot < 8
            && pairs[0].dst_slot < 8
            && pairs[0].src_slot != pairs[0].dst_slot;
        let want: &[St] = if buf.base.is_null() && buf.slots == 8 {
            &[St::NullArgument]
        } else if ok {
            &[St::Ok]
        } else {
            &[St::InvalidArgument]
        };
        self.expect("snapshot_copy", st, want);
        // SAFETY: freed once, never used again.
        self.call("pool_free", || unsafe { marconi_pool_free(p) });
    }

    /// Several pools and caches over pools at once, handles passed to the
    /// wrong one, long reuse cycles of one unit with every stale copy kept
    /// and replayed, and admits with handles from every source: the caller's
    /// reserved units, the lease's own cached pages, pages the cache holds
    /// elsewhere, another cache's, stale and duplicated ones. A handle given
    /// to anything but its owner must be refused and leave the owner's unit
    /// untouched; a stale handle must never be accepted.
    /// marconi_pool_free_units of the one handle `h` to pool `p` (`what`
    /// names the case), answered `want`.
    fn pool_free_one(&mut self, p: *mut marconi_pool, h: u64, what: &'static str, want: St) {
        // SAFETY: one readable handle; p is a pool handle, live or not.
        let st = self.call(what, || unsafe { marconi_pool_free_units(p, &h, 1) });
        self.expect(what, st, &[want]);
    }

    fn op_pools_cross(&mut self) {
        let mut pools = Vec::new();
        for _ in 0..self.rng.range(2, 4) {
            let mut cfg = pool_config();
            cfg.backend = 1;
            cfg.chunk_bytes = 64 << 10;
            cfg.budget_bytes = 1 << 20;
            cfg.kv_page_bytes = 4 << 10;
            cfg.state_slot_bytes = 16 << 10;
            if let Some(p) = self.new_pool(&cfg) {
                pools.push(p);
            }
        }
        // Units owned per pool: (handle, byte written).
        let mut owned: Vec<Vec<(u64, u8)>> = vec![Vec::new(); pools.len()];
        for (i, &p) in pools.iter().enumerate() {
            let kind = self.rng.below(2) as u32;
            let mut out = [0u64; 3];
            // SAFETY: out has 3 writable handles.
            let st = self.call("pool_allocate", || unsafe {
                marconi_pool_allocate(p, kind, 3, out.as_mut_ptr(), 3)
            });
            if self.expect("pool_allocate (cross)", st, &[St::Ok]) {
                for (k, &h) in out.iter().enumerate() {
                    let b = (i * 3 + k + 1) as u8;
                    if let Some(u) = unit_bytes(p, h) {
                        u.fill(b);
                    }
                    owned[i].push((h, b));
                }
            }
        }
        for _ in 0..self.rng.range(1, 8) {
            if pools.len() < 2 {
                break;
            }
            let i = self.rng.below(pools.len() as u64) as usize;
            let j = (i + 1 + self.rng.below(pools.len() as u64 - 1) as usize) % pools.len();
            let Some(&(h, b)) = owned[i].get(self.rng.below(3) as usize) else {
                continue;
            };
            let before = pool_free_units(pools[j]);
            let mut l = marconi_unit_location::default();
            let (q, other) = (pools[j], pools[i]);
            // SAFETY: one handle, one location.
            let st = self.call("pool_resolve (foreign)", || unsafe {
                marconi_pool_resolve(q, &h, 1, &mut l, 1)
            });
            self.expect(
                "pool_resolve of another pool's handle",
                st,
                &[St::UnknownHandle],
            );
            self.pool_free_one(
                q,
                h,
                "pool_free_units of another pool's handle",
                St::UnknownHandle,
            );
            if pool_free_units(q) != before {
                finding!(self, "a pool freed a unit for another pool's handle {h:#x}");
            }
            match unit_bytes(other, h) {
                Some(u) if u.iter().all(|&x| x == b) => {}
                _ => finding!(self, "the owner of {h:#x} lost it or its bytes"),
            }
        }
        // Long reuse of one unit: every earlier handle stays refused.
        let mut big = pool_config();
        big.backend = 0;
        big.budget_bytes = 128 << 20;
        big.kv_page_bytes = 128;
        big.state_slot_bytes = 128;
        big.migration = 0;
        if let Some(p) = self.new_pool(&big) {
            let cycles = self.rng.range(2_100, 2_600);
            let mut issued: Vec<u64> = Vec::with_capacity(cycles as usize);
            let mut seen = HashSet::new();
            for _ in 0..cycles {
                let mut h = 0u64;
                // SAFETY: one writable handle.
                let st = self.call("pool_allocate (reuse)", || unsafe {
                    marconi_pool_allocate(p, 0, 1, &mut h, 1)
                });
                if !self.expect("pool_allocate (reuse)", st, &[St::Ok]) {
                    break;
                }
                if !seen.insert(h) {
                    finding!(
                        self,
                        "pool reissued handle {h:#x} after {} cycles",
                        issued.len()
                    );
                    break;
                }
                self.pool_free_one(p, h, "pool_free_units (reuse)", St::Ok);
                issued.push(h);
            }
            let mut h = 0u64;
            // SAFETY: one writable handle.
            let st = self.call("pool_allocate (reuse)", || unsafe {
                marconi_pool_allocate(p, 0, 1, &mut h, 1)
            });
            self.expect("pool_allocate (reuse)", st, &[St::Ok]);
            for &old in &issued {
                let mut l = marconi_unit_location::default();
                // SAFETY: one handle, one location.
                let st = unsafe { marconi_pool_resolve(p, &old, 1, &mut l, 1) };
                if st == St::Ok {
                    finding!(self, "stale handle {old:#x} accepted after {cycles} reuses");
                    break;
                }
            }
            if let Some(&old) = issued.first() {
                self.pool_free_one(
                    p,
                    old,
                    "pool_free_units of a stale handle",
                    St::UnknownHandle,
                );
                if let Some(&q) = pools.first() {
                    self.pool_free_one(
                        q,
                        h,
                        "pool_free_units of another pool's handle",
                        St::UnknownHandle,
                    );
                }
            }
            // SAFETY: freed once.
            self.call("pool_free", || unsafe { marconi_pool_free(p) });
        }
        for (i, &p) in pools.iter().enumerate() {
            let hs: Vec<u64> = owned[i].iter().map(|o| o.0).collect();
            // SAFETY: hs readable.
            let st = self.call("pool_free_units", || unsafe {
                marconi_pool_free_units(p, hs.as_ptr(), hs.len())
            });
            self.expect("pool_free_units of the owner's units", st, &[St::Ok]);
            // SAFETY: freed once, never used again.
            self.call("pool_free", || unsafe { marconi_pool_free(p) });
        }
        // Findings there are the pooled caches', not a run cache's.
        let prev = self.cur_cache.take();
        self.op_pooled_admits();
        self.cur_cache = prev;
        self.op_host_pool();
    }

    /// A memfd device pool and a host pool: random demote / promote
    /// batches mixing good pairs with bad ones (handles of the other side,
    /// stale or made-up handles, a page into a slot, a destination twice,
    /// NULL pairs). A refused batch must leave every destination's bytes as
    /// they were; an accepted one must copy every pair's bytes.
    fn op_host_pool(&mut self) {
        let mut cfg = pool_config();
        cfg.backend = 1;
        cfg.migration = 0;
        cfg.chunk_bytes = 64 << 10;
        cfg.budget_bytes = 1 << 20;
        cfg.kv_page_bytes = 4 << 10;
        cfg.state_slot_bytes = 16 << 10;
        let Some(dev) = self.new_pool(&cfg) else {
            return;
        };
        let mut hc = std::mem::MaybeUninit::<marconi_host_pool_config>::uninit();
        // SAFETY: hc has sizeof(marconi_host_pool_config) writable bytes.
        let st = unsafe {
            marconi_host_pool_config_init(hc.as_mut_ptr(), size_of::<marconi_host_pool_config>())
        };
        self.expect("host_pool_config_init", st, &[St::Ok]);
        // SAFETY: initialised above.
        let mut hc = unsafe { hc.assume_init() };
        hc.capacity_bytes = 1 << 20;
        hc.chunk_bytes = 64 << 10;
        hc.page_bytes = 4 << 10;
        // A host pool of other state size, now and then: every state pair
        // is then refused for its size.
        hc.state_bytes = if self.rng.chance(1, 5) {
            32 << 10
        } else {
            16 << 10
        };
        let sizes_match = hc.state_bytes == 16 << 10;
        let mut host: *mut marconi_host_pool = ptr::null_mut();
        // SAFETY: a whole config; host writable.
        let st = self.call("host_pool_new", || unsafe {
            marconi_host_pool_new(&hc, &mut host)
        });
        if !self.expect("host_pool_new", st, &[St::Ok]) {
            // SAFETY: freed once.
            self.call("pool_free", || unsafe { marconi_pool_free(dev) });
            return;
        }
        // Units per side: [kv, kv, kv, state, state, state].
        let mut d = [0u64; 6];
        let mut h = [0u64; 6];
        for (kind, at) in [(0u32, 0usize), (1, 3)] {
            // SAFETY: 3 writable handles each.
            let a = self.call("pool_allocate", || unsafe {
                marconi_pool_allocate(dev, kind, 3, d[at..].as_mut_ptr(), 3)
            });
            // SAFETY: as above.
            let b = self.call("host_pool_allocate", || unsafe {
                marconi_host_pool_allocate(host, kind, 3, h[at..].as_mut_ptr(), 3)
            });
            self.expect("pool_allocate (host moves)", a, &[St::Ok]);
            self.expect("host_pool_allocate", b, &[St::Ok]);
        }
        let mut stale = 0u64;
        // SAFETY: one writable handle, then freed.
        let st = self.call("host_pool_allocate", || unsafe {
            marconi_host_pool_allocate(host, 0, 1, &mut stale, 1)
        });
        if self.expect("host_pool_allocate (stale)", st, &[St::Ok]) {
            // SAFETY: one readable handle.
            let st = self.call("host_pool_free_units", || unsafe {
                marconi_host_pool_free_units(host, &stale, 1)
            });
            self.expect("host_pool_free_units", st, &[St::Ok]);
        }
        for round in 0..self.rng.range(2, 10) {
            for (i, (&a, &b)) in d.iter().zip(&h).enumerate() {
                let fill = (round * 16 + i as u64 + 1) as u8;
                if let Some(u) = unit_bytes(dev, a) {
                    u.fill(fill);
                }
                if let Some(u) = host_unit_bytes(host, b) {
                    u.fill(fill ^ 0xff);
                }
            }
            let down = self.rng.chance(1, 2);
            let (src, dst) = if down { (&d, &h) } else { (&h, &d) };
            let n = self.rng.range(1, 4) as usize;
            let mut pairs = Vec::new();
            let mut used = HashSet::new();
            for _ in 0..n {
                let kind = self.rng.below(2) as usize * 3;
                let (a, b) = (
                    kind + self.rng.below(3) as usize,
                    kind + self.rng.below(3) as usize,
                );
                if used.insert(b) {
                    pairs.push(marconi_unit_move {
                        src: src[a],
                        dst: dst[b],
                    });
                }
            }
            let good = sizes_match
                || pairs
                    .iter()
                    .all(|p| !d[3..].contains(&p.src) && !h[3..].contains(&p.src));
            let mut want = if good { St::Ok } else { St::InvalidArgument };
            let bad = self.rng.below(8);
            if bad < 6 && !pairs.is_empty() {
                let k = self.rng.below(pairs.len() as u64) as usize;
                match bad {
                    0 => {
                        pairs[k].src = dst[0];
                        want = St::UnknownHandle;
                    }
                    1 => {
                        pairs[k].dst = src[0];
                        want = St::UnknownHandle;
                    }
                    2 => {
                        pairs[k].src = self.rng.next() >> 1;
                        want = St::UnknownHandle;
                    }
                    3 => {
                        pairs[k].dst = if down { stale } else { 0 };
                        want = if down {
                            St::DoubleFree
                        } else {
                            St::UnknownHandle
                        };
                    }
                    4 => {
                        // A page into a slot or a slot into a page.
                        let other = if dst[..3].contains(&pairs[k].dst) {
                            dst[3]
                        } else {
                            dst[0]
                        };
                        if pairs.iter().all(|p| p.dst != other) {
                            pairs[k].dst = other;
                            want = St::InvalidArgument;
                        }
                    }
                    _ => {
                        let dup = pairs[k];
                        pairs.push(dup);
                        want = St::InvalidArgument;
                    }
                }
            }
            // Which status wins when several things are wrong is the
            // first bad pair's: accept any refusal when `want` is one.
            let before: Vec<Vec<u8>> = pairs
                .iter()
                .map(|p| {
                    let bytes = if down {
                        host_unit_bytes(host, p.dst)
                    } else {
                        unit_bytes(dev, p.dst)
                    };
                    bytes.map(|b| b.to_vec()).unwrap_or_default()
                })
                .collect();
            let mut bytes = u64::MAX;
            let f = if down {
                marconi_host_pool_demote
            } else {
                marconi_host_pool_promote
            };
            // SAFETY: live pools; pairs readable; bytes writable.
            let st = self.call("host_pool_move", || unsafe {
                f(host, dev, pairs.as_ptr(), pairs.len(), &mut bytes)
            });
            let refusals = [St::UnknownHandle, St::DoubleFree, St::InvalidArgument];
            let accepted = if want == St::Ok {
                self.expect("host pool move", st, &[St::Ok])
            } else {
                self.expect("host pool move (bad pair)", st, &refusals);
                false
            };
            for (p, old) in pairs.iter().zip(&before) {
                let (now, src_bytes) = if down {
                    (host_unit_bytes(host, p.dst), unit_bytes(dev, p.src))
                } else {
                    (unit_bytes(dev, p.dst), host_unit_bytes(host, p.src))
                };
                let (Some(now), Some(src_bytes)) = (now, src_bytes) else {
                    continue;
                };
                if accepted && now != src_bytes {
                    finding!(self, "host pool move: pair {p:?} did not copy its bytes");
                }
                if !accepted && now != old.as_slice() {
                    finding!(
                        self,
                        "host pool move refused ({st:?}) but wrote {:#x}",
                        p.dst
                    );
                }
            }
        }
        // NULL arguments come first whatever else is wrong.
        // SAFETY: NULL pairs with a length: refused before any read.
        let st = unsafe { marconi_host_pool_demote(host, dev, ptr::null(), 3, ptr::null_mut()) };
        self.expect("host_pool_demote with NULL pairs", st, &[St::NullArgument]);
        // SAFETY: as above.
        let st =
            unsafe { marconi_host_pool_promote(ptr::null(), dev, ptr::null(), 0, ptr::null_mut()) };
        self.expect(
            "host_pool_promote with a NULL host pool",
            st,
            &[St::NullArgument],
        );
        // SAFETY: h readable; all six are live.
        let st = self.call("host_pool_free_units", || unsafe {
            marconi_host_pool_free_units(host, h.as_ptr(), h.len())
        });
        self.expect("host_pool_free_units of its units", st, &[St::Ok]);
        // SAFETY: freed once, never used again.
        self.call("host_pool_free", || unsafe { marconi_host_pool_free(host) });
        // SAFETY: as above.
        self.call("pool_free", || unsafe { marconi_pool_free(dev) });
    }

    fn new_pool(&mut self, cfg: &marconi_pool_config) -> Option<*mut marconi_pool> {
        let mut p: *mut marconi_pool = ptr::null_mut();
        // SAFETY: a whole config; p writable.
        let st = self.call("pool_new", || unsafe { marconi_pool_new(cfg, &mut p) });
        self.expect("pool_new (cross)", st, &[St::Ok]).then_some(p)
    }

    /// Two caches over pools; in each, a request caches a sequence, then a
    /// request sharing part of it (KV matched past the usable hit) admits
    /// with a page or slot from one source; bad sources must be refused with
    /// nothing changed, good ones accepted.
    fn op_pooled_admits(&mut self) {
        let mut caches: Vec<*mut marconi_cache> = Vec::new();
        // A third of the runs put lower tiers below the first cache (memfd
        // pools small enough to evict, signatures in every unit).
        let mut trng =
            Rng::new(self.run.seed ^ TIERS_SALT ^ self.call.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let tiered = trng.chance(1, 3);
        let mut opts = init(marconi_tier_options_init);
        let mut tm: Option<pooled_tiers::TierModel> = None;
        for k in 0..2 {
            let mut cc = default_config();
            cc.model_preset = c"nemotron-h-8b".as_ptr();
            cc.page_size = 16;
            let mut pc = pool_config();
            pc.backend = 0;
            pc.budget_bytes = 8 << 30;
            pc.kv_page_bytes = 0;
            pc.state_slot_bytes = 0;
            let mut c: *mut marconi_cache = ptr::null_mut();
            // The one handle with pools; the other through the deprecated
            // constructor, which makes the same handle.
            if k == 0 && tiered {
                self.tier_shape(&mut trng, &mut cc, &mut pc, &mut opts);
                cc.tiers = &opts;
                let mut m = pooled_tiers::TierModel::new(16);
                m.one_drain = self.via.chance(1, 2);
                tm = Some(m);
            }
            let st = if k == 0 {
                cc.pools = &pc;
                // SAFETY: whole configs (pc lives through the call); c writable.
                self.call("cache_new (pools)", || unsafe {
                    marconi_cache_new(&cc, &mut c)
                })
            } else {
                let mut pcache: *mut marconi_pooled_cache = ptr::null_mut();
                // SAFETY: whole configs; pcache writable.
                let st = self.call("pooled_cache_new", || unsafe {
                    marconi_pooled_cache_new(&cc, &pc, &mut pcache)
                });
                c = pcache.cast();
                st
            };
            if self.expect("cache_new (pools)", st, &[St::Ok]) {
                caches.push(c);
            } else if k == 0 {
                tm = None;
            }
        }
        // A pool call on one of the run's caches (none has pools): refused,
        // nothing written.
        if !self.run.caches.is_empty() {
            let k = self.rng.below(self.run.caches.len() as u64) as usize;
            let plain = self.h(k);
            let (mut pg, mut sl, mut n) = ([0u64; 2], [0u64; 1], 0usize);
            // SAFETY: writable buffers of their lengths.
            let st = self.call("cache_reserve (no pools)", || unsafe {
                marconi_cache_reserve(plain, 2, 1, pg.as_mut_ptr(), 2, sl.as_mut_ptr(), 1)
            });
            self.expect(
                "cache_reserve on a cache without pools",
                st,
                &[St::Unsupported],
            );
            // SAFETY: as above.
            let st = self.call("cache_held (no pools)", || unsafe {
                marconi_cache_held(plain, pg.as_mut_ptr(), 2, &mut n)
            });
            self.expect(
                "cache_held on a cache without pools",
                st,
                &[St::Unsupported],
            );
            if pg != [0; 2] || sl != [0] || n != 0 {
                finding!(self, "a refused pool call wrote its outputs");
            }
        }
        if caches.len() < 2 {
            for c in caches {
                // SAFETY: freed once.
                unsafe { marconi_cache_free(c) };
            }
            return;
        }
        // A reservation of the other cache: foreign handles.
        let (mut fpg, mut fsl) = ([0u64; 2], [0u64; 1]);
        let other = caches[1];
        // SAFETY: writable buffers.
        let st = self.call("pooled_cache_reserve", || unsafe {
            marconi_cache_reserve(other, 2, 1, fpg.as_mut_ptr(), 2, fsl.as_mut_ptr(), 1)
        });
        self.expect("pooled_cache_reserve (other)", st, &[St::Ok]);
        let c = caches[0];
        // Half the runs publish the cache's events: drained between
        // requests, they must rebuild what the cache holds (events name
        // tokens, never units).
        let ev = if self.rng.chance(1, 2) {
            self.events_new(c)
        } else {
            None
        };
        let mut mirror = ::marconi_events::Mirror::default();
        let base: Vec<u32> = (0..self.rng.range(64, 160))
            .map(|_| self.rng.below(50_000) as u32 + 1)
            .collect();
        let mut stale: Vec<u64> = Vec::new();
        self.pooled_request(
            c,
            &base,
            base.len() as u32 - 4,
            None,
            &mut stale,
            &[],
            tm.as_mut(),
        );
        // Calls over engine ids have nothing to serve on a cache over pools:
        // refused, nothing changed.
        let held = pooled_list(c, true);
        let mut l = marconi_lookup::default();
        // SAFETY: base readable, l writable.
        let st = self.call("cache_lookup (pools)", || unsafe {
            marconi_cache_lookup(c, 0, base.as_ptr(), base.len(), MARCONI_NO_SLOT, &mut l)
        });
        self.expect("cache_lookup on a cache over pools", st, &[St::Unsupported]);
        let (mut pages, mut slots, mut np, mut ns) = ([0u32; 4], [0u32; 4], 0usize, 0usize);
        // SAFETY: writable buffers of their lengths.
        let st = self.call("cache_drain_freed (pools)", || unsafe {
            marconi_cache_drain_freed(
                c,
                pages.as_mut_ptr(),
                4,
                &mut np,
                slots.as_mut_ptr(),
                4,
                &mut ns,
            )
        });
        self.expect(
            "cache_drain_freed on a cache over pools",
            st,
            &[St::Unsupported],
        );
        if pooled_list(c, true) != held || l != marconi_lookup::default() {
            finding!(self, "a refused engine-id call changed a cache over pools");
        }
        for _ in 0..self.rng.range(2, 6) {
            let keep = self.rng.range(16, base.len() as u64 - 8) as usize;
            let mut t = base[..keep].to_vec();
            t.extend((0..self.rng.range(20, 60)).map(|_| self.rng.below(50_000) as u32 + 60_000));
            let source = self.rng.below(7) as u8;
            let input = t.len() as u32 - 3;
            self.pooled_request(c, &t, input, Some(source), &mut stale, &fpg, tm.as_mut());
            if let Some(ev) = ev.filter(|_| self.rng.chance(1, 2)) {
                self.events_drain(ev, c, &mut mirror);
            }
        }
        if let Some(mut m) = tm.take() {
            self.pooled_tier_requests(c, &mut trng, &mut m, &mut stale, &fpg, ev, &mut mirror);
            for (k, v) in [
                m.requests,
                m.lower_hits,
                m.host_writes,
                m.store_writes,
                m.drops,
                m.device_hits,
            ]
            .into_iter()
            .enumerate()
            {
                POOLED_TIERS[k].fetch_add(v, Ordering::Relaxed);
            }
        }
        if let Some(ev) = ev {
            self.events_drain(ev, c, &mut mirror);
            self.events_agree(ev, c, &mirror, "events over pools");
            // SAFETY: both live; the events handle freed once.
            self.call("events_free (pools)", || unsafe {
                marconi_events_free(ev, c)
            });
        }
        // SAFETY: the other cache's units, freed once.
        let st = unsafe { marconi_cache_free_units(other, fpg.as_ptr(), 2) };
        self.expect("pooled_cache_free_units (other)", st, &[St::Ok]);
        // SAFETY: as above.
        let st = unsafe { marconi_cache_free_units(other, fsl.as_ptr(), 1) };
        self.expect("pooled_cache_free_units (other)", st, &[St::Ok]);
        for c in caches {
            // SAFETY: live handle.
            let st = unsafe { marconi_cache_check(c) };
            self.expect("pooled_cache_check", st, &[St::Ok]);
            // SAFETY: freed once.
            self.call("cache_free (pools)", || unsafe { marconi_cache_free(c) });
        }
    }

    /// The lower tiers of a cache over pools (written through; a host tier,
    /// a store below it on some, always_load, promote, exclusive and
    /// lower_plans drawn) over memfd pools of a few states and pages of
    /// `cc`'s model; on some runs a write-back configuration first, which
    /// must be refused with nothing written.
    fn tier_shape(
        &mut self,
        trng: &mut Rng,
        cc: &mut marconi_cache_config,
        pc: &mut marconi_pool_config,
        o: &mut marconi_tier_options,
    ) {
        let model = marconi_core::ModelSpec::preset("nemotron-h-8b").unwrap();
        let (kv, st) = marconi_gpu::pooled::unit_sizes(&model, cc.page_size);
        let chunk = 2u64 << 20;
        let (slots, pages) = (trng.range(3, 5), trng.range(12, 40));
        pc.backend = marconi_pool_backend::Memfd as u32;
        pc.budget_bytes = (slots * st + pages * kv).div_ceil(chunk) * chunk + chunk;
        pc.state_fraction = ((slots * st + chunk) as f64 / pc.budget_bytes as f64).min(0.95);
        pc.migration = trng.below(2) as u32;
        let chain = model.kv_bytes_per_token() * 64 + model.state_bytes();
        o.write_mode = marconi_tier_write::Through as u32;
        o.host.capacity_bytes = chain * trng.range(2, 12);
        if trng.chance(1, 3) {
            o.store.capacity_bytes = chain * trng.range(8, 64);
        }
        o.always_load = u32::from(trng.chance(3, 4));
        o.promote = u32::from(trng.chance(1, 3));
        o.exclusive = u32::from(trng.chance(3, 4));
        o.lower_plans = u32::from(trng.chance(3, 4));
        if trng.chance(1, 4) {
            let mut bad = *o;
            bad.write_mode = marconi_tier_write::Back as u32;
            let mut cfg = *cc;
            cfg.pools = &*pc;
            cfg.tiers = &bad;
            let sentinel = ptr::NonNull::<marconi_cache>::dangling().as_ptr();
            let mut c = sentinel;
            // SAFETY: whole configs living through the call; c writable.
            let st = self.call("cache_new (pools, tiers written back)", || unsafe {
                marconi_cache_new(&cfg, &mut c)
            });
            self.expect(
                "cache_new over pools with tiers written back",
                st,
                &[St::InvalidConfig],
            );
            if c != sentinel {
                finding!(
                    self,
                    "a refused cache_new (pools, write-back) wrote its out pointer"
                );
            }
        }
    }

    /// Requests over a few documents on a cache over pools with tiers (it
    /// evicts: lower-tier hits and their loads), with settle, a reported
    /// load failure and a refused lookup_tiered among them; the tier stats
    /// agree with what was reported. With an events handle, its batches are
    /// drained between requests, and now and then must rebuild the cache's
    /// content as its snapshot says it.
    #[expect(clippy::too_many_arguments, reason = "one run's whole context")]
    fn pooled_tier_requests(
        &mut self,
        c: *mut marconi_cache,
        trng: &mut Rng,
        tm: &mut pooled_tiers::TierModel,
        stale: &mut Vec<u64>,
        foreign: &[u64],
        ev: Option<*mut marconi_events>,
        mirror: &mut ::marconi_events::Mirror,
    ) {
        let docs: Vec<Vec<u32>> = (0..trng.range(3, 6))
            .map(|_| {
                (0..trng.range(3, 8) * 16)
                    .map(|_| trng.below(50_000) as u32 + 1)
                    .collect()
            })
            .collect();
        let mut failures = 0u64;
        let mut d = 0;
        for _ in 0..trng.range(6, 20) {
            // A document asked again at once branches at its end (a state
            // there, written down): later, a lower tier's hit.
            if trng.chance(2, 3) {
                d = trng.index(docs.len());
            }
            let mut t = docs[d].clone();
            t.extend((0..trng.range(4, 40)).map(|_| trng.below(50_000) as u32 + 120_000));
            let input = t.len() as u32 - trng.range(1, 3) as u32;
            self.pooled_request(c, &t, input, None, stale, foreign, Some(&mut *tm));
            if let Some(ev) = ev.filter(|_| trng.chance(1, 2)) {
                self.events_drain(ev, c, mirror);
                if trng.chance(1, 4) {
                    self.events_agree(ev, c, mirror, "events over pools with tiers");
                }
            }
            match trng.below(8) {
                0 => {
                    // SAFETY: live handle.
                    let st = self.call("cache_settle (pools)", || unsafe {
                        marconi_cache_settle(c)
                    });
                    self.expect("cache_settle over pools with tiers", st, &[St::Ok]);
                    let f = tm.drain(c, None);
                    self.report(f);
                }
                1 => {
                    let mut hit = marconi_tiered_hit::default();
                    // SAFETY: t readable, hit writable.
                    let st = self.call("cache_lookup_tiered (pools)", || unsafe {
                        marconi_cache_lookup_tiered(
                            c,
                            0,
                            t.as_ptr(),
                            t.len(),
                            ptr::null(),
                            0,
                            ptr::null(),
                            &mut hit,
                        )
                    });
                    self.expect(
                        "cache_lookup_tiered over pools with tiers",
                        st,
                        &[St::Unsupported],
                    );
                    if hit != marconi_tiered_hit::default()
                        || !last_error().contains("marconi_cache_lookup_pooled")
                    {
                        finding!(
                            self,
                            "a refused lookup_tiered over pools wrote its output or named no call to use ({})",
                            last_error()
                        );
                    }
                }
                2 => {
                    let mut l = marconi_pooled_lookup::default();
                    // SAFETY: t readable, l writable.
                    let st = self.call("cache_lookup_pooled (load failure)", || unsafe {
                        marconi_cache_lookup_pooled(c, 0, t.as_ptr(), input as usize, &mut l)
                    });
                    if self.expect("cache_lookup_pooled", st, &[St::Ok]) {
                        // SAFETY: live lease.
                        let st = self.call("cache_report_load_failure", || unsafe {
                            marconi_cache_report_load_failure(c, l.lease)
                        });
                        failures += u64::from(self.expect(
                            "cache_report_load_failure on a live lease",
                            st,
                            &[St::Ok],
                        ));
                        // SAFETY: live lease.
                        let st = self.call("cache_release (load failure)", || unsafe {
                            marconi_cache_release(c, l.lease)
                        });
                        self.expect("cache_release", st, &[St::Ok]);
                        let f = tm.drain(c, None);
                        self.report(f);
                        if let Some(f) =
                            pooled_tiers::check_units(c, (0, 0), "after a load failure")
                        {
                            finding!(self, "{f}");
                        }
                    }
                }
                _ => {}
            }
        }
        let mut s = versioned::<marconi_tiered_stats>();
        // SAFETY: live handle, out sized by struct_size.
        let st = self.call("cache_tier_stats (pools)", || unsafe {
            marconi_cache_tier_stats(c, &mut s)
        });
        if self.expect("cache_tier_stats over pools", st, &[St::Ok])
            && (s.load_failures != failures
                || s.hits_by_tier[1] + s.hits_by_tier[2] < tm.lower_hits)
        {
            finding!(
                self,
                "tier stats over pools: {} load failures of {failures} reported, {} + {} lower hits of {} loaded",
                s.load_failures,
                s.hits_by_tier[1],
                s.hits_by_tier[2],
                tm.lower_hits
            );
        }
    }

    /// Each of `found` as a finding.
    fn report(&mut self, found: Vec<String>) {
        for f in found {
            finding!(self, "pooled tiers: {f}");
        }
    }

    /// One request through cache `c`; with `source`, first an admit whose
    /// page or slot list carries a handle from that source (0 the caller's:
    /// valid; 1 a page the cache holds elsewhere; 2 another cache's page;
    /// 3 a stale handle; 4 a reserved page twice; 5 a reserved slot twice;
    /// 6 the lease's own hit page at another position). With `tm` (a cache
    /// with lower tiers over memfd pools) the engine model also checks the
    /// device hit's bytes, carries out the lease's loads into the reserved
    /// units and every drained op, and checks the units after each step.
    #[expect(clippy::too_many_arguments, reason = "one request's whole context")]
    fn pooled_request(
        &mut self,
        c: *mut marconi_cache,
        tokens: &[u32],
        input: u32,
        source: Option<u8>,
        stale: &mut Vec<u64>,
        foreign: &[u64],
        mut tm: Option<&mut pooled_tiers::TierModel>,
    ) {
        let mut l = marconi_pooled_lookup::default();
        // Half the requests through the one lookup and the one admit
        // (int64 ids on half of those), narrowed as the shorthands write.
        let with = self.via.chance(1, 2).then(|| self.via.chance(1, 2));
        let input_tokens = &tokens[..input as usize];
        // SAFETY: tokens readable, l writable.
        let st = self.call("pooled_cache_lookup", || unsafe {
            match with {
                Some(wide) => {
                    VIA_WITH[0].fetch_add(1, Ordering::Relaxed);
                    let (st, r) =
                        common::lookup_with(c, 0, (input_tokens, wide), &[], 0, MARCONI_NO_SLOT);
                    if st == St::Ok {
                        l = marconi_pooled_lookup::from(&r);
                    }
                    st
                }
                None => marconi_cache_lookup_pooled(c, 0, tokens.as_ptr(), input as usize, &mut l),
            }
        });
        if !self.expect("pooled_cache_lookup", st, &[St::Ok]) {
            return;
        }
        let mut hit = vec![0u64; l.n_kv_pages as usize];
        let mut n = 0usize;
        // SAFETY: hit has n_kv_pages writable handles.
        let st = unsafe {
            marconi_cache_lease_kv_handles(c, l.lease, hit.as_mut_ptr(), hit.len(), &mut n)
        };
        self.expect("pooled_cache_lease_kv_pages", st, &[St::Ok]);
        if let Some(tm) = tm.as_deref_mut() {
            let mut f = tm.drain(c, None);
            f.extend(tm.check_hit(c, tokens, &l, &hit));
            self.report(f);
        }
        let full_pages = tokens.len() / 16;
        let want = full_pages.saturating_sub(hit.len());
        // With tiers, the plan's states are saved too (a lower tier's hit
        // needs a state written down at a branch point): a slot each.
        let end = (tokens.len() / 16 * 16) as u32;
        let mut plan = vec![0u32; if tm.is_some() { l.n_plan as usize } else { 0 }];
        if !plan.is_empty() {
            // SAFETY: plan has its length in writable positions.
            let st = unsafe {
                marconi_cache_lease_plan(c, l.lease, plan.as_mut_ptr(), plan.len(), &mut n)
            };
            self.expect("cache_lease_plan (pools)", st, &[St::Ok]);
            plan.retain(|&p| p > 0 && p < end);
        }
        let n_slots = 2 + plan.len();
        let (mut pg, mut sl) = (vec![0u64; want], vec![0u64; n_slots]);
        // SAFETY: writable buffers of their lengths.
        let st = self.call("pooled_cache_reserve", || unsafe {
            marconi_cache_reserve(
                c,
                want as u32,
                n_slots as u32,
                pg.as_mut_ptr(),
                want,
                sl.as_mut_ptr(),
                n_slots,
            )
        });
        if !self.expect("pooled_cache_reserve", st, &[St::Ok, St::OutOfMemory]) || st != St::Ok {
            // SAFETY: live lease.
            unsafe { marconi_cache_release(c, l.lease) };
            if let Some(tm) = tm.as_deref_mut() {
                let f = tm.drain(c, None);
                self.report(f);
            }
            return;
        }
        let mut pages = hit.clone();
        pages.extend_from_slice(&pg);
        let mut states = vec![marconi_pooled_state {
            position: end,
            reserved: 0,
            state_handle: sl[0],
        }];
        states.extend(common::pooled_states(&plan, &sl[2..]));
        if let Some(tm) = tm.as_deref_mut() {
            // What the reservation evicted first, then the loads from the
            // engine's copies, then "prefill" past what was reused or
            // loaded, and the state saved.
            let mut f = tm.drain(c, None);
            let (loaded, more) = tm.load(c, 0, tokens, &l, &pages, sl[1]);
            f.extend(more);
            for (i, &h) in pages
                .iter()
                .enumerate()
                .skip(loaded.pages_to.max(hit.len()))
            {
                if let Err(e) = pooled_tiers::write(c, h, &pooled_tiers::kv_sig(tokens, 16, i)) {
                    f.push(format!("prefill of page {i}: {e}"));
                }
            }
            for s in &states {
                let sig = pooled_tiers::state_sig(&tokens[..s.position as usize]);
                if let Err(e) = pooled_tiers::write(c, s.state_handle, &sig) {
                    f.push(format!("the state saved at {}: {e}", s.position));
                }
            }
            f.extend(pooled_tiers::check_units(
                c,
                (pg.len() as u64, n_slots as u64),
                "after reserve",
            ));
            self.report(f);
        }
        let held = pooled_list(c, true);
        let before = held.clone();
        if let Some(src) = source {
            let mut bad_pages = pages.clone();
            let mut bad_states = states.to_vec();
            let at = hit.len().min(pages.len().saturating_sub(1));
            let want: Option<St> = match src {
                1 => held
                    .iter()
                    .find(|h| !is_state(**h) && !hit.contains(h))
                    .map(|&h| {
                        bad_pages[at] = h;
                        St::UnknownHandle
                    }),
                2 => {
                    bad_pages[at] = foreign[0];
                    Some(St::UnknownHandle)
                }
                3 => stale.last().map(|&h| {
                    if is_state(h) {
                        bad_states[0].state_handle = h;
                    } else {
                        bad_pages[at] = h;
                    }
                    St::UnknownHandle
                }),
                4 if pg.len() >= 2 => {
                    bad_pages[hit.len() + 1] = pg[0];
                    Some(St::DuplicatePage)
                }
                5 => {
                    bad_states.push(marconi_pooled_state {
                        position: 16,
                        reserved: 0,
                        state_handle: sl[0],
                    });
                    Some(St::DuplicateSlot)
                }
                6 if hit.len() >= 2 => {
                    bad_pages.swap(0, 1);
                    Some(St::UnknownHandle)
                }
                _ => None,
            };
            if let Some(want) = want {
                let mut taken = vec![0u8; bad_states.len()];
                let mut r = marconi_admit_result::default();
                let (s, p, t) = (&bad_states, &bad_pages, &mut taken);
                let st = self.call("pooled_cache_admit (bad)", || {
                    common::pooled_admit(c, l.lease, tokens, s, p, t, &mut r)
                });
                self.expect(
                    &format!("pooled_cache_admit with source {src}"),
                    st,
                    &[want],
                );
                if pooled_list(c, true) != before {
                    finding!(
                        self,
                        "a refused pooled admit (source {src}) changed what the cache holds"
                    );
                }
                if let Some(tm) = tm.as_deref_mut() {
                    let f = tm.drain(c, None);
                    self.report(f);
                }
            }
        }
        let mut taken = vec![0u8; states.len()];
        let mut r = marconi_admit_result::default();
        let st = self.call("pooled_cache_admit", || match with {
            Some(wide) => {
                VIA_WITH[1].fetch_add(1, Ordering::Relaxed);
                let units: Vec<(u32, u64)> = states
                    .iter()
                    .map(|s| (s.position, s.state_handle))
                    .collect();
                let (width, t) = (marconi_id_width::U64 as u32, Some(&mut taken[..]));
                common::admit_with(c, l.lease, (tokens, wide), &units, &pages, width, t, &mut r)
            }
            None => common::pooled_admit(c, l.lease, tokens, &states, &pages, &mut taken, &mut r),
        });
        let mut mine: Vec<u64> = Vec::new();
        if self.expect("pooled_cache_admit", st, &[St::Ok]) {
            mine = common::untaken(&pages, hit.len(), &r, &states, &taken);
        } else {
            mine.extend_from_slice(&pg);
            mine.extend(states.iter().map(|s| s.state_handle));
        }
        mine.push(sl[1]);
        if let Some(tm) = tm.as_deref_mut() {
            // The host writes read this admission's units: before any is
            // freed.
            let adm = pooled_tiers::Admission {
                pages: &pages,
                states: &states,
            };
            let mut f = tm.drain(c, Some(&adm));
            let slots = mine.iter().filter(|&&h| is_state(h)).count() as u64;
            let caller = (mine.len() as u64 - slots, slots);
            f.extend(pooled_tiers::check_units(c, caller, "after admit"));
            self.report(f);
        }
        let now = pooled_list(c, true);
        if let Some(h) = mine.iter().find(|h| now.contains(h)) {
            finding!(
                self,
                "pooled admit: {h:#x} is both the caller's and the cache's"
            );
        }
        // SAFETY: mine readable.
        let st = self.call("pooled_cache_free_units", || unsafe {
            marconi_cache_free_units(c, mine.as_ptr(), mine.len())
        });
        self.expect(
            "pooled_cache_free_units of the caller's units",
            st,
            &[St::Ok],
        );
        stale.extend_from_slice(&mine);
        // Half the drains of a cache over pools without tiers through the
        // one drain; with tiers, the tier model drains (through the one
        // drain in half the runs, which then hands the freed units over).
        if let Some(tm) = tm.as_deref_mut() {
            stale.extend(tm.take_freed());
        }
        if tm.is_none() && self.via.chance(1, 2) {
            let freed = self.pooled_drain_with(c);
            stale.extend(freed);
        } else {
            stale.extend(pooled_list(c, false));
        }
        if let Some(tm) = tm.as_deref_mut() {
            let f = tm.drain(c, None);
            self.report(f);
        }
        // SAFETY: live lease.
        let st = self.call("pooled_cache_release", || unsafe {
            marconi_cache_release(c, l.lease)
        });
        self.expect("pooled_cache_release", st, &[St::Ok]);
        if let Some(tm) = tm {
            let f = tm.drain(c, None);
            self.report(f);
        }
        // SAFETY: live handle.
        let st = unsafe { marconi_cache_check(c) };
        self.expect("pooled_cache_check", st, &[St::Ok]);
        // No unit leaked: the caller holds none of this cache's now.
        if let Some(f) = pooled_tiers::check_units(c, (0, 0), "after a request") {
            finding!(self, "{f}");
        }
    }

    fn op_messages(&mut self) {
        let status = self.rng.pick(&[0u32, 4, 19, 20, 9999, u32::MAX]);
        let cap = self.rng.pick(&[0usize, 1, 5, 200]);
        let mut buf = vec![0x55u8; cap];
        let p = if cap == 0 {
            ptr::null_mut()
        } else {
            buf.as_mut_ptr().cast::<c_char>()
        };
        // SAFETY: buf has cap writable bytes (or NULL with 0).
        let n = self.call("status_message", || unsafe {
            marconi_status_message(status, p, cap)
        });
        if cap > 0 {
            let end = buf.iter().position(|&b| b == 0);
            if end != Some(n.min(cap - 1)) {
                finding!(
                    self,
                    "status_message({status}, cap {cap}) = {n}, NUL at {end:?}"
                );
            }
        }
        // SAFETY: as above.
        let n = self.call("last_error", || unsafe { marconi_last_error(p, cap) });
        if cap > 0 && buf.iter().position(|&b| b == 0) != Some(n.min(cap - 1)) {
            finding!(
                self,
                "last_error(cap {cap}) = {n}, not NUL-terminated there"
            );
        }
        let v = self.call("version", || marconi_version());
        if v.is_null() {
            finding!(self, "marconi_version is NULL");
        }
    }

    /// Duplicate ids the cache owns, offered again after a complete drain
    /// (one thread only: then ownership is exact).
    fn op_owned_again(&mut self, c: usize) {
        if !self.run.strict {
            return;
        }
        self.op_drain(c, true);
        let Some(li) = self.leases.iter().position(|x| x.cache == c) else {
            return;
        };
        let m = &self.run.caches[c];
        let (slot, page) = {
            let ids = m.ids.lock().unwrap();
            (
                ids.slots
                    .iter()
                    .find(|(_, &v)| v == IdState::Owned)
                    .map(|(&k, _)| k),
                ids.pages
                    .iter()
                    .find(|(_, &v)| v == IdState::Owned)
                    .map(|(&k, _)| k),
            )
        };
        let h = self.h(c);
        let lr = &self.leases[li];
        let (id, toks, ns) = (lr.id, lr.input.clone(), lr.ns);
        let _ = ns;
        let before = self.check_stats(c);
        if let Some(slot) = slot {
            let mut l = marconi_lookup::default();
            // SAFETY: live handle and buffers.
            let st = self.call("lookup", || unsafe {
                marconi_cache_lookup(h, 0, toks.as_ptr(), toks.len(), slot, &mut l)
            });
            self.expect(
                "lookup into a slot the cache owns",
                st,
                &[St::InvalidArgument],
            );
            let pos = self.states_for(&self.leases[li], toks.len());
            if let Some(&p) = pos.first() {
                let s = [marconi_saved_state { position: p, slot }];
                let mut r = marconi_admit_result::default();
                let kv = self.filler_pages(li, toks.len());
                // SAFETY: as above.
                let st = self.call("admit", || unsafe {
                    AdmitArgs::of(&toks)
                        .states(&s)
                        .pages(&kv)
                        .call(h, id, &mut r)
                });
                self.expect("admit a slot the cache owns", st, &[St::DuplicateSlot]);
            }
        }
        if let (Some(page), true) = (page, m.shape.pages) {
            // Only where exactly one page past the hit is needed: the list
            // is then the lease's own pages and the owned one. The cache may
            // refuse it, or accept the call without taking that page (its
            // tokens already cached); taking it would be a double ownership.
            let n = toks.len() / m.shape.page as usize;
            let mut kv = self.leases[li].pages.clone();
            if n == kv.len() + 1 && !kv.contains(&page) {
                kv.push(page);
                let mut r = marconi_admit_result::default();
                // SAFETY: as above.
                let st = self.call("admit", || unsafe {
                    AdmitArgs::of(&toks).pages(&kv).call(h, id, &mut r)
                });
                self.expect(
                    &format!("admit page {page} the cache owns"),
                    st,
                    &[St::DuplicatePage, St::Ok],
                );
                if st == St::Ok {
                    if (r.kv_pages_taken_start as usize..r.kv_pages_taken_end as usize)
                        .contains(&(n - 1))
                    {
                        finding!(
                            self,
                            "admit took page {page}, which the cache already owned: {r:?}"
                        );
                    }
                    return;
                }
            }
        }
        if let (Some(b), Some(now)) = (before, self.check_stats(c)) {
            if b != now {
                finding!(self, "refused calls with owned ids changed the stats");
            }
        }
    }

    /// Frees a cache and builds another in its place (one thread only: the
    /// ABI forbids freeing a cache other threads use).
    fn op_freed_cache_lease(&mut self) {
        let mut cfg = default_config();
        cfg.capacity_bytes = 1 << 30;
        cfg.page_size = self.rng.pick(&[1, 4, 16]);
        let mut h = ptr::null_mut();
        // SAFETY: valid config and out pointer.
        let st = self.call("cache_new", || unsafe { marconi_cache_new(&cfg, &mut h) });
        self.cur_cache = None;
        if !self.expect("cache_new", st, &[St::Ok]) {
            return;
        }
        let t = self.tokens(20);
        let mut l = marconi_lookup::default();
        // SAFETY: live handle and buffers.
        let st = self.call("lookup", || unsafe {
            marconi_cache_lookup(h, 0, t.as_ptr(), t.len(), MARCONI_NO_SLOT, &mut l)
        });
        if self.expect("lookup", st, &[St::Ok]) {
            self.run.dead_leases.lock().unwrap().push(l.lease);
        }
        // SAFETY: freed once, with its lease outstanding; never used again.
        self.call("cache_free", || unsafe { marconi_cache_free(h) });
    }

    // ----------------------------------------------------------- events --

    /// The event stream (marconi_events_*): a private cache whose every
    /// change is drained into batches with random buffer sizes (size
    /// queries, too small, exact), each decoded and applied to a mirror;
    /// at the end the mirror must equal a snapshot of the cache and have
    /// seen no removal of an unknown block. Bad configs, non-finite
    /// timestamps, a cache of another page size, NULLs and the publisher
    /// calls of a handle without one are refused with their statuses.
    /// One in four runs churns an events handle on a shared cache instead
    /// (other threads use it meanwhile: a race target for TSan).
    fn op_events(&mut self, c: usize) {
        if self.rng.chance(1, 4) {
            return self.op_events_shared(c);
        }
        let mut cfg = default_config();
        cfg.page_size = self.rng.pick(&[1, 4, 16]);
        cfg.capacity_bytes = 1 << 40;
        let mut h = ptr::null_mut();
        // SAFETY: valid config and out pointer.
        let st = self.call("cache_new", || unsafe { marconi_cache_new(&cfg, &mut h) });
        self.cur_cache = None;
        if !self.expect("cache_new (events)", st, &[St::Ok]) {
            return;
        }
        // Room for a few hundred tokens and a few states, so that most
        // runs evict (BlockRemoved, state removals, merges).
        let Ok(s) = stats_of(h) else {
            finding!(self, "get_stats of a fresh cache failed");
            return;
        };
        // SAFETY: freed once; replaced below.
        self.call("cache_free", || unsafe { marconi_cache_free(h) });
        cfg.capacity_bytes = s.kv_bytes_per_token * self.rng.range(64, 2048)
            + s.state_bytes_per_entry * self.rng.range(1, 6);
        // SAFETY: valid config and out pointer.
        let st = self.call("cache_new", || unsafe { marconi_cache_new(&cfg, &mut h) });
        if !self.expect("cache_new (events)", st, &[St::Ok]) {
            return;
        }
        let Some(ev) = self.events_new(h) else {
            // SAFETY: freed once.
            self.call("cache_free", || unsafe { marconi_cache_free(h) });
            return;
        };
        let mut mirror = ::marconi_events::Mirror::default();
        let mut slot = 0u32;
        let prefixes: Vec<Vec<u32>> = (0..3).map(|_| self.tokens(64)).collect();
        for _ in 0..self.rng.range(1, 16) {
            let mut toks = prefixes[self.rng.below(3) as usize].clone();
            toks.truncate(self.rng.range(1, 64) as usize);
            let suffix = self.rng.range(0, 200) as usize;
            toks.extend(self.tokens(suffix));
            self.events_cycle(h, cfg.page_size, &toks, &mut slot);
            if self.rng.chance(1, 2) {
                self.events_drain(ev, h, &mut mirror);
            }
            if self.rng.chance(1, 8) {
                self.events_refusals(ev, h);
            }
        }
        self.events_drain(ev, h, &mut mirror);
        self.events_agree(ev, h, &mirror, "events");
        if self.rng.chance(1, 2) {
            // SAFETY: both live; each freed once, never used again.
            self.call("events_free", || unsafe { marconi_events_free(ev, h) });
            self.call("cache_free", || unsafe { marconi_cache_free(h) });
        } else {
            // The cache first: the handle is then freed with a NULL cache.
            // SAFETY: as above.
            self.call("cache_free", || unsafe { marconi_cache_free(h) });
            self.call("events_free", || unsafe {
                marconi_events_free(ev, ptr::null())
            });
        }
    }

    fn op_events_shared(&mut self, c: usize) {
        let h = self.h(c);
        let Some(ev) = self.events_new(h) else {
            return;
        };
        for _ in 0..self.rng.range(1, 4) {
            let cap = self.rng.pick(&[0usize, 16, 4096, 1 << 20]);
            let mut buf = vec![0u8; cap];
            let mut len = usize::MAX;
            let p = if cap == 0 {
                ptr::null_mut()
            } else {
                buf.as_mut_ptr()
            };
            // SAFETY: live handles; buf has cap writable bytes.
            let st = self.call("events_drain", || unsafe {
                marconi_events_drain(ev, h, 1.0, p, cap, &mut len)
            });
            if self.expect(
                "events_drain (shared cache)",
                st,
                &[St::Ok, St::BufferTooSmall],
            ) && st == St::Ok
                && len > 0
                && len != usize::MAX
            {
                if let Err(e) = ::marconi_events::decode_batch(&buf[..len]) {
                    finding!(self, "events_drain (shared cache): undecodable batch: {e}");
                }
            }
        }
        // SAFETY: live handles; ev freed once.
        self.call("events_free", || unsafe { marconi_events_free(ev, h) });
    }

    /// After a drain: the batches drained into `mirror` rebuild what the
    /// snapshot of `c` holds, and removed nothing never stored.
    fn events_agree(
        &mut self,
        ev: *mut marconi_events,
        c: *mut marconi_cache,
        mirror: &::marconi_events::Mirror,
        what: &str,
    ) {
        if let Some(snap) = self.events_snapshot(ev, c) {
            if snap.set != mirror.set {
                finding!(
                    self,
                    "{what}: drained batches rebuild {} blocks/states, the snapshot has {}",
                    mirror.set.len(),
                    snap.set.len()
                );
            }
        }
        if mirror.unknown_removals != 0 {
            finding!(
                self,
                "{what}: {} removals of blocks never stored",
                mirror.unknown_removals
            );
        }
    }

    /// An events handle with a random valid config (seed, medium, states,
    /// formats), after a few refused configs.
    fn events_new(&mut self, h: *mut marconi_cache) -> Option<*mut marconi_events> {
        let size = size_of::<marconi_events_config>();
        let mut raw = vec![0u64; size / 8 + 2];
        let small = self.rng.range(0, size as u64 - 1) as usize;
        // SAFETY: raw has more than `size` writable, 8-aligned bytes.
        let st = self.call("events_config_init", || unsafe {
            marconi_events_config_init(raw.as_mut_ptr().cast(), small)
        });
        self.expect(
            "events_config_init: struct_size too small",
            st,
            &[St::UnsupportedStructSize],
        );
        // SAFETY: as above.
        let st = self.call("events_config_init", || unsafe {
            marconi_events_config_init(raw.as_mut_ptr().cast(), size + 8)
        });
        if !self.expect("events_config_init: a newer caller", st, &[St::Ok]) {
            return None;
        }
        // SAFETY: initialised above; the struct is plain data with pointers NULL.
        let mut cfg: marconi_events_config =
            unsafe { raw.as_ptr().cast::<marconi_events_config>().read() };
        cfg.struct_size = size as u32;
        // A newer caller's tail with a field set is refused.
        let bytes = raw.as_mut_ptr().cast::<u8>();
        // SAFETY: offset `size` is inside raw.
        unsafe { bytes.add(size).write(1) };
        let mut out: *mut marconi_events = 0x10 as *mut _;
        // SAFETY: raw holds a struct of size + 8 bytes.
        let st = self.call("events_new", || unsafe {
            marconi_events_new(h, raw.as_ptr().cast(), &mut out)
        });
        self.expect(
            "events_new: unknown field set",
            st,
            &[St::UnsupportedStructSize],
        );
        let ep = c"tcp://127.0.0.1:1";
        let enums: [EnumField<marconi_events_config>; 3] = [
            ("hash_format out of range", 2, |c| &mut c.hash_format),
            ("layout out of range", 2, |c| &mut c.layout),
            ("namespaces out of range", 3, |c| &mut c.namespaces),
        ];
        let (what, want): (&str, St) = match self.rng.below(8) {
            k @ 0..=2 => {
                let (name, first, field) = enums[k as usize];
                *field(&mut cfg) = first + self.rng.below(100) as u32;
                (name, St::InvalidConfig)
            }
            3 if marconi_events_has_publisher() == 0 => {
                cfg.endpoint = ep.as_ptr();
                ("an endpoint without the publisher", St::InvalidConfig)
            }
            _ => ("", St::Ok),
        };
        if want != St::Ok {
            // SAFETY: cfg is a whole struct; out writable.
            let st = self.call("events_new", || unsafe {
                marconi_events_new(h, &cfg, &mut out)
            });
            self.expect(&format!("events_new: {what}"), st, &[want]);
            if out != 0x10 as *mut _ {
                finding!(self, "events_new: {what}: *out written on failure");
            }
            // SAFETY: fresh default again.
            unsafe { marconi_events_config_init(&mut cfg, size) };
        }
        let seeds = [c"", c"vllm-none-hash", c"fuzz"];
        let media = [c"GPU", c"cpu"];
        if self.rng.chance(1, 2) {
            cfg.seed = self.rng.pick(&seeds).as_ptr();
        }
        cfg.medium = self.rng.pick(&media).as_ptr();
        cfg.states = self.rng.below(2) as u32;
        cfg.hash_format = self.rng.below(2) as u32;
        cfg.layout = self.rng.below(2) as u32;
        // SAFETY: NULL arguments are refused before use.
        let st = self.call("events_new", || unsafe {
            marconi_events_new(h, ptr::null(), &mut out)
        });
        self.expect("events_new: NULL config", st, &[St::NullArgument]);
        // SAFETY: as above.
        let st = self.call("events_new", || unsafe {
            marconi_events_new(h, &cfg, ptr::null_mut())
        });
        self.expect("events_new: NULL out", st, &[St::NullArgument]);
        // SAFETY: h live, cfg whole, out writable.
        let st = self.call("events_new", || unsafe {
            marconi_events_new(h, &cfg, &mut out)
        });
        (self.expect("events_new", st, &[St::Ok]) && st == St::Ok).then_some(out)
    }

    /// One request through the cache: lookup, admit with its final state
    /// (the position Marconi admission always accepts), release.
    fn events_cycle(&mut self, h: *mut marconi_cache, page: u32, toks: &[u32], slot: &mut u32) {
        let mut l = marconi_lookup::default();
        // SAFETY: live handle and buffers.
        let st = self.call("lookup", || unsafe {
            marconi_cache_lookup(h, 0, toks.as_ptr(), toks.len(), MARCONI_NO_SLOT, &mut l)
        });
        if !self.expect("lookup (events)", st, &[St::Ok]) {
            return;
        }
        let aligned = toks.len() as u32 / page * page;
        *slot += 1;
        let states = [marconi_saved_state {
            position: aligned,
            slot: *slot,
        }];
        let n_states = usize::from(aligned > l.hit_tokens);
        let mut taken = [0u8; 1];
        let mut out = marconi_admit_result::default();
        // SAFETY: live handle, buffers with their lengths.
        let a = AdmitArgs {
            states: (states.as_ptr(), n_states),
            taken: taken.as_mut_ptr(),
            ..AdmitArgs::of(toks)
        };
        let st = self.call("admit", || unsafe { a.call(h, l.lease, &mut out) });
        self.expect("admit (events)", st, &[St::Ok]);
        // SAFETY: live handle.
        let st = self.call("release", || unsafe { marconi_cache_release(h, l.lease) });
        self.expect("release (events)", st, &[St::Ok]);
    }

    /// Drains what changed, with a random buffer: a size query, a buffer
    /// too small (the batch stays pending) or one large enough; decodes the
    /// batch and applies it to `mirror`.
    fn events_drain(
        &mut self,
        ev: *mut marconi_events,
        h: *mut marconi_cache,
        mirror: &mut ::marconi_events::Mirror,
    ) {
        let mut len = usize::MAX;
        // SAFETY: live handles; NULL buffer with capacity 0 is a size query.
        let st = self.call("events_drain", || unsafe {
            marconi_events_drain(ev, h, 2.5, ptr::null_mut(), 0, &mut len)
        });
        if !self.expect(
            "events_drain: size query",
            st,
            &[St::Ok, St::BufferTooSmall],
        ) {
            return;
        }
        if st == St::Ok {
            if len != 0 {
                finding!(self, "events_drain: size query OK but length {len}");
            }
            return;
        }
        let need = len;
        if need > 1 && self.rng.chance(1, 3) {
            let mut small = vec![0u8; need - 1];
            // SAFETY: small has need - 1 writable bytes.
            let st = self.call("events_drain", || unsafe {
                marconi_events_drain(ev, h, 9.0, small.as_mut_ptr(), small.len(), &mut len)
            });
            self.expect("events_drain: one byte short", st, &[St::BufferTooSmall]);
            if len != need {
                finding!(
                    self,
                    "events_drain: a pending batch changed size: {need} then {len}"
                );
            }
        }
        let mut buf = vec![0u8; need + self.rng.below(64) as usize];
        // SAFETY: buf has buf.len() writable bytes.
        let st = self.call("events_drain", || unsafe {
            marconi_events_drain(ev, h, 2.5, buf.as_mut_ptr(), buf.len(), &mut len)
        });
        if !self.expect("events_drain", st, &[St::Ok]) {
            return;
        }
        if len != need {
            finding!(
                self,
                "events_drain: wrote {len} bytes, the size query said {need}"
            );
            return;
        }
        match ::marconi_events::decode_batch(&buf[..len]) {
            Ok(b) => {
                if b.ts != 2.5 {
                    finding!(
                        self,
                        "events_drain: a batch kept its first ts; got {}",
                        b.ts
                    );
                }
                mirror.apply(&b.events);
            }
            Err(e) => finding!(self, "events_drain: undecodable batch: {e}"),
        }
    }

    /// The cache's content as a snapshot batch, decoded into a mirror.
    fn events_snapshot(
        &mut self,
        ev: *mut marconi_events,
        h: *mut marconi_cache,
    ) -> Option<::marconi_events::Mirror> {
        let mut len = 0usize;
        // SAFETY: size query.
        let st = self.call("events_snapshot", || unsafe {
            marconi_events_snapshot(ev, h, 3.0, ptr::null_mut(), 0, &mut len)
        });
        if !self.expect("events_snapshot: size query", st, &[St::BufferTooSmall]) {
            return None;
        }
        let mut buf = vec![0u8; len];
        // SAFETY: buf has len writable bytes.
        let st = self.call("events_snapshot", || unsafe {
            marconi_events_snapshot(ev, h, 3.0, buf.as_mut_ptr(), buf.len(), &mut len)
        });
        if !self.expect("events_snapshot", st, &[St::Ok]) {
            return None;
        }
        match ::marconi_events::decode_batch(&buf[..len]) {
            Ok(b) => {
                let mut m = ::marconi_events::Mirror::default();
                m.apply(&b.events);
                Some(m)
            }
            Err(e) => {
                finding!(self, "events_snapshot: undecodable batch: {e}");
                None
            }
        }
    }

    /// Calls the handle must refuse, none of which may change what it
    /// delivers.
    fn events_refusals(&mut self, ev: *mut marconi_events, h: *mut marconi_cache) {
        let mut len = 0usize;
        let mut buf = [0u8; 8];
        let bad_ts = self.rng.pick(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY]);
        // SAFETY: live handles, buf writable.
        let st = self.call("events_drain", || unsafe {
            marconi_events_drain(ev, h, bad_ts, buf.as_mut_ptr(), buf.len(), &mut len)
        });
        self.expect("events_drain: non-finite ts", st, &[St::InvalidArgument]);
        // SAFETY: NULLs are refused first.
        let st = self.call("events_drain", || unsafe {
            marconi_events_drain(ptr::null(), h, 1.0, buf.as_mut_ptr(), buf.len(), &mut len)
        });
        self.expect("events_drain: NULL handle", st, &[St::NullArgument]);
        // SAFETY: as above.
        let st = self.call("events_drain", || unsafe {
            marconi_events_drain(ev, h, 1.0, ptr::null_mut(), 8, &mut len)
        });
        self.expect(
            "events_drain: NULL buffer of length 8",
            st,
            &[St::NullArgument],
        );
        let mut seq = 7u64;
        // SAFETY: live handles.
        let st = self.call("events_publish", || unsafe {
            marconi_events_publish(ev, h, 1.0, &mut seq)
        });
        self.expect(
            "events_publish without a publisher",
            st,
            &[St::InvalidArgument],
        );
        if seq != 7 {
            finding!(self, "events_publish: refused but wrote a sequence number");
        }
        let which = self.rng.below(4) as u32;
        // SAFETY: live handle, buf writable.
        let st = self.call("events_endpoint", || unsafe {
            marconi_events_endpoint(ev, which, buf.as_mut_ptr().cast(), buf.len(), &mut len)
        });
        self.expect(
            "events_endpoint without a publisher",
            st,
            &[St::InvalidArgument],
        );
        // A cache of another page size.
        let mut cfg = default_config();
        cfg.page_size = 8;
        cfg.capacity_bytes = 1 << 30;
        let mut other = ptr::null_mut();
        // SAFETY: valid config.
        let st = self.call("cache_new", || unsafe {
            marconi_cache_new(&cfg, &mut other)
        });
        if self.expect("cache_new (page 8)", st, &[St::Ok]) {
            // SAFETY: live handles.
            let st = self.call("events_drain", || unsafe {
                marconi_events_drain(ev, other, 1.0, buf.as_mut_ptr(), buf.len(), &mut len)
            });
            self.expect(
                "events_drain: a cache of another page size",
                st,
                &[St::InvalidArgument],
            );
            // SAFETY: freed once.
            self.call("cache_free", || unsafe { marconi_cache_free(other) });
        }
    }

    /// A tiered cache's short life, driven as an engine drives it
    /// (`fuzz_abi_parts/tiered.rs`): ops replayed, copies checked against
    /// each tier's claims after every request.
    fn op_tiered(&mut self) {
        let dir = std::env::temp_dir().join(format!(
            "marconi-fuzz-tiered-{}-{}-{}-{}",
            std::process::id(),
            self.run.seed,
            self.w,
            self.call
        ));
        if std::fs::create_dir_all(&dir).is_err() {
            return;
        }
        let requests = self.rng.range(10, 60) as u32;
        let mut rng = Rng::new(self.rng.next());
        let prev = self.cur_cache.take();
        let life = self.call("tiered_life", || {
            tiered_life::life(&mut rng, &dir, requests)
        });
        let _ = std::fs::remove_dir_all(&dir);
        self.run.calls.fetch_add(life.calls, Ordering::Relaxed);
        TIERED_REQUESTS.fetch_add(life.requests, Ordering::Relaxed);
        ONE_HANDLE_REQUESTS.fetch_add(life.one_handle_requests, Ordering::Relaxed);
        for f in life.findings {
            finding!(self, "{f}");
        }
        self.cur_cache = prev;
    }

    // ------------------------------------------------------------- loop --

    fn step(&mut self) {
        let n = self.run.caches.len();
        let mut c = self.rng.below(n as u64) as usize;
        if self.run.caches[c].poisoned.load(Ordering::Relaxed) {
            match (0..n).find(|&k| !self.run.caches[k].poisoned.load(Ordering::Relaxed)) {
                Some(k) => c = k,
                None => return,
            }
        }
        self.cur_cache = Some(c);
        if self.run.only_tiered {
            self.op_tiered();
            self.steps += 1;
            return;
        }
        match self.rng.below(100) {
            0..=24 => self.op_lookup(c),
            25..=49 => self.op_admit(),
            50..=61 => self.op_release(),
            62..=67 => {
                let exact = self.rng.chance(1, 2);
                self.op_drain(c, exact)
            }
            68..=69 => self.op_evict(c),
            70..=72 => {
                self.check_stats(c);
            }
            73..=74 => self.op_drain_log(c),
            75..=91 => self.op_bad(c),
            92 => self.op_config(),
            93 => {
                if self.rng.chance(1, 3) {
                    self.op_pools_cross()
                } else {
                    self.op_pool()
                }
            }
            94 => self.op_events(c),
            95 => self.op_messages(),
            96..=97 => self.op_owned_again(c),
            98 => self.op_tiered(),
            _ => self.op_freed_cache_lease(),
        }
        // Too many open leases pin everything: release the oldest.
        if self.leases.len() > 12 {
            let lr = self.leases.remove(0);
            self.release_live(&lr);
        }
        self.steps += 1;
        if self.run.check_every > 0 && self.steps % self.run.check_every == 0 {
            if let Some(c) = self.cur_cache {
                if !self.run.caches[c].poisoned.load(Ordering::Relaxed) {
                    self.check_cache(c);
                }
            }
        }
    }
}

// --------------------------------------------------------------- main ----

/// Seeded random calls through libmarconi's C ABI (docs/fuzzing.md).
#[derive(clap::Parser)]
#[command(name = "fuzz_abi")]
struct Args {
    /// The first seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How many seeds to run (with --seconds: seeds until it ends, however
    /// many this says).
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// Calls per seed (with --only-tiered: tiered cache lives per seed).
    #[arg(long, default_value_t = 20_000)]
    calls: u64,
    /// Run seeds until this many seconds have passed.
    #[arg(long)]
    seconds: Option<f64>,
    /// Worker threads sharing the seed's caches (at least 1).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Caches a seed shares among its workers (at least 1).
    #[arg(long, default_value_t = 4)]
    caches: usize,
    /// Seconds a call may take before it is reported as a deadlock.
    #[arg(long, default_value_t = 20.0)]
    watchdog: f64,
    /// marconi_cache_check of the caches every Nth step of a worker (0:
    /// only at the end of a seed).
    #[arg(long, default_value_t = 1)]
    check_every: u64,
    /// Stop at this many findings.
    #[arg(long, default_value_t = 20)]
    max_findings: usize,
    /// Tiered cache lives only.
    #[arg(long)]
    only_tiered: bool,
    /// Print each cache's figures at the end of a seed.
    #[arg(long)]
    verbose: bool,
    /// When `--seconds` ends: a seed's workers stop there too (a seed of
    /// tiered lives runs a whole life per call and could take minutes).
    #[arg(skip)]
    deadline: Option<Instant>,
}

fn run_seed(a: &Args, seed: u64, watch: &Arc<Watch>) -> (u64, Vec<Finding>) {
    let mut rng = Rng::new(seed);
    let mut caches = Vec::new();
    for i in 0..a.caches {
        if let Some(c) = Run::new_cache(&mut rng, i, seed) {
            caches.push(c);
        }
    }
    let run = Run {
        seed,
        strict: a.threads == 1,
        caches,
        dead_leases: Mutex::new(Vec::new()),
        findings: Mutex::new(Vec::new()),
        calls: AtomicU64::new(0),
        watch: Arc::clone(watch),
        check_every: a.check_every,
        only_tiered: a.only_tiered,
    };
    let per_worker = a.calls / a.threads as u64;
    std::thread::scope(|s| {
        for w in 0..a.threads {
            let run = &run;
            let max = a.max_findings;
            s.spawn(move || {
                let n = run.caches.len();
                let mut wk = Worker {
                    run,
                    w,
                    rng: Rng::new(seed.wrapping_mul(0x100_0193).wrapping_add(w as u64)),
                    via: Rng::new(seed.wrapping_mul(0x100_0193).wrapping_add(w as u64) ^ VIA_SALT),
                    call: 0,
                    leases: Vec::new(),
                    free_pages: vec![Vec::new(); n],
                    free_slots: vec![Vec::new(); n],
                    cur_cache: None,
                    steps: 0,
                };
                while wk.call < per_worker && a.deadline.is_none_or(|d| Instant::now() < d) {
                    wk.step();
                    if run.findings.lock().unwrap().len() >= max {
                        break;
                    }
                }
                // Leave nothing leased.
                for lr in std::mem::take(&mut wk.leases) {
                    let h = wk.h(lr.cache);
                    // SAFETY: live handle.
                    let st = wk.call("release", || unsafe { marconi_cache_release(h, lr.id) });
                    wk.cur_cache = Some(lr.cache);
                    wk.expect("final release", st, &[St::Ok]);
                }
            });
        }
    });
    // Final checks, then free.
    let mut closer = Worker {
        run: &run,
        w: 0,
        rng: Rng::new(seed),
        via: Rng::new(seed ^ VIA_SALT),
        call: run.calls.load(Ordering::Relaxed),
        leases: Vec::new(),
        free_pages: vec![Vec::new(); run.caches.len()],
        free_slots: vec![Vec::new(); run.caches.len()],
        cur_cache: None,
        steps: 0,
    };
    for c in 0..run.caches.len() {
        if run.caches[c].poisoned.load(Ordering::Relaxed) {
            continue;
        }
        closer.cur_cache = Some(c);
        closer.check_cache(c);
        if let Some(s) = closer.check_stats(c) {
            if a.verbose {
                println!(
                    "seed {seed} cache {c} {:?}: {} requests, {} hits, {} evictions, {} tuning rounds, alpha {}, {} states, {} nodes, used {} of {}",
                    run.caches[c].shape, s.requests, s.hit_requests, s.evictions, s.tuning_rounds, s.alpha, s.states, s.nodes, s.used_bytes, s.capacity_bytes
                );
            }
            if s.leases != 0 || s.evictable_bytes != s.used_bytes {
                finding!(
                    closer,
                    "all leases released, yet {} leases / evictable {} of {}",
                    s.leases,
                    s.evictable_bytes,
                    s.used_bytes
                );
            }
        }
    }
    for m in &run.caches {
        // SAFETY: no worker uses the cache any more; freed once.
        unsafe { marconi_cache_free(m.handle.0) };
    }
    let calls = run.calls.load(Ordering::Relaxed);
    (calls, run.findings.into_inner().unwrap())
}

fn main() {
    let mut a = <Args as clap::Parser>::parse();
    a.threads = a.threads.max(1);
    a.caches = a.caches.max(1);
    let watch = Arc::new(Watch {
        t0: Instant::now(),
        beats: (0..a.threads)
            .map(|_| Beat {
                started_ms: AtomicU64::new(0),
                call: AtomicU64::new(0),
                seed: AtomicU64::new(0),
                what: Mutex::new(""),
            })
            .collect(),
        limit: Duration::from_secs_f64(a.watchdog),
        done: AtomicBool::new(false),
    });
    let dog = watch.spawn();
    let t0 = Instant::now();
    a.deadline = a.seconds.map(|t| t0 + Duration::from_secs_f64(t));
    let (mut calls, mut seeds) = (0u64, 0u64);
    let mut findings = Vec::new();
    let mut seed = a.seed;
    loop {
        let done = match a.seconds {
            Some(t) => t0.elapsed().as_secs_f64() >= t,
            None => seeds >= a.seeds,
        };
        if done || findings.len() >= a.max_findings {
            break;
        }
        let (c, f) = run_seed(&a, seed, &watch);
        calls += c;
        seeds += 1;
        findings.extend(f);
        seed += 1;
    }
    watch.done.store(true, Ordering::Release);
    let _ = dog.join();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "fuzz_abi: {calls} calls, {seeds} seeds ({}..={}), {} thread(s), {:.1} s ({:.0} calls/s), findings: {}",
        a.seed,
        a.seed + seeds.saturating_sub(1),
        a.threads,
        secs,
        calls as f64 / secs.max(1e-9),
        findings.len()
    );
    println!(
        "fuzz_abi: tiered cache lives served {} requests (ops replayed, copies checked after each), {} through the one cache handle (int64 lookups, flags, device views, events)",
        TIERED_REQUESTS.load(Ordering::Relaxed),
        ONE_HANDLE_REQUESTS.load(Ordering::Relaxed)
    );
    let pt: Vec<u64> = POOLED_TIERS
        .iter()
        .map(|a| a.load(Ordering::Relaxed))
        .collect();
    println!(
        "fuzz_abi: caches over pools with tiers served {} requests ({} device hits checked, {} lower-tier hits loaded, {} host writes, {} store writes, {} drops; every op carried out)",
        pt[0], pt[5], pt[1], pt[2], pt[3], pt[4]
    );
    println!(
        "fuzz_abi: through the one lookup, admit and drain (marconi_cache_*_with): {} lookups, {} admits, {} drains ({} over pools)",
        VIA_WITH[0].load(Ordering::Relaxed),
        VIA_WITH[1].load(Ordering::Relaxed),
        VIA_WITH[2].load(Ordering::Relaxed),
        VIA_WITH[3].load(Ordering::Relaxed)
    );
    if let Some(f) = findings.first() {
        eprintln!(
            "fuzz_abi: first finding: seed {} worker {} call #{} cache {:?}: {}\n  reproduce: --seed {} --calls {} --threads {}",
            f.seed,
            f.worker,
            f.call,
            f.cache,
            f.text,
            f.seed,
            f.call + 1,
            a.threads
        );
        std::process::exit(1);
    }
}
