//! Cache events through the C ABI (docs/events.md): an events handle turns
//! a cache's event stream on and hands it out as encoded vLLM
//! `KVEventBatch`es (msgpack), for an engine that publishes them itself, or
//! publishes them with the ZeroMQ framing of vLLM's publisher (builds with
//! the `publisher` feature; other builds refuse with a clear status).

use std::ffi::{c_char, CStr};
use std::sync::{Mutex, MutexGuard};

use ::marconi_events::{Encoder, EncoderConfig, HashFormat, Layout, Namespaces, WireOptions};

use crate::cache::{handle, marconi_cache};
use crate::handle::{borrow, handle_kind, publish, release};
use crate::status::{
    boundary, boundary_or, check_ptr, init_struct, marconi_status, out_slice, read_struct, require,
    versioned, FfiError, FfiResult,
};

/// The sequence number marconi_events_publish writes when it published
/// nothing (no change since the last call).
pub const MARCONI_NO_SEQ: u64 = u64::MAX;

/// How block hashes are written (vLLM's `ExternalBlockHash`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_hash_format {
    /// The last 8 bytes of the SHA-256 digest as an unsigned integer
    /// (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
    Int = 0,
    /// The 32-byte digest as msgpack bin.
    Bytes = 1,
}

/// How events are laid out in a batch.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_event_layout {
    /// Tagged maps (vLLM after PR #42892).
    Map = 0,
    /// Tagged arrays with every field (earlier vLLM).
    Array = 1,
}

/// How a cache namespace n != 0 is published (docs/events.md §2).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_event_namespaces {
    /// As vLLM's cache_salt "n": the first block of a chain is hashed with
    /// (("cache_salt", "n"),) and published with extra_keys ["n"].
    CacheSalt = 0,
    /// As vLLM's LoRA adapter named "n" (empty path): every block is
    /// hashed with (("lora", "n", ""),), lora_name "n".
    Lora = 1,
    /// The earlier form: every block has the extra keys (n), an array
    /// holding the integer n.
    ExtraKeys = 2,
}

/// Configuration of an events handle. Versioned by size: fill it with
/// marconi_events_config_init(&cfg, sizeof cfg), then set fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_events_config {
    /// sizeof(marconi_events_config) as the caller compiled it.
    pub struct_size: u32,
    /// Non-zero: publish recurrent-state events (group 1, kind "mamba").
    /// Default 1; 0 for consumers that ignore group_idx.
    pub states: u32,
    /// A marconi_hash_format value. Default MARCONI_HASH_FORMAT_INT.
    pub hash_format: u32,
    /// A marconi_event_layout value. Default MARCONI_EVENT_LAYOUT_MAP.
    pub layout: u32,
    /// NUL-terminated seed of NONE_HASH (vLLM's PYTHONHASHSEED), or NULL
    /// for vLLM's default "vllm-none-hash". Read only during
    /// marconi_events_new.
    pub seed: *const c_char,
    /// NUL-terminated medium string, or NULL for "GPU".
    pub medium: *const c_char,
    /// The batches' data_parallel_rank. Default 0.
    pub data_parallel_rank: i64,
    /// Publisher only: NUL-terminated PUB endpoint, e.g.
    /// "tcp://127.0.0.1:5557" (bound when it has '*' or "::" or is ipc:// or
    /// inproc://, else connected), or NULL for no publisher (drain only).
    pub endpoint: *const c_char,
    /// Publisher only: NUL-terminated ROUTER endpoint for replay (bound), or
    /// NULL for no replay.
    pub replay_endpoint: *const c_char,
    /// Publisher only: NUL-terminated topic, or NULL for the empty topic.
    pub topic: *const c_char,
    /// Publisher only: batches kept for replay. Default 10000.
    pub buffer_steps: u64,
    /// Publisher only: PUB high-water mark. Default 100000.
    pub hwm: i32,
    /// Publisher only: batches queued to the publisher thread before
    /// marconi_events_publish drops one (MARCONI_STATUS_QUEUE_FULL).
    /// Default 100000.
    pub max_queue: i32,
    /// Publisher only: non-zero: replay replies carry the topic frame
    /// ([topic, seq, payload], vLLM after PR #45177); 0: [seq, payload].
    /// Default 1.
    pub replay_topic: u32,
    /// A marconi_event_namespaces value: how a cache namespace n != 0
    /// enters the hashes and extra_keys. Default (0)
    /// MARCONI_EVENT_NAMESPACES_CACHE_SALT, vLLM's cache_salt "n".
    pub namespaces: u32,
}
versioned!(marconi_events_config, CONFIG_MIN_SIZE);

impl marconi_events_config {
    fn defaults() -> Self {
        marconi_events_config {
            struct_size: std::mem::size_of::<marconi_events_config>() as u32,
            states: 1,
            hash_format: marconi_hash_format::Int as u32,
            layout: marconi_event_layout::Map as u32,
            seed: std::ptr::null(),
            medium: std::ptr::null(),
            data_parallel_rank: 0,
            endpoint: std::ptr::null(),
            replay_endpoint: std::ptr::null(),
            topic: std::ptr::null(),
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue: 100_000,
            replay_topic: 1,
            namespaces: marconi_event_namespaces::CacheSalt as u32,
        }
    }
}

/// An events handle: opaque to C. Create with marconi_events_new, free with
/// marconi_events_free.
pub struct marconi_events {
    inner: Mutex<Inner>,
}
handle_kind!(marconi_events, Events, "marconi_events");

struct Inner {
    enc: Encoder,
    block_size: u32,
    /// An encoded batch a too-small buffer could not take yet.
    pending: Option<Vec<u8>>,
    #[cfg(feature = "publisher")]
    publisher: Option<::marconi_events::Publisher>,
}

impl marconi_events {
    fn lock(&self) -> FfiResult<MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| {
            FfiError::new(
                marconi_status::Poisoned,
                "the events handle is unusable after an earlier internal panic",
            )
        })
    }
}

/// # Safety
///
/// `events` is NULL or a live handle from marconi_events_new.
unsafe fn events_handle<'a>(events: *const marconi_events) -> FfiResult<&'a marconi_events> {
    // SAFETY: the registry check reads nothing behind the pointer.
    unsafe { borrow(events, "events") }
}

/// # Safety
///
/// `p` is NULL or a NUL-terminated string.
unsafe fn opt_str(p: *const c_char, what: &str) -> FfiResult<Option<String>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(|s| Some(s.to_owned())).map_err(|_| {
        FfiError::new(
            marconi_status::InvalidConfig,
            format!("{what} is not UTF-8"),
        )
    })
}

fn check_ts(ts: f64) -> FfiResult {
    if ts.is_finite() {
        Ok(())
    } else {
        Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("ts {ts} is not a finite number of seconds"),
        ))
    }
}

/// The first version's size of marconi_events_config (every field of this one: none was
/// added since).
const CONFIG_MIN_SIZE: usize = std::mem::size_of::<marconi_events_config>();

/// Fills `*cfg` with the defaults (documented per field) and sets
/// `cfg->struct_size`: any size from the first version's on (an older
/// caller's struct gets the fields it has). MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE
/// when struct_size is smaller than the first version's.
#[no_mangle]
pub unsafe extern "C" fn marconi_events_config_init(
    cfg: *mut marconi_events_config,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: cfg is NULL or has struct_size writable bytes (contract).
    boundary("marconi_events_config_init", || unsafe {
        init_struct(cfg, struct_size, "cfg")
    })
}

/// Creates an events handle for `cache` and writes it to `*out` (free it
/// with marconi_events_free). Turns the cache's event stream on: the first
/// batch starts with AllBlocksCleared and the cache's current content, so a
/// subscriber that starts from it rebuilds the cache exactly. Blocks are the
/// cache's pages (block_size = page_size). Use one events handle per cache:
/// each change goes to the handle that drains it first.
///
/// With `cfg->endpoint` set, also starts a ZeroMQ publisher (a background
/// thread owning a PUB and, with `cfg->replay_endpoint`, a ROUTER socket);
/// MARCONI_STATUS_INVALID_CONFIG when the endpoint cannot be bound or
/// connected, or when this library was built without the publisher
/// (marconi_events_has_publisher() returns 0). Every kind of cache
/// publishes: over ids the engine owns, over the library's pools
/// (marconi_cache_config.pools; events name tokens, never units), and with
/// lower tiers (the device tier's changes).
#[no_mangle]
pub unsafe extern "C" fn marconi_events_new(
    cache: *const marconi_cache,
    cfg: *const marconi_events_config,
    out: *mut *mut marconi_events,
) -> marconi_status {
    boundary("marconi_events_new", || {
        require!(cache);
        require!(cfg);
        require!(out);
        // SAFETY: the caller passes a live handle.
        let h = unsafe { handle(cache) }?;
        check_ptr!(cfg);
        check_ptr!(out);
        // SAFETY: cfg is non-NULL, aligned, initialised by config_init.
        let c = unsafe { read_struct(cfg) }?;
        let namespaces = match c.namespaces {
            0 => Namespaces::CacheSalt,
            1 => Namespaces::Lora,
            2 => Namespaces::ExtraKeys,
            v => {
                return Err(FfiError::new(
                    marconi_status::InvalidConfig,
                    format!("namespaces {v} is not a marconi_event_namespaces"),
                ))
            }
        };
        let hash_format = match c.hash_format {
            0 => HashFormat::Int,
            1 => HashFormat::Bytes,
            v => {
                return Err(FfiError::new(
                    marconi_status::InvalidConfig,
                    format!("hash_format {v} is not a marconi_hash_format"),
                ))
            }
        };
        let layout = match c.layout {
            0 => Layout::Map,
            1 => Layout::Array,
            v => {
                return Err(FfiError::new(
                    marconi_status::InvalidConfig,
                    format!("layout {v} is not a marconi_event_layout"),
                ))
            }
        };
        // SAFETY: the string fields are NULL or NUL-terminated (contract).
        let (seed, medium, endpoint) = unsafe {
            (
                opt_str(c.seed, "seed")?,
                opt_str(c.medium, "medium")?,
                opt_str(c.endpoint, "endpoint")?,
            )
        };
        let block_size = h.page_size()?;
        let mut ecfg = EncoderConfig::new(block_size);
        if let Some(s) = seed {
            ecfg.seed = s;
        }
        ecfg.states = c.states != 0;
        ecfg.wire = WireOptions {
            hash_format,
            layout,
            medium: medium.unwrap_or_else(|| "GPU".into()),
            data_parallel_rank: c.data_parallel_rank,
            namespaces,
        };
        let enc = Encoder::new(ecfg)
            .map_err(|e| FfiError::new(marconi_status::InvalidConfig, e.to_string()))?;
        #[cfg(feature = "publisher")]
        let publisher = match endpoint {
            None => None,
            Some(ep) => {
                // SAFETY: as above.
                let (replay, topic) = unsafe {
                    (
                        opt_str(c.replay_endpoint, "replay_endpoint")?,
                        opt_str(c.topic, "topic")?,
                    )
                };
                let mut pc = ::marconi_events::PublisherConfig::new(&ep, replay.as_deref());
                pc.topic = topic.unwrap_or_default().into_bytes();
                pc.buffer_steps = usize::try_from(c.buffer_steps).unwrap_or(usize::MAX);
                pc.hwm = c.hwm;
                pc.max_queue = c.max_queue;
                pc.replay_topic = c.replay_topic != 0;
                Some(
                    ::marconi_events::Publisher::new(pc)
                        .map_err(|e| FfiError::new(marconi_status::InvalidConfig, e.to_string()))?,
                )
            }
        };
        #[cfg(not(feature = "publisher"))]
        if let Some(ep) = endpoint {
            return Err(FfiError::new(
                marconi_status::InvalidConfig,
                format!("endpoint {ep:?}: this libmarconi was built without the ZeroMQ publisher (cargo feature `publisher` of marconi-ffi); drain batches with marconi_events_drain and publish them yourself"),
            ));
        }
        h.enable_events()?;
        let ev = marconi_events {
            inner: Mutex::new(Inner {
                enc,
                block_size,
                pending: None,
                #[cfg(feature = "publisher")]
                publisher,
            }),
        };
        // SAFETY: out is non-NULL, aligned and writable (checked, contract).
        unsafe { publish(ev, out) };
        Ok(())
    })
}

/// Frees an events handle (NULL is a no-op): stops its publisher after
/// sending what it has queued (within about 50 ms of the queue running
/// empty). `cache` is the handle's cache, whose event stream this turns off
/// (changes would otherwise pile up undrained), or NULL when that cache was
/// freed already.
#[no_mangle]
pub unsafe extern "C" fn marconi_events_free(
    events: *mut marconi_events,
    cache: *const marconi_cache,
) {
    boundary_or("marconi_events_free", (), || {
        if !cache.is_null() {
            // SAFETY: NULL or a live handle (contract); a misaligned one is
            // refused by `handle` and ignored here.
            if let Ok(h) = unsafe { handle(cache) } {
                let _ = h.disable_events();
            }
        }
        // SAFETY: no other call runs on it (contract); anything but a live
        // handle of its kind is left alone.
        unsafe { release(events) };
    })
}

/// Whether this library was built with the ZeroMQ publisher (1) or not (0).
#[no_mangle]
pub extern "C" fn marconi_events_has_publisher() -> u32 {
    u32::from(cfg!(feature = "publisher"))
}

/// Checks that `cache` is one this handle can encode (same page size).
fn same_blocks(e: &Inner, h: &marconi_cache) -> FfiResult {
    let page = h.page_size()?;
    if page != e.block_size {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!(
                "the events handle encodes blocks of {} tokens; this cache's page size is {page}",
                e.block_size
            ),
        ));
    }
    Ok(())
}

/// Writes `payload` into `buf` or reports the size it needs.
///
/// # Safety
///
/// `out_len` is non-NULL, aligned and writable.
unsafe fn give(payload: &[u8], buf: &mut [u8], out_len: *mut usize) -> FfiResult<bool> {
    if payload.len() > buf.len() {
        // SAFETY: contract of this function.
        unsafe { out_len.write(payload.len()) };
        return Err(FfiError::new(
            marconi_status::BufferTooSmall,
            format!(
                "the batch needs {} bytes; the buffer holds {}",
                payload.len(),
                buf.len()
            ),
        ));
    }
    buf[..payload.len()].copy_from_slice(payload);
    // SAFETY: as above.
    unsafe { out_len.write(payload.len()) };
    Ok(true)
}

/// The arguments of marconi_events_drain and _snapshot, checked: the
/// handle's state under its lock, the cache (of the handle's page size) and
/// the caller's buffer; `out_len` is checked non-NULL and aligned.
///
/// # Safety
///
/// The contract of marconi_events_drain.
unsafe fn open_batch<'a>(
    events: *const marconi_events,
    cache: *const marconi_cache,
    ts: f64,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> FfiResult<(MutexGuard<'a, Inner>, &'a marconi_cache, &'a mut [u8])> {
    require!(events);
    require!(cache);
    require!(buf, cap = cap);
    require!(out_len);
    // SAFETY: live handles by contract.
    let (e, h) = unsafe { (events_handle(events)?, handle(cache)?) };
    // SAFETY: buffer contract of the header.
    let buf = unsafe { out_slice(buf, cap, "buf") }?;
    check_ptr!(out_len);
    check_ts(ts)?;
    let g = e.lock()?;
    same_blocks(&g, h)?;
    Ok((g, h, buf))
}

/// Drains the changes of `cache` since the last drain as one encoded
/// KVEventBatch (msgpack, docs/events.md) into `buf[0..cap]` and writes its
/// length to `*out_len`; 0 with MARCONI_STATUS_OK when nothing a subscriber
/// sees changed (also when only states changed and state events are off). `ts`
/// is the batch's timestamp (seconds since the Unix epoch, finite). When the
/// batch does not fit (NULL with cap 0 is a size query), returns
/// MARCONI_STATUS_BUFFER_TOO_SMALL with its size in `*out_len` and keeps it
/// (with its first `ts`) for the next call; changes made meanwhile go to the
/// batch after. MARCONI_STATUS_INVALID_ARGUMENT for a cache of another page
/// size than the handle's.
///
/// Thread safety: safe to call concurrently; each change is delivered once.
#[no_mangle]
pub unsafe extern "C" fn marconi_events_drain(
    events: *const marconi_events,
    cache: *const marconi_cache,
    ts: f64,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_events_drain", || {
        // SAFETY: forwarded caller contract.
        let (mut g, h, buf) = unsafe { open_batch(events, cache, ts, buf, cap, out_len) }?;
        if g.pending.is_none() {
            let evs = h.drain_events()?;
            // Changes a subscriber never sees (states with state events
            // off, less than a block) make no batch.
            let Some(batch) = g.enc.encode_changes(ts, &evs) else {
                // SAFETY: out_len checked above.
                unsafe { out_len.write(0) };
                return Ok(());
            };
            g.pending = Some(batch);
        }
        let payload = g.pending.as_deref().expect("set above");
        // SAFETY: out_len checked above.
        unsafe { give(payload, buf, out_len) }?;
        g.pending = None;
        Ok(())
    })
}

/// Encodes, into `buf[0..cap]`, a batch that brings any subscriber to the
/// cache's current content: AllBlocksCleared, every cached block once
/// (parents first) and every state. For a subscriber that lost more than
/// the replay buffer holds. Does not drain: pending changes stay pending
/// (apply this batch first, then the drained ones). Size query and
/// MARCONI_STATUS_BUFFER_TOO_SMALL as marconi_events_drain (nothing kept).
/// O(cached tokens x depth).
#[no_mangle]
pub unsafe extern "C" fn marconi_events_snapshot(
    events: *const marconi_events,
    cache: *const marconi_cache,
    ts: f64,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_events_snapshot", || {
        // SAFETY: forwarded caller contract.
        let (mut g, h, buf) = unsafe { open_batch(events, cache, ts, buf, cap, out_len) }?;
        let chains = h.cached_chains()?;
        let wire = g.enc.snapshot(&chains);
        let payload = ::marconi_events::encode_batch(ts, &wire, &g.enc.config().wire);
        // SAFETY: out_len checked above.
        unsafe { give(&payload, buf, out_len) }?;
        Ok(())
    })
}

/// Drains the changes of `cache` since the last call and publishes them as
/// one batch (PUB [topic, seq, payload], kept for replay); writes the
/// batch's sequence number to `*out_seq`, or MARCONI_NO_SEQ when nothing
/// changed. Never blocks. A batch left pending by marconi_events_drain goes
/// first. MARCONI_STATUS_QUEUE_FULL when the publisher thread is
/// `max_queue` batches behind: the batch is dropped and its sequence number
/// skipped, so subscribers see a gap that replay cannot fill (resynchronise
/// them with marconi_events_snapshot). MARCONI_STATUS_INVALID_ARGUMENT when
/// the handle has no publisher.
#[no_mangle]
pub unsafe extern "C" fn marconi_events_publish(
    events: *const marconi_events,
    cache: *const marconi_cache,
    ts: f64,
    out_seq: *mut u64,
) -> marconi_status {
    boundary("marconi_events_publish", || {
        require!(events);
        require!(cache);
        require!(out_seq);
        // SAFETY: live handles by contract.
        let (e, h) = unsafe { (events_handle(events)?, handle(cache)?) };
        check_ptr!(out_seq);
        check_ts(ts)?;
        let mut g = e.lock()?;
        same_blocks(&g, h)?;
        let seq = publish_locked(&mut g, h, ts)?;
        // SAFETY: out_seq is non-NULL, aligned, writable.
        unsafe { out_seq.write(seq) };
        Ok(())
    })
}

#[cfg(feature = "publisher")]
fn publish_locked(g: &mut Inner, h: &marconi_cache, ts: f64) -> FfiResult<u64> {
    let Inner {
        enc,
        pending,
        publisher,
        ..
    } = g;
    let Some(p) = publisher.as_ref() else {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            "this events handle has no publisher (endpoint was NULL)",
        ));
    };
    let send = |payload: Vec<u8>| {
        p.publish(payload).map_err(|e| match e {
            ::marconi_events::PublishError::QueueFull(_) => {
                FfiError::new(marconi_status::QueueFull, e.to_string())
            }
            other => FfiError::new(marconi_status::InvalidArgument, other.to_string()),
        })
    };
    let mut seq = MARCONI_NO_SEQ;
    if let Some(b) = pending.take() {
        seq = send(b)?;
    }
    let evs = h.drain_events()?;
    if let Some(batch) = enc.encode_changes(ts, &evs) {
        seq = send(batch)?;
    }
    Ok(seq)
}

#[cfg(not(feature = "publisher"))]
fn publish_locked(_g: &mut Inner, _h: &marconi_cache, _ts: f64) -> FfiResult<u64> {
    Err(FfiError::new(
        marconi_status::InvalidArgument,
        "this events handle has no publisher (libmarconi built without the `publisher` feature)",
    ))
}

/// Writes the publisher's endpoint `which` (0: PUB, 1: replay ROUTER) as
/// bound or connected, a `*` port resolved (e.g. "tcp://127.0.0.1:40123"),
/// into `buf[0..cap]` (not NUL-terminated) and its length to `*out_len`.
/// MARCONI_STATUS_BUFFER_TOO_SMALL with the length when it does not fit;
/// MARCONI_STATUS_INVALID_ARGUMENT when there is no such endpoint (no
/// publisher, no replay, `which` > 1).
#[no_mangle]
pub unsafe extern "C" fn marconi_events_endpoint(
    events: *const marconi_events,
    which: u32,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_events_endpoint", || {
        require!(events);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: live handle by contract.
        let e = unsafe { events_handle(events) }?;
        // SAFETY: buffer contract of the header.
        let buf = unsafe { out_slice(buf.cast::<u8>(), cap, "buf") }?;
        check_ptr!(out_len);
        let g = e.lock()?;
        let ep = endpoint_of(&g, which)?;
        // SAFETY: out_len checked above.
        unsafe { give(ep.as_bytes(), buf, out_len) }?;
        Ok(())
    })
}

#[cfg(feature = "publisher")]
fn endpoint_of(g: &Inner, which: u32) -> FfiResult<String> {
    let p = g.publisher.as_ref();
    let ep = match which {
        0 => p.map(|p| p.endpoint().to_owned()),
        1 => p.and_then(|p| p.replay_endpoint().map(str::to_owned)),
        _ => None,
    };
    ep.ok_or_else(|| {
        FfiError::new(
            marconi_status::InvalidArgument,
            format!("no endpoint {which} (0: PUB, 1: replay) on this events handle"),
        )
    })
}

#[cfg(not(feature = "publisher"))]
fn endpoint_of(_g: &Inner, which: u32) -> FfiResult<String> {
    Err(FfiError::new(
        marconi_status::InvalidArgument,
        format!("no endpoint {which}: libmarconi built without the `publisher` feature"),
    ))
}
