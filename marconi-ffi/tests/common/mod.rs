//! Set-up and checks the C ABI integration tests share: the last error, a
//! status check that prints it, structs from their `*_init` call and
//! versioned output structs, the paper-7b device configuration, cache and
//! store constructors, stats readers, the admits over every kind of id,
//! the drains (freed ids, tier ops, marconi_cache_drain_with's buffers),
//! the states of a cache over pools and what an admission left to the
//! caller, and a page no call may read.
//!
//! Cargo builds this module into every test binary that declares
//! `mod common;`, and the fuzzers (examples/fuzz_abi.rs, fuzz_readers.rs)
//! include it by path; each uses only some of it.
#![allow(dead_code)]

use std::ffi::CString;
use std::mem::{size_of, MaybeUninit};
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::status::marconi_status;
use marconi::store::*;

/// The calling thread's last error message.
pub(crate) fn last_error() -> String {
    let mut buf = vec![0u8; 1024];
    // SAFETY: buf has 1024 writable bytes.
    let n = unsafe { marconi::marconi_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    String::from_utf8_lossy(&buf[..n.min(buf.len() - 1)]).into_owned()
}

/// `s` is MARCONI_STATUS_OK; else the last error is the panic message.
pub(crate) fn ok(s: marconi_status) {
    assert_eq!(s, marconi_status::Ok, "{}", last_error());
}

/// `s` is `want` and the last error names every one of `words`; `what`
/// says which call it was.
pub(crate) fn refusal(s: marconi_status, want: marconi_status, what: &str, words: &[&str]) {
    assert_eq!(s, want, "{what}: {}", last_error());
    let e = last_error();
    for w in words {
        assert!(e.contains(w), "{what}: {w:?} not in {e:?}");
    }
}

/// `s` is MARCONI_STATUS_UNSUPPORTED and the last error names every one
/// of `words`.
pub(crate) fn unsupported(s: marconi_status, words: &[&str]) {
    refusal(s, marconi_status::Unsupported, "", words);
}

/// A pointer that is no handle of the kind asked for (`what` says which
/// pointer) refused with INVALID_ARGUMENT, the last error naming `word`.
pub(crate) fn not_a_handle(s: marconi_status, what: &str, word: &str) {
    refusal(s, marconi_status::InvalidArgument, what, &[word]);
}

/// A struct as its `*_init` call fills it at its full size.
pub(crate) fn init<T>(f: unsafe extern "C" fn(*mut T, usize) -> marconi_status) -> T {
    let mut v = MaybeUninit::<T>::uninit();
    // SAFETY: v has sizeof(T) writable bytes.
    ok(unsafe { f(v.as_mut_ptr(), size_of::<T>()) });
    // SAFETY: the init call succeeded: every field is set.
    unsafe { v.assume_init() }
}

/// Bytes of one chain of `tokens` tokens of the paper-7b preset.
pub(crate) fn chain(tokens: u64) -> u64 {
    let m = marconi_core::ModelSpec::preset("paper-7b").unwrap();
    tokens * m.kv_bytes_per_token() + m.state_bytes()
}

/// The default cache configuration with room for `tokens` tokens of one
/// paper-7b chain and a deterministic tuner.
pub(crate) fn device_config(tokens: u64) -> marconi_cache_config {
    let mut cfg = init(marconi_cache_config_init);
    cfg.capacity_bytes = chain(tokens);
    cfg.tuner_adoption = marconi_alpha_adoption::Deterministic as u32;
    cfg
}

/// A cache of `cfg`.
pub(crate) fn new_cache(cfg: &marconi_cache_config) -> *mut marconi_cache {
    let mut c = ptr::null_mut();
    // SAFETY: valid config and out pointer.
    ok(unsafe { marconi_cache_new(cfg, &mut c) });
    c
}

/// A versioned output struct (stats, plans, results): zeroed with its
/// struct_size set to its full size, as the call that fills it wants.
pub(crate) trait Versioned: Default {
    fn versioned() -> Self;
}

macro_rules! versioned {
    ($($t:ty),* $(,)?) => {
        $(impl Versioned for $t {
            fn versioned() -> Self {
                Self {
                    struct_size: size_of::<$t>() as u32,
                    ..Default::default()
                }
            }
        })*
    };
}

versioned!(
    marconi_stats,
    marconi::host_pool::marconi_host_pool_stats,
    marconi::lookup::marconi_lookup_result,
    marconi::plan::marconi_memory_plan,
    marconi::pml_cache::marconi_pml_cache_stats,
    marconi::pool::marconi_pool_stats,
    marconi::pooled::marconi_pooled_stats,
    marconi::store::marconi_store_stats,
    marconi::tiered::marconi_tiered_stats,
);

/// A `T` as its versioned call wants it.
pub(crate) fn versioned<T: Versioned>() -> T {
    T::versioned()
}

/// The stats `S` of the live handle `h` as `get` writes them, checked.
pub(crate) fn stats_by<H, S: Versioned>(
    get: unsafe extern "C" fn(*const H, *mut S) -> marconi_status,
    h: *const H,
) -> S {
    let mut s = S::versioned();
    // SAFETY: a live handle, a writable struct of its struct_size.
    ok(unsafe { get(h, &mut s) });
    s
}

/// The end of a cache's life in a test: marconi_cache_check passes on
/// each of `caches`, then each is freed.
pub(crate) fn check_and_free(caches: &[*mut marconi_cache]) {
    for &c in caches {
        // SAFETY: a live handle, freed once.
        unsafe {
            ok(marconi_cache_check(c));
            marconi_cache_free(c);
        }
    }
}

/// The stats of a live cache.
pub(crate) fn cache_stats(c: *const marconi_cache) -> marconi_stats {
    stats_by(marconi_cache_stats, c)
}

/// The pool stats of a live cache over pools.
pub(crate) fn pool_stats(c: *const marconi_cache) -> marconi::pooled::marconi_pooled_stats {
    stats_by(marconi::pooled::marconi_cache_pool_stats, c)
}

/// The tier stats of a live cache with tiers.
pub(crate) fn tier_stats(c: *const marconi_cache) -> marconi::tiered::marconi_tiered_stats {
    stats_by(marconi::tiered::marconi_cache_tier_stats, c)
}

/// The units a live cache over pools holds (marconi_cache_held, after a
/// size query).
pub(crate) fn held(c: *const marconi_cache) -> Vec<u64> {
    let mut n = 0usize;
    // SAFETY: live handle; NULL with 0 is a size query.
    let st = unsafe { marconi::pooled::marconi_cache_held(c, ptr::null_mut(), 0, &mut n) };
    assert!(
        st == marconi_status::Ok || st == marconi_status::BufferTooSmall,
        "{}",
        last_error()
    );
    let mut buf = vec![0u64; n];
    // SAFETY: buf has n writable elements.
    ok(unsafe { marconi::pooled::marconi_cache_held(c, buf.as_mut_ptr(), buf.len(), &mut n) });
    buf.truncate(n);
    buf
}

/// The buffer's pointer, NULL where it is empty (a size query).
fn or_null<T>(b: &mut [T]) -> *mut T {
    if b.is_empty() {
        ptr::null_mut()
    } else {
        b.as_mut_ptr()
    }
}

/// A lookup of `tokens` (namespace 0, no slot) that must succeed.
pub(crate) fn lookup(c: *const marconi_cache, tokens: &[u32]) -> marconi_lookup {
    let mut l = marconi_lookup::default();
    // SAFETY: tokens readable for its length, l writable.
    ok(unsafe {
        marconi_cache_lookup(c, 0, tokens.as_ptr(), tokens.len(), MARCONI_NO_SLOT, &mut l)
    });
    l
}

/// The C signature the admits over a handle `H` share (marconi_cache_admit,
/// _admit_i64, _admit_pooled, marconi_tiered_admit): the lease, then
/// tokens of `T`, states of `S` and pages of `P` each with its length, the
/// taken flags and the result.
pub(crate) type AdmitFn<H, T, S, P> = unsafe extern "C" fn(
    *const H,
    u64,
    *const T,
    usize,
    *const S,
    usize,
    *const P,
    usize,
    *mut u8,
    *mut marconi_admit_result,
) -> marconi_status;

/// `admit` of `tokens` with `states` and `pages` (NULL with 0 when None)
/// on `lease` of `h`, the taken flags into `taken` (NULL when None, else a
/// byte a state at least), the result into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn admit_by<H, T, S, P>(
    admit: AdmitFn<H, T, S, P>,
    h: *const H,
    lease: u64,
    tokens: &[T],
    states: &[S],
    pages: Option<&[P]>,
    taken: Option<&mut [u8]>,
    out: &mut marconi_admit_result,
) -> marconi_status {
    if let Some(t) = &taken {
        assert!(t.len() >= states.len(), "a taken flag a state");
    }
    let (p, np) = pages.map_or((ptr::null(), 0), |p| (p.as_ptr(), p.len()));
    let taken = taken.map_or(ptr::null_mut(), |t| t.as_mut_ptr());
    // SAFETY: every array readable for its length, taken NULL or writable
    // for a byte a state.
    unsafe {
        admit(
            h,
            lease,
            tokens.as_ptr(),
            tokens.len(),
            states.as_ptr(),
            states.len(),
            p,
            np,
            taken,
            out,
        )
    }
}

/// marconi_cache_admit of `tokens` with `states` and `pages` on `lease`,
/// the taken flags into `taken` (NULL where empty), the result into `out`.
pub(crate) fn admit(
    c: *const marconi_cache,
    lease: u64,
    tokens: &[u32],
    states: &[marconi_saved_state],
    pages: &[u32],
    taken: &mut [u8],
    out: &mut marconi_admit_result,
) -> marconi_status {
    let taken = (!taken.is_empty()).then_some(taken);
    admit_by(
        marconi_cache_admit,
        c,
        lease,
        tokens,
        states,
        Some(pages),
        taken,
        out,
    )
}

/// marconi_cache_admit_i64 of `tokens` with `states` and `pages` on
/// `lease`, the taken flags into `taken` (NULL when None), the result
/// into `out`.
pub(crate) fn admit_i64(
    c: *const marconi_cache,
    lease: u64,
    tokens: &[i64],
    states: &[marconi_saved_state],
    pages: &[i64],
    taken: Option<&mut [u8]>,
    out: &mut marconi_admit_result,
) -> marconi_status {
    let f = marconi_cache_admit_i64;
    admit_by(f, c, lease, tokens, states, Some(pages), taken, out)
}

/// marconi_cache_admit_pooled of `tokens` with `states` and the page
/// handles `pages` on `lease`, the taken flags into `taken`, the result
/// into `out`.
pub(crate) fn pooled_admit(
    c: *const marconi_cache,
    lease: u64,
    tokens: &[u32],
    states: &[marconi::pooled::marconi_pooled_state],
    pages: &[u64],
    taken: &mut [u8],
    out: &mut marconi_admit_result,
) -> marconi_status {
    let f = marconi::pooled::marconi_cache_admit_pooled;
    admit_by(f, c, lease, tokens, states, Some(pages), Some(taken), out)
}

/// The C signature the drains into two buffers share over a handle `H`
/// (marconi_cache_drain_freed, marconi_cache_drain_ops and their
/// marconi_tiered_* twins): each buffer of `A` and `B` with its capacity
/// and the count written or pending.
pub(crate) type DrainTwo<H, A, B> = unsafe extern "C" fn(
    *const H,
    *mut A,
    usize,
    *mut usize,
    *mut B,
    usize,
    *mut usize,
) -> marconi_status;

/// A drain of `h` by `drain` into `a` and `b` (NULL where empty):
/// (status, written or pending into `a`, into `b`).
pub(crate) fn drain_two<H, A, B>(
    drain: DrainTwo<H, A, B>,
    h: *const H,
    a: &mut [A],
    b: &mut [B],
) -> (marconi_status, usize, usize) {
    let (pa, pb) = (or_null(a), or_null(b));
    let (mut na, mut nb) = (0usize, 0usize);
    // SAFETY: each buffer is NULL with capacity 0 or holds its length.
    let st = unsafe { drain(h, pa, a.len(), &mut na, pb, b.len(), &mut nb) };
    (st, na, nb)
}

/// The C signature of marconi_cache_drain_freed and
/// marconi_tiered_drain_freed over a handle `H`.
pub(crate) type DrainFreed<H> = DrainTwo<H, u32, u32>;

/// A drain of the freed pages and slots of `h` by `drain` into `pages`
/// and `slots` (NULL where empty): (status, pages written or pending,
/// slots written or pending).
pub(crate) fn drain_freed_by<H>(
    drain: DrainFreed<H>,
    h: *const H,
    pages: &mut [u32],
    slots: &mut [u32],
) -> (marconi_status, usize, usize) {
    drain_two(drain, h, pages, slots)
}

/// marconi_cache_drain_freed into `pages` and `slots` (NULL where empty):
/// (status, pages written or pending, slots written or pending).
pub(crate) fn drain_freed(
    c: *const marconi_cache,
    pages: &mut [u32],
    slots: &mut [u32],
) -> (marconi_status, usize, usize) {
    drain_freed_by(marconi_cache_drain_freed, c, pages, slots)
}

/// The C signature of marconi_cache_drain_ops and marconi_tiered_drain_ops
/// over a handle `H`.
pub(crate) type DrainOps<H> = DrainTwo<H, marconi::tiered::marconi_tier_op, u32>;

/// A drain of the tier ops of `h` by `drain` into `ops` and `toks` (NULL
/// where empty): (status, ops written or pending, tokens written or
/// pending).
pub(crate) fn drain_tier_ops<H>(
    drain: DrainOps<H>,
    h: *const H,
    ops: &mut [marconi::tiered::marconi_tier_op],
    toks: &mut [u32],
) -> (marconi_status, usize, usize) {
    drain_two(drain, h, ops, toks)
}

/// The buffers of a marconi_cache_drain_with call (see drain_buffers).
pub(crate) struct DrainBuffers {
    pub(crate) ops: Vec<marconi::tiered::marconi_tier_op>,
    pub(crate) toks: Vec<u32>,
    pub(crate) pages: Vec<u64>,
    pub(crate) slots: Vec<u64>,
}

/// Buffers for what the size query in `d` counted and `extra` more of
/// each (`extra * 64` more op tokens), their pointers and capacities set
/// in `d`; `d` points into them while they live (moving them keeps their
/// heap memory in place).
pub(crate) fn drain_buffers(d: &mut marconi::cycle::marconi_drain, extra: usize) -> DrainBuffers {
    let mut b = DrainBuffers {
        ops: vec![Default::default(); d.n_ops + extra],
        toks: vec![0u32; d.n_op_tokens + extra * 64],
        pages: vec![0u64; d.n_kv_pages + extra],
        slots: vec![0u64; d.n_state_slots + extra],
    };
    d.ops = b.ops.as_mut_ptr();
    d.ops_cap = b.ops.len();
    d.op_tokens = b.toks.as_mut_ptr();
    d.op_tokens_cap = b.toks.len();
    d.kv_pages = b.pages.as_mut_ptr();
    d.kv_pages_cap = b.pages.len();
    d.state_slots = b.slots.as_mut_ptr();
    d.state_slots_cap = b.slots.len();
    b
}

/// Every pending tier op of `h` drained by `drain`, after a size query
/// whose counts the drain must write: (op, its chain's tokens).
pub(crate) fn drain_all_tier_ops<H>(
    drain: DrainOps<H>,
    h: *const H,
) -> Vec<(marconi::tiered::marconi_tier_op, Vec<u32>)> {
    let (st, no, nt) = drain_tier_ops(drain, h, &mut [], &mut []);
    if no == 0 {
        ok(st);
        return Vec::new();
    }
    assert_eq!(st, marconi_status::BufferTooSmall, "{}", last_error());
    let mut ops = vec![marconi::tiered::marconi_tier_op::default(); no];
    let mut toks = vec![0u32; nt];
    let (st, wo, wt) = drain_tier_ops(drain, h, &mut ops, &mut toks);
    ok(st);
    assert_eq!((wo, wt), (no, nt), "the size query's counts");
    ops.into_iter()
        .map(|o| {
            let s = o.tokens_offset as usize;
            (o, toks[s..s + o.position as usize].to_vec())
        })
        .collect()
}

/// A store of `backend` at `location` for `model`, blocks of 16 tokens,
/// `timeout_ms` for every call and `connect_timeout_ms` (None: the
/// default) for connecting.
pub(crate) fn store_at(
    backend: marconi_store_backend,
    location: &str,
    model: &str,
    timeout_ms: u32,
    connect_timeout_ms: Option<u32>,
) -> *mut marconi_store {
    let mut cfg = init(marconi_store_config_init);
    let loc = CString::new(location).unwrap();
    let model = CString::new(model).unwrap();
    cfg.backend = backend as u32;
    cfg.location = loc.as_ptr();
    cfg.model = model.as_ptr();
    cfg.block_size = 16;
    cfg.timeout_ms = timeout_ms;
    if let Some(ms) = connect_timeout_ms {
        cfg.connect_timeout_ms = ms;
    }
    let mut s = ptr::null_mut();
    // SAFETY: valid config and out; the strings live during the call.
    ok(unsafe { marconi_store_new(&cfg, &mut s) });
    s
}

/// Saved states at `positions` in `slots`, pairwise.
pub(crate) fn states(positions: &[u32], slots: &[u32]) -> Vec<marconi_saved_state> {
    positions
        .iter()
        .zip(slots)
        .map(|(&position, &slot)| marconi_saved_state { position, slot })
        .collect()
}

/// States of a cache over pools at `positions` in the state units
/// `handles`, pairwise.
pub(crate) fn pooled_states(
    positions: &[u32],
    handles: &[u64],
) -> Vec<marconi::pooled::marconi_pooled_state> {
    positions
        .iter()
        .zip(handles)
        .map(
            |(&position, &state_handle)| marconi::pooled::marconi_pooled_state {
                position,
                reserved: 0,
                state_handle,
            },
        )
        .collect()
}

/// The caller's units a cache over pools did not take in `r` (what the
/// caller frees): the pages past the `n_hit` hit ones outside the taken
/// range, and the units of the states whose `taken` flag is 0.
pub(crate) fn untaken(
    pages: &[u64],
    n_hit: usize,
    r: &marconi_admit_result,
    states: &[marconi::pooled::marconi_pooled_state],
    taken: &[u8],
) -> Vec<u64> {
    let range = r.kv_pages_taken_start as usize..r.kv_pages_taken_end as usize;
    let mut mine: Vec<u64> = (n_hit..pages.len())
        .filter(|i| !range.contains(i))
        .map(|i| pages[i])
        .collect();
    mine.extend(
        states
            .iter()
            .zip(taken)
            .filter(|(_, &t)| t == 0)
            .map(|(s, _)| s.state_handle),
    );
    mine
}

/// One page mapped with no access: a read through it kills the process.
/// Unmapped on drop.
pub(crate) struct NoAccessPage(*mut libc::c_void);

impl NoAccessPage {
    pub(crate) fn new() -> Self {
        // SAFETY: a fresh anonymous mapping with no access.
        let page = unsafe {
            libc::mmap(
                ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        NoAccessPage(page)
    }

    pub(crate) fn ptr<T>(&self) -> *mut T {
        self.0.cast()
    }
}

impl Drop for NoAccessPage {
    fn drop(&mut self) {
        // SAFETY: mapped in new; no pointer into it is used after this.
        let r = unsafe { libc::munmap(self.0, 4096) };
        if !std::thread::panicking() {
            assert_eq!(r, 0);
        }
    }
}

/// An empty text segment, to fill a layout's output buffer.
pub(crate) fn blank_segment() -> marconi::pml::marconi_pml_segment {
    marconi::pml::marconi_pml_segment {
        kind: marconi::pml::marconi_pml_segment_kind::Text,
        cached: false,
        start: 0,
        len: 0,
        module: 0,
        param: 0,
        tokens_offset: 0,
    }
}

/// marconi_pml_layout of `xml` on a live schema, tokenized by `tok`, into
/// `segs` and `toks` (truncated to what was written), the error into
/// `err` (may be NULL).
pub(crate) fn pml_layout(
    s: *const marconi::pml::marconi_pml_schema,
    xml: &str,
    tok: marconi::pml::marconi_pml_tokenize_fn,
    segs: &mut Vec<marconi::pml::marconi_pml_segment>,
    toks: &mut Vec<u32>,
    err: *mut marconi::pml::marconi_pml_error,
) -> marconi_status {
    let (mut ns, mut nt) = (0usize, 0usize);
    // SAFETY: buffers of the capacities given; err is NULL or writable.
    let st = unsafe {
        marconi::pml::marconi_pml_layout(
            s,
            xml.as_ptr(),
            xml.len(),
            tok,
            ptr::null_mut(),
            segs.as_mut_ptr(),
            segs.len(),
            &mut ns,
            toks.as_mut_ptr(),
            toks.len(),
            &mut nt,
            err,
        )
    };
    if st == marconi_status::Ok {
        segs.truncate(ns);
        toks.truncate(nt);
    }
    st
}

/// marconi_cache_lookup_with of `tokens` in namespace `ns` (as int64 ids
/// with `wide`), with `hints`, `flags` and the request's slot `dst_slot`:
/// (status, result).
pub(crate) fn lookup_with(
    c: *const marconi_cache,
    ns: u64,
    (tokens, wide): (&[u32], bool),
    hints: &[u32],
    flags: u32,
    dst_slot: u32,
) -> (marconi_status, marconi::lookup::marconi_lookup_result) {
    use marconi::lookup::*;
    let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    let mut q = init(marconi_lookup_request_init);
    q.ns = ns;
    if wide {
        q.token_width = marconi_id_width::I64 as u32;
        q.tokens = ids.as_ptr().cast();
    } else {
        q.tokens = tokens.as_ptr().cast();
    }
    q.n_tokens = tokens.len();
    if !hints.is_empty() {
        q.checkpoints = hints.as_ptr();
        q.n_checkpoints = hints.len();
    }
    q.flags = flags;
    q.dst_slot = dst_slot;
    let mut out = marconi_lookup_result {
        struct_size: size_of::<marconi_lookup_result>() as u32,
        ..Default::default()
    };
    // SAFETY: q's arrays live for the call; out is writable.
    let st = unsafe { marconi_cache_lookup_with(c, &q, &mut out) };
    (st, out)
}

/// marconi_cache_admit_with of `tokens` (int64 with a `wide` width) under
/// `lease`, the states as (position, unit) and the pages as 64-bit values
/// passed with `page_width` (MARCONI_ID_WIDTH_U32 / _I64 narrowed here,
/// _U64 as they are); `taken` NULL when None.
#[allow(clippy::too_many_arguments)]
pub(crate) fn admit_with(
    c: *const marconi_cache,
    lease: u64,
    (tokens, wide): (&[u32], bool),
    states: &[(u32, u64)],
    pages: &[u64],
    page_width: u32,
    taken: Option<&mut [u8]>,
    out: &mut marconi_admit_result,
) -> marconi_status {
    use marconi::cycle::*;
    let units: Vec<marconi_admit_state> = states
        .iter()
        .map(|&(position, unit)| marconi_admit_state {
            position,
            reserved: 0,
            unit,
        })
        .collect();
    let t64: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    let p32: Vec<u32> = pages.iter().map(|&p| p as u32).collect();
    let p64: Vec<i64> = pages.iter().map(|&p| p as i64).collect();
    let mut q = init(marconi_admit_request_init);
    q.lease = lease;
    if wide {
        q.token_width = marconi::lookup::marconi_id_width::I64 as u32;
        q.tokens = t64.as_ptr().cast();
    } else {
        q.tokens = tokens.as_ptr().cast();
    }
    q.n_tokens = tokens.len();
    q.states = units.as_ptr();
    q.n_states = units.len();
    q.page_width = page_width;
    q.kv_pages = match page_width {
        0 => p32.as_ptr().cast(),
        1 => p64.as_ptr().cast(),
        _ => pages.as_ptr().cast(),
    };
    q.n_kv_pages = pages.len();
    q.taken = taken.map_or(ptr::null_mut(), |t| t.as_mut_ptr());
    // SAFETY: q's arrays live for the call; taken has n_states bytes; out
    // is writable.
    unsafe { marconi_cache_admit_with(c, &q, out) }
}
