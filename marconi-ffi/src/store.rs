//! The store tier through the C ABI (docs/store.md): a store handle moves
//! KV blocks and recurrent states to and from a directory, Redis/Valkey,
//! or the engine's own store through callbacks, in checked envelopes. A
//! store that is down, slow or returns garbage gives misses (counted in
//! marconi_store_get_stats), never a wrong value and never a call that outlasts
//! the configured timeout by more than one operation.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ::marconi_store::{
    CallbackStore, Callbacks, DirStore, Fetched, Lookup, RedisConfig, RedisStore, Store,
    StoreError, StoreTier, TierConfig,
};

use crate::cache::tokens_len_ok;
use crate::handle::{borrow, handle_kind, publish, release};
use crate::status::{
    boundary, boundary_or, check_ptr, in_slice, init_struct, marconi_status, out_slice,
    read_struct, require, versioned, write_versioned, FfiError, FfiResult,
};

/// Which store a handle uses.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_store_backend {
    /// A local directory (`location`: its path; created when missing).
    Dir = 0,
    /// Redis or Valkey (`location`: "redis://host:port[/db]").
    Redis = 1,
    /// The engine's store, through the `get`, `put`, `exists` and `del`
    /// callbacks of the configuration (`location` unused).
    Callback = 2,
}

/// A callback's result: success (get: `*len` bytes written; exists: the
/// object is absent is MARCONI_STORE_CB_ABSENT).
pub const MARCONI_STORE_CB_OK: i32 = 0;
/// A callback's result: no object under that name.
pub const MARCONI_STORE_CB_ABSENT: i32 = 1;
/// get's result: the buffer is too small; `*len` is the object's size and
/// nothing was written.
pub const MARCONI_STORE_CB_TOO_SMALL: i32 = 2;

/// Reads the object `name` (NUL-terminated) into `buf[0..cap]`: returns
/// MARCONI_STORE_CB_OK with its size in `*len`, MARCONI_STORE_CB_ABSENT,
/// MARCONI_STORE_CB_TOO_SMALL with its size in `*len`, or anything else
/// for a failure (a miss). `name` and `buf` are valid only during the call.
pub type marconi_store_get_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        name: *const c_char,
        buf: *mut u8,
        cap: usize,
        len: *mut usize,
    ) -> i32,
>;
/// Writes `data[0..len]` as the object `name`, replacing it: returns
/// MARCONI_STORE_CB_OK, or anything else for a failure.
pub type marconi_store_put_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        name: *const c_char,
        data: *const u8,
        len: usize,
    ) -> i32,
>;
/// Whether the object `name` exists: MARCONI_STORE_CB_OK (yes),
/// MARCONI_STORE_CB_ABSENT (no), anything else for a failure.
pub type marconi_store_exists_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, name: *const c_char) -> i32>;
/// Removes the object `name` (absent is success): MARCONI_STORE_CB_OK, or
/// anything else for a failure.
pub type marconi_store_delete_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, name: *const c_char) -> i32>;

/// Configuration of a store handle. Versioned by size: fill it with
/// marconi_store_config_init(&cfg, sizeof cfg), then set fields. Strings
/// are read only during marconi_store_new.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_store_config {
    /// sizeof(marconi_store_config) as the caller compiled it.
    pub struct_size: u32,
    /// A marconi_store_backend value. Default MARCONI_STORE_BACKEND_DIR.
    pub backend: u32,
    /// The directory (DIR) or the URL (REDIS); unused by CALLBACK.
    /// Required for DIR and REDIS.
    pub location: *const c_char,
    /// What makes two engines' values interchangeable: the model (name or
    /// config digest), dtype, parallel layout... Required; engines share
    /// entries exactly when this string is equal.
    pub model: *const c_char,
    /// Prepended to object names ([A-Za-z0-9._:-], not starting with a
    /// dot), or NULL for "marconi-".
    pub prefix: *const c_char,
    /// An operator's partition of the store (tenant, deployment), or NULL
    /// for none.
    pub namespace_: *const c_char,
    /// The seed of the block hashes' NONE_HASH (vLLM's PYTHONHASHSEED), or
    /// NULL for vLLM's default "vllm-none-hash".
    pub seed: *const c_char,
    /// The cache namespace (a LoRA id, a cache salt) of the calls without
    /// one: the extra key of every block hash (as marconi_events; 0: none).
    /// The `_ns` calls (marconi_store_put_state_ns...) and the store probe
    /// of marconi_tiered_lookup use the namespace they are given instead.
    /// Isolation: the keys of namespace a and namespace b != a differ (the
    /// namespace enters every block hash and the key each envelope is
    /// checked against), so an entry written in one namespace is never
    /// read, probed, found in a KV prefix or removed by a call in another,
    /// whatever the processes or handles.
    pub ns: u64,
    /// Tokens per KV block. Required (> 0).
    pub block_size: u32,
    /// The engine's value layout version (bump it when its block or state
    /// byte layout changes). Default 1.
    pub layout_version: u32,
    /// Bound of one store call as a whole, in milliseconds: its request
    /// written and every reply read (REDIS, however slowly the server
    /// sends), its files (DIR), its callbacks (CALLBACK). Default 50.
    pub timeout_ms: u32,
    /// REDIS: bound of opening a connection (connect, AUTH, SELECT), in
    /// milliseconds, before the call's own timeout_ms. Default 50.
    pub connect_timeout_ms: u32,
    /// The largest value read or written, in bytes. Default 256 MiB.
    pub max_value_bytes: u64,
    /// REDIS: expiry of the objects written, in seconds (0: none). Default 0.
    pub ttl_s: u64,
    /// CALLBACK: reads an object. Required for CALLBACK.
    pub get: marconi_store_get_fn,
    /// CALLBACK: writes an object. Required for CALLBACK.
    pub put: marconi_store_put_fn,
    /// CALLBACK: whether an object exists. Required for CALLBACK.
    pub exists: marconi_store_exists_fn,
    /// CALLBACK: removes an object. Required for CALLBACK.
    pub del: marconi_store_delete_fn,
    /// CALLBACK: passed to every callback. The callbacks are called from
    /// the threads that call the store handle, possibly at once: they and
    /// `user` must be thread-safe, and live until marconi_store_free.
    pub user: *mut c_void,
}
versioned!(marconi_store_config, CONFIG_MIN_SIZE);

impl marconi_store_config {
    fn defaults() -> Self {
        marconi_store_config {
            struct_size: std::mem::size_of::<marconi_store_config>() as u32,
            backend: marconi_store_backend::Dir as u32,
            location: std::ptr::null(),
            model: std::ptr::null(),
            prefix: std::ptr::null(),
            namespace_: std::ptr::null(),
            seed: std::ptr::null(),
            ns: 0,
            block_size: 0,
            layout_version: 1,
            timeout_ms: 50,
            connect_timeout_ms: 50,
            max_value_bytes: 256 << 20,
            ttl_s: 0,
            get: None,
            put: None,
            exists: None,
            del: None,
            user: std::ptr::null_mut(),
        }
    }
}

/// The first version's size of marconi_store_config (every field of this one: none was
/// added since).
const CONFIG_MIN_SIZE: usize = std::mem::size_of::<marconi_store_config>();

/// A store's counters (marconi_store_get_stats): hits, misses by kind, writes.
/// Set struct_size to sizeof(marconi_store_stats) before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct marconi_store_stats {
    /// sizeof(marconi_store_stats) as the caller compiled it.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Values returned (verified).
    pub hits: u64,
    /// Misses: no object.
    pub absent: u64,
    /// Misses: shorter than its envelope says.
    pub truncated: u64,
    /// Misses: bad magic or checksum.
    pub corrupt: u64,
    /// Misses: another envelope format or layout version.
    pub version: u64,
    /// Misses: another model's value.
    pub foreign_model: u64,
    /// Misses: a value written under another key (copied or swapped).
    pub wrong_key: u64,
    /// Misses: over max_value_bytes, or a KV block of another size.
    pub oversized: u64,
    /// Misses: not a plain object (directory, symlink, FIFO, Redis list).
    pub not_regular: u64,
    /// Misses: the store timed out.
    pub timeout: u64,
    /// Misses: the store was unreachable (or in reconnection backoff).
    pub unavailable: u64,
    /// Misses: the store answered with an error.
    pub failed: u64,
    /// Values written.
    pub puts: u64,
    /// Values the store failed to write.
    pub put_failures: u64,
    /// Payload bytes returned.
    pub bytes_read: u64,
    /// Payload bytes written.
    pub bytes_written: u64,
}

/// The first version's size of marconi_store_stats.
const STATS_MIN_SIZE: usize = 8;

/// A store handle: opaque to C. Create with marconi_store_new, free with
/// marconi_store_free. Safe to call from several threads at once.
pub struct marconi_store {
    _private: [u8; 0],
}

/// What a `*marconi_store` points to; its tag is all that is read of a
/// pointer before it is known to be a store handle.
struct StoreHandle {
    tier: StoreTier,
}
handle_kind!(StoreHandle, Store, "marconi_store");

/// # Safety
///
/// `store` is NULL or a live handle from marconi_store_new.
unsafe fn store_handle<'a>(store: *const marconi_store) -> FfiResult<&'a StoreHandle> {
    let store = store.cast::<StoreHandle>();
    // SAFETY: the registry check reads nothing behind the pointer.
    unsafe { borrow(store, "store") }
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

fn config_error(e: impl std::fmt::Display) -> FfiError {
    FfiError::new(marconi_status::InvalidConfig, e.to_string())
}

type GetFn = unsafe extern "C" fn(*mut c_void, *const c_char, *mut u8, usize, *mut usize) -> i32;
type PutFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const u8, usize) -> i32;
type ExistsFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> i32;
type DelFn = ExistsFn;

/// The engine's callbacks and their context, sent to whichever thread
/// calls the store.
#[derive(Clone, Copy)]
struct CCallbacks {
    get: GetFn,
    put: PutFn,
    exists: ExistsFn,
    del: DelFn,
    user: *mut c_void,
}

// SAFETY: the configuration's contract (marconi_store_config.user) makes
// the callbacks and `user` thread-safe and alive until marconi_store_free.
unsafe impl Send for CCallbacks {}
// SAFETY: as above.
unsafe impl Sync for CCallbacks {}

fn c_name(name: &str) -> Result<std::ffi::CString, StoreError> {
    std::ffi::CString::new(name).map_err(|_| StoreError::Invalid(format!("name {name:?}")))
}

fn cb_failure(what: &str, rc: i32) -> StoreError {
    StoreError::Failed(format!("the engine's {what} callback returned {rc}"))
}

fn callback_store(cb: CCallbacks, timeout: Duration) -> CallbackStore {
    // The last object size seen: the first buffer offered to `get`.
    let hint = std::sync::Arc::new(AtomicUsize::new(4096));
    let get = move |name: &str, max: usize| -> Result<Fetched, StoreError> {
        // The whole struct (Send + Sync), not its fields, is captured.
        let cb = cb;
        let n = c_name(name)?;
        let mut cap = hint.load(Ordering::Relaxed).min(max);
        for _ in 0..2 {
            let mut buf = vec![0u8; cap];
            let mut len = 0usize;
            // SAFETY: the callback's contract; name is NUL-terminated and
            // buf has cap writable bytes, both alive during the call.
            let rc = unsafe { (cb.get)(cb.user, n.as_ptr(), buf.as_mut_ptr(), cap, &mut len) };
            match rc {
                MARCONI_STORE_CB_OK if len <= cap => {
                    buf.truncate(len);
                    hint.store(len.max(1), Ordering::Relaxed);
                    return Ok(Fetched::Value(buf));
                }
                MARCONI_STORE_CB_OK => {
                    return Err(StoreError::Failed(format!(
                        "the engine's get callback said it wrote {len} bytes into {cap}"
                    )))
                }
                MARCONI_STORE_CB_ABSENT => return Ok(Fetched::Absent),
                MARCONI_STORE_CB_TOO_SMALL if len > max => return Ok(Fetched::Oversized),
                MARCONI_STORE_CB_TOO_SMALL if len > cap => cap = len,
                rc => return Err(cb_failure("get", rc)),
            }
        }
        Err(StoreError::Failed(
            "the engine's get callback asked for a larger buffer twice".into(),
        ))
    };
    let put = move |name: &str, data: &[u8]| {
        // The whole struct (Send + Sync), not its fields, is captured.
        let cb = cb;
        let n = c_name(name)?;
        // SAFETY: the callback's contract; both pointers valid during the call.
        match unsafe { (cb.put)(cb.user, n.as_ptr(), data.as_ptr(), data.len()) } {
            MARCONI_STORE_CB_OK => Ok(()),
            rc => Err(cb_failure("put", rc)),
        }
    };
    let exists = move |name: &str| {
        // The whole struct (Send + Sync), not its fields, is captured.
        let cb = cb;
        let n = c_name(name)?;
        // SAFETY: the callback's contract; name valid during the call.
        match unsafe { (cb.exists)(cb.user, n.as_ptr()) } {
            MARCONI_STORE_CB_OK => Ok(true),
            MARCONI_STORE_CB_ABSENT => Ok(false),
            rc => Err(cb_failure("exists", rc)),
        }
    };
    let delete = move |name: &str| {
        // The whole struct (Send + Sync), not its fields, is captured.
        let cb = cb;
        let n = c_name(name)?;
        // SAFETY: the callback's contract; name valid during the call.
        match unsafe { (cb.del)(cb.user, n.as_ptr()) } {
            MARCONI_STORE_CB_OK => Ok(()),
            rc => Err(cb_failure("del", rc)),
        }
    };
    CallbackStore::new(
        Callbacks {
            get: Box::new(get),
            put: Box::new(put),
            exists: Box::new(exists),
            delete: Box::new(delete),
        },
        timeout,
    )
}

/// Fills `*cfg` with the defaults (documented per field) and sets
/// `cfg->struct_size`: any size from the first version's on (an older
/// caller's struct gets the fields it has). MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE
/// when struct_size is smaller than the first version's.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_config_init(
    cfg: *mut marconi_store_config,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: cfg is NULL or has struct_size writable bytes (contract).
    boundary("marconi_store_config_init", || unsafe {
        init_struct(cfg, struct_size, "cfg")
    })
}

/// Creates a store handle from `*cfg` and writes it to `*out` (free it
/// with marconi_store_free). Opens no connection (REDIS connects on first
/// use); creates the directory (DIR). MARCONI_STATUS_INVALID_CONFIG (reason
/// in marconi_last_error) for a missing model or location, block_size 0,
/// timeout_ms 0, a bad URL, prefix or backend, or a CALLBACK backend
/// without all four callbacks.
///
/// # Safety
///
/// Besides the memory rules at the top of marconi.h: the callbacks of `cfg`
/// follow their contracts, with its `user`, until marconi_store_free.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_new(
    cfg: *const marconi_store_config,
    out: *mut *mut marconi_store,
) -> marconi_status {
    boundary("marconi_store_new", || {
        require!(cfg);
        require!(out);
        check_ptr!(cfg);
        check_ptr!(out);
        // SAFETY: cfg is non-NULL, aligned, initialised by config_init.
        let c = unsafe { read_struct(cfg) }?;
        // SAFETY: the string fields are NULL or NUL-terminated (contract).
        let (location, model, prefix, namespace, seed) = unsafe {
            (
                opt_str(c.location, "location")?,
                opt_str(c.model, "model")?,
                opt_str(c.prefix, "prefix")?,
                opt_str(c.namespace_, "namespace_")?,
                opt_str(c.seed, "seed")?,
            )
        };
        let model = model.ok_or_else(|| config_error("model is NULL"))?;
        if c.block_size == 0 {
            return Err(config_error("block_size is 0"));
        }
        if c.timeout_ms == 0 || c.connect_timeout_ms == 0 {
            return Err(config_error(
                "timeout_ms and connect_timeout_ms must be > 0",
            ));
        }
        let timeout = Duration::from_millis(u64::from(c.timeout_ms));
        let mut tc = TierConfig::new(&model, c.block_size as usize);
        if let Some(p) = prefix {
            tc.prefix = p;
        }
        tc.keyer.namespace = namespace.unwrap_or_default();
        if let Some(s) = seed {
            tc.keyer.seed = s;
        }
        tc.keyer.ns = c.ns;
        tc.keyer.layout_version = c.layout_version;
        tc.max_value_bytes = usize::try_from(c.max_value_bytes).unwrap_or(usize::MAX);
        let store: Box<dyn Store> = match c.backend {
            0 => {
                let l = location.ok_or_else(|| config_error("location (the directory) is NULL"))?;
                Box::new(DirStore::new(l, timeout).map_err(config_error)?)
            }
            1 => {
                let l = location.ok_or_else(|| config_error("location (the URL) is NULL"))?;
                let mut rc = RedisConfig::new(&l);
                rc.timeout = timeout;
                rc.connect_timeout = Duration::from_millis(u64::from(c.connect_timeout_ms));
                rc.ttl_s = c.ttl_s;
                Box::new(RedisStore::new(rc).map_err(config_error)?)
            }
            2 => {
                let (Some(get), Some(put), Some(exists), Some(del)) =
                    (c.get, c.put, c.exists, c.del)
                else {
                    return Err(config_error(
                        "the CALLBACK backend needs get, put, exists and del",
                    ));
                };
                let cb = CCallbacks {
                    get,
                    put,
                    exists,
                    del,
                    user: c.user,
                };
                Box::new(callback_store(cb, timeout))
            }
            v => {
                return Err(config_error(format!(
                    "backend {v} is not a marconi_store_backend"
                )))
            }
        };
        let tier = StoreTier::new(store, tc).map_err(config_error)?;
        let h = StoreHandle { tier };
        // SAFETY: out is non-NULL, aligned and writable (checked, contract).
        unsafe { publish(h, out.cast::<*mut StoreHandle>()) };
        Ok(())
    })
}

/// Frees a store handle (closes its connections). NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_free(store: *mut marconi_store) {
    boundary_or("marconi_store_free", (), || {
        // SAFETY: no other call runs on it (contract); anything but a live
        // store is left alone.
        unsafe { release(store.cast::<StoreHandle>()) };
    })
}

/// # Safety
///
/// `tokens` is NULL or points to `n` readable u32.
unsafe fn token_slice<'a>(tokens: *const u32, n: usize) -> FfiResult<&'a [u32]> {
    tokens_len_ok(n, "tokens")?;
    if n == 0 {
        return Err(FfiError::new(
            marconi_status::EmptyTokens,
            "tokens is empty",
        ));
    }
    // SAFETY: the caller's contract.
    unsafe { in_slice(tokens, n, "tokens") }
}

fn position_error(e: StoreError) -> FfiError {
    FfiError::new(marconi_status::PositionOutOfRange, e.to_string())
}

fn put_error(e: StoreError) -> FfiError {
    match e {
        StoreError::Invalid(d) => FfiError::new(marconi_status::InvalidArgument, d),
        e => FfiError::new(marconi_status::BackendFailure, e.to_string()),
    }
}

/// Writes the recurrent state after `tokens[0..position]`
/// (`data[0..len]`, at most max_value_bytes) to the store.
/// MARCONI_STATUS_POSITION_OUT_OF_RANGE unless 1 <= position <= n_tokens;
/// MARCONI_STATUS_BACKEND_FAILURE when the store did not take it (the
/// engine may ignore it: the state is then simply not found later).
#[no_mangle]
pub unsafe extern "C" fn marconi_store_put_state(
    store: *const marconi_store,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
    data: *const u8,
    len: usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_put_state(
            "marconi_store_put_state",
            store,
            None,
            tokens,
            n_tokens,
            position,
            data,
            len,
        )
    }
}

/// marconi_store_put_state in cache namespace `ns` (a LoRA id, a cache salt: the
/// `ns` of marconi_tiered_lookup) instead of the handle's configured `ns`.
/// Entries of one namespace are never read, probed or removed by a call in
/// another (their keys differ).
#[no_mangle]
pub unsafe extern "C" fn marconi_store_put_state_ns(
    store: *const marconi_store,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
    data: *const u8,
    len: usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_put_state(
            "marconi_store_put_state_ns",
            store,
            Some(ns),
            tokens,
            n_tokens,
            position,
            data,
            len,
        )
    }
}

/// marconi_store_put_state and marconi_store_put_state_ns (`ns` None: the handle's
/// configured namespace).
///
/// # Safety
///
/// The contract of marconi_store_put_state.
#[expect(
    clippy::too_many_arguments,
    reason = "the C function's arguments, plus its name and the namespace"
)]
unsafe fn store_put_state(
    what: &'static str,
    store: *const marconi_store,
    ns: Option<u64>,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
    data: *const u8,
    len: usize,
) -> marconi_status {
    boundary(what, || {
        require!(store);
        require!(tokens, len = n_tokens);
        require!(data, len = len);
        // SAFETY: the caller's contract for each pointer.
        let (s, t, d) = unsafe {
            (
                store_handle(store)?,
                token_slice(tokens, n_tokens)?,
                in_slice(data, len, "data")?,
            )
        };
        s.tier
            .keyer()
            .state_key_ns(ns.unwrap_or_else(|| s.tier.default_ns()), t, position)
            .ok_or_else(|| {
                position_error(StoreError::Invalid(format!(
                    "position {position} is not in 1..={n_tokens}"
                )))
            })?;
        s.tier
            .put_state_ns(ns.unwrap_or_else(|| s.tier.default_ns()), t, position, d)
            .map_err(put_error)
    })
}

/// Reads the recurrent state after `tokens[0..position]` into `buf`: on a
/// hit writes its size to `*out_len` and 1 to `*out_found`; on a miss (no
/// value, or one that failed verification, or a store that is down or
/// slow) writes 0 to both. MARCONI_STATUS_BUFFER_TOO_SMALL, with the
/// state's size in `*out_len` and nothing else written, when it is larger
/// than `cap`. MARCONI_STATUS_POSITION_OUT_OF_RANGE unless
/// 1 <= position <= n_tokens.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_get_state(
    store: *const marconi_store,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
    out_found: *mut u32,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_get_state(
            "marconi_store_get_state",
            store,
            None,
            tokens,
            n_tokens,
            position,
            buf,
            cap,
            out_len,
            out_found,
        )
    }
}

/// marconi_store_get_state in cache namespace `ns` (a LoRA id, a cache salt: the
/// `ns` of marconi_tiered_lookup) instead of the handle's configured `ns`.
/// Entries of one namespace are never read, probed or removed by a call in
/// another (their keys differ).
#[no_mangle]
pub unsafe extern "C" fn marconi_store_get_state_ns(
    store: *const marconi_store,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
    out_found: *mut u32,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_get_state(
            "marconi_store_get_state_ns",
            store,
            Some(ns),
            tokens,
            n_tokens,
            position,
            buf,
            cap,
            out_len,
            out_found,
        )
    }
}

/// marconi_store_get_state and marconi_store_get_state_ns (`ns` None: the handle's
/// configured namespace).
///
/// # Safety
///
/// The contract of marconi_store_get_state.
#[expect(
    clippy::too_many_arguments,
    reason = "the C function's arguments, plus its name and the namespace"
)]
unsafe fn store_get_state(
    what: &'static str,
    store: *const marconi_store,
    ns: Option<u64>,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
    out_found: *mut u32,
) -> marconi_status {
    boundary(what, || {
        require!(store);
        require!(tokens, len = n_tokens);
        require!(buf, cap = cap);
        require!(out_len);
        require!(out_found);
        check_ptr!(out_len);
        check_ptr!(out_found);
        // SAFETY: the caller's contract for each pointer.
        let (s, t, b) = unsafe {
            (
                store_handle(store)?,
                token_slice(tokens, n_tokens)?,
                out_slice(buf, cap, "buf")?,
            )
        };
        let l = s
            .tier
            .get_state_ns(ns.unwrap_or_else(|| s.tier.default_ns()), t, position)
            .map_err(position_error)?;
        let (len, found) = match l {
            Lookup::Hit(p) if p.len() > cap => {
                // SAFETY: checked non-NULL, aligned, writable.
                unsafe { out_len.write(p.len()) };
                return Err(FfiError::new(
                    marconi_status::BufferTooSmall,
                    format!("the state has {} bytes, buf {cap}", p.len()),
                ));
            }
            Lookup::Hit(p) => {
                b[..p.len()].copy_from_slice(&p);
                (p.len(), 1)
            }
            Lookup::Miss(_) => (0, 0),
        };
        // SAFETY: checked non-NULL, aligned, writable.
        unsafe {
            out_len.write(len);
            out_found.write(found);
        }
        Ok(())
    })
}

/// Removes the state after `tokens[0..position]` from the store.
/// MARCONI_STATUS_BACKEND_FAILURE when the store failed.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_delete_state(
    store: *const marconi_store,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_delete_state(
            "marconi_store_delete_state",
            store,
            None,
            tokens,
            n_tokens,
            position,
        )
    }
}

/// marconi_store_delete_state in cache namespace `ns` (a LoRA id, a cache salt: the
/// `ns` of marconi_tiered_lookup) instead of the handle's configured `ns`.
/// Entries of one namespace are never read, probed or removed by a call in
/// another (their keys differ).
#[no_mangle]
pub unsafe extern "C" fn marconi_store_delete_state_ns(
    store: *const marconi_store,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_delete_state(
            "marconi_store_delete_state_ns",
            store,
            Some(ns),
            tokens,
            n_tokens,
            position,
        )
    }
}

/// marconi_store_delete_state and marconi_store_delete_state_ns (`ns` None: the handle's
/// configured namespace).
///
/// # Safety
///
/// The contract of marconi_store_delete_state.
unsafe fn store_delete_state(
    what: &'static str,
    store: *const marconi_store,
    ns: Option<u64>,
    tokens: *const u32,
    n_tokens: usize,
    position: usize,
) -> marconi_status {
    boundary(what, || {
        require!(store);
        require!(tokens, len = n_tokens);
        // SAFETY: the caller's contract for each pointer.
        let (s, t) = unsafe { (store_handle(store)?, token_slice(tokens, n_tokens)?) };
        s.tier
            .keyer()
            .state_key_ns(ns.unwrap_or_else(|| s.tier.default_ns()), t, position)
            .ok_or_else(|| {
                position_error(StoreError::Invalid(format!(
                    "position {position} is not in 1..={n_tokens}"
                )))
            })?;
        s.tier
            .delete_state_ns(ns.unwrap_or_else(|| s.tier.default_ns()), t, position)
            .map_err(put_error)
    })
}

/// Writes KV blocks `first_block .. first_block + n_blocks` of `tokens`
/// (full blocks of block_size tokens), `block_bytes` bytes each, laid out
/// one after the other in `data` (`n_blocks * block_bytes` bytes).
/// MARCONI_STATUS_INVALID_ARGUMENT when the blocks are not all full blocks
/// of `tokens`, n_blocks or block_bytes is 0, or block_bytes is over
/// max_value_bytes; MARCONI_STATUS_BACKEND_FAILURE when the store did not
/// take them (it may have taken some: a later read verifies each block).
///
/// # Safety
///
/// Besides the memory rules at the top of marconi.h: `data` holds n_blocks *
/// block_bytes bytes.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_put_kv(
    store: *const marconi_store,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    n_blocks: usize,
    data: *const u8,
    block_bytes: usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_put_kv(
            "marconi_store_put_kv",
            store,
            None,
            tokens,
            n_tokens,
            first_block,
            n_blocks,
            data,
            block_bytes,
        )
    }
}

/// marconi_store_put_kv in cache namespace `ns` (a LoRA id, a cache salt: the
/// `ns` of marconi_tiered_lookup) instead of the handle's configured `ns`.
/// Entries of one namespace are never read, probed or removed by a call in
/// another (their keys differ).
///
/// # Safety
///
/// Besides the memory rules at the top of marconi.h: `data` holds n_blocks *
/// block_bytes bytes.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_put_kv_ns(
    store: *const marconi_store,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    n_blocks: usize,
    data: *const u8,
    block_bytes: usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_put_kv(
            "marconi_store_put_kv_ns",
            store,
            Some(ns),
            tokens,
            n_tokens,
            first_block,
            n_blocks,
            data,
            block_bytes,
        )
    }
}

/// marconi_store_put_kv and marconi_store_put_kv_ns (`ns` None: the handle's
/// configured namespace).
///
/// # Safety
///
/// The contract of marconi_store_put_kv.
#[expect(
    clippy::too_many_arguments,
    reason = "the C function's arguments, plus its name and the namespace"
)]
unsafe fn store_put_kv(
    what: &'static str,
    store: *const marconi_store,
    ns: Option<u64>,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    n_blocks: usize,
    data: *const u8,
    block_bytes: usize,
) -> marconi_status {
    boundary(what, || {
        require!(store);
        require!(tokens, len = n_tokens);
        require!(data);
        if n_blocks == 0 || block_bytes == 0 {
            return Err(FfiError::new(
                marconi_status::InvalidArgument,
                "n_blocks and block_bytes must be > 0",
            ));
        }
        let total = n_blocks.checked_mul(block_bytes).ok_or_else(|| {
            FfiError::new(
                marconi_status::InvalidArgument,
                "n_blocks * block_bytes overflows",
            )
        })?;
        // SAFETY: the caller's contract for each pointer.
        let (s, t, d) = unsafe {
            (
                store_handle(store)?,
                token_slice(tokens, n_tokens)?,
                in_slice(data, total, "data")?,
            )
        };
        let blocks: Vec<&[u8]> = d.chunks_exact(block_bytes).collect();
        s.tier
            .put_kv_ns(
                ns.unwrap_or_else(|| s.tier.default_ns()),
                t,
                first_block,
                &blocks,
            )
            .map_err(put_error)
    })
}

/// Reads KV blocks of `tokens` from `first_block`, each exactly
/// `block_bytes` bytes, into `buf` one after the other: at most
/// `cap / block_bytes` blocks and no further than the tokens' full blocks,
/// in one store call. Writes the number of consecutive verified blocks
/// from `first_block` to `*out_blocks` (0 on a miss of the first, and when
/// the store is down or slow). MARCONI_STATUS_INVALID_ARGUMENT when
/// block_bytes is 0 or first_block is past the tokens' full blocks.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_get_kv(
    store: *const marconi_store,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    block_bytes: usize,
    buf: *mut u8,
    cap: usize,
    out_blocks: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_get_kv(
            "marconi_store_get_kv",
            store,
            None,
            tokens,
            n_tokens,
            first_block,
            block_bytes,
            buf,
            cap,
            out_blocks,
        )
    }
}

/// marconi_store_get_kv in cache namespace `ns` (a LoRA id, a cache salt: the
/// `ns` of marconi_tiered_lookup) instead of the handle's configured `ns`.
/// Entries of one namespace are never read, probed or removed by a call in
/// another (their keys differ).
#[no_mangle]
pub unsafe extern "C" fn marconi_store_get_kv_ns(
    store: *const marconi_store,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    block_bytes: usize,
    buf: *mut u8,
    cap: usize,
    out_blocks: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_get_kv(
            "marconi_store_get_kv_ns",
            store,
            Some(ns),
            tokens,
            n_tokens,
            first_block,
            block_bytes,
            buf,
            cap,
            out_blocks,
        )
    }
}

/// marconi_store_get_kv and marconi_store_get_kv_ns (`ns` None: the handle's
/// configured namespace).
///
/// # Safety
///
/// The contract of marconi_store_get_kv.
#[expect(
    clippy::too_many_arguments,
    reason = "the C function's arguments, plus its name and the namespace"
)]
unsafe fn store_get_kv(
    what: &'static str,
    store: *const marconi_store,
    ns: Option<u64>,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    block_bytes: usize,
    buf: *mut u8,
    cap: usize,
    out_blocks: *mut usize,
) -> marconi_status {
    boundary(what, || {
        require!(store);
        require!(tokens, len = n_tokens);
        require!(buf, cap = cap);
        require!(out_blocks);
        check_ptr!(out_blocks);
        if block_bytes == 0 {
            return Err(FfiError::new(
                marconi_status::InvalidArgument,
                "block_bytes is 0",
            ));
        }
        // SAFETY: the caller's contract for each pointer.
        let (s, t, b) = unsafe {
            (
                store_handle(store)?,
                token_slice(tokens, n_tokens)?,
                out_slice(buf, cap, "buf")?,
            )
        };
        let got = s
            .tier
            .get_kv_ns(
                ns.unwrap_or_else(|| s.tier.default_ns()),
                t,
                first_block,
                cap / block_bytes,
                Some(block_bytes),
            )
            .map_err(|e| FfiError::new(marconi_status::InvalidArgument, e.to_string()))?;
        for (dst, p) in b.chunks_exact_mut(block_bytes).zip(&got) {
            dst.copy_from_slice(p);
        }
        // SAFETY: checked non-NULL, aligned, writable.
        unsafe { out_blocks.write(got.len()) };
        Ok(())
    })
}

/// Writes to `*out_blocks` how many of `tokens`' full blocks, from block
/// 0, the store says it has (one existence query, no value read: a hint
/// that marconi_store_get_kv verifies). 0 when the store is down or slow.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_kv_prefix(
    store: *const marconi_store,
    tokens: *const u32,
    n_tokens: usize,
    out_blocks: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_kv_prefix(
            "marconi_store_kv_prefix",
            store,
            None,
            tokens,
            n_tokens,
            out_blocks,
        )
    }
}

/// marconi_store_kv_prefix in cache namespace `ns` (a LoRA id, a cache salt: the
/// `ns` of marconi_tiered_lookup) instead of the handle's configured `ns`.
/// Entries of one namespace are never read, probed or removed by a call in
/// another (their keys differ).
#[no_mangle]
pub unsafe extern "C" fn marconi_store_kv_prefix_ns(
    store: *const marconi_store,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    out_blocks: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        store_kv_prefix(
            "marconi_store_kv_prefix_ns",
            store,
            Some(ns),
            tokens,
            n_tokens,
            out_blocks,
        )
    }
}

/// marconi_store_kv_prefix and marconi_store_kv_prefix_ns (`ns` None: the handle's
/// configured namespace).
///
/// # Safety
///
/// The contract of marconi_store_kv_prefix.
unsafe fn store_kv_prefix(
    what: &'static str,
    store: *const marconi_store,
    ns: Option<u64>,
    tokens: *const u32,
    n_tokens: usize,
    out_blocks: *mut usize,
) -> marconi_status {
    boundary(what, || {
        require!(store);
        require!(tokens, len = n_tokens);
        require!(out_blocks);
        check_ptr!(out_blocks);
        // SAFETY: the caller's contract for each pointer.
        let (s, t) = unsafe { (store_handle(store)?, token_slice(tokens, n_tokens)?) };
        let n = s
            .tier
            .kv_prefix_ns(ns.unwrap_or_else(|| s.tier.default_ns()), t);
        // SAFETY: checked non-NULL, aligned, writable.
        unsafe { out_blocks.write(n) };
        Ok(())
    })
}

/// Writes the store's counters to `*out`. Set out->struct_size to
/// sizeof(marconi_store_stats) first: only that many bytes are written (at
/// least 8), so callers compiled against an older header keep working.
#[no_mangle]
pub unsafe extern "C" fn marconi_store_get_stats(
    store: *const marconi_store,
    out: *mut marconi_store_stats,
) -> marconi_status {
    boundary("marconi_store_get_stats", || {
        require!(store);
        require!(out);
        check_ptr!(out);
        // SAFETY: the caller passes a live handle or NULL.
        let s = unsafe { store_handle(store) }?;
        // SAFETY: out is non-NULL and aligned; its first field is struct_size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < STATS_MIN_SIZE {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("store stats struct_size is {size}; set it to sizeof(marconi_store_stats)"),
            ));
        }
        let st = s.tier.stats();
        let v = marconi_store_stats {
            struct_size: size as u32,
            reserved: 0,
            hits: st.hits,
            absent: st.absent,
            truncated: st.truncated,
            corrupt: st.corrupt,
            version: st.version,
            foreign_model: st.foreign_model,
            wrong_key: st.wrong_key,
            oversized: st.oversized,
            not_regular: st.not_regular,
            timeout: st.timeout,
            unavailable: st.unavailable,
            failed: st.failed,
            puts: st.puts,
            put_failures: st.put_failures,
            bytes_read: st.bytes_read,
            bytes_written: st.bytes_written,
        };
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&v, out, size) };
        Ok(())
    })
}

/// The shared-store probe of marconi_tiered_lookup: which of `positions`
/// have a state of `tokens` in the store (one existence query), and the
/// store's KV prefix in tokens (a second query, only when a state was found
/// and the states do not carry their KV; the input length when they do).
/// A failed query gives an empty probe and `true` (a miss, counted in the
/// store's stats and by the caller), never an error.
/// The keys are those of namespace `ns`.
///
/// # Safety
///
/// `store` is NULL or a live handle from marconi_store_new.
pub(crate) unsafe fn probe_states(
    store: *const marconi_store,
    ns: u64,
    tokens: &[u32],
    positions: &[u32],
    states_hold_kv: bool,
) -> FfiResult<(marconi_core::StoreProbe, bool)> {
    // SAFETY: the caller's contract.
    let s = unsafe { store_handle(store) }?;
    let mut probe = marconi_core::StoreProbe::default();
    if positions.is_empty() {
        return Ok((probe, false));
    }
    let keyer = s.tier.keyer();
    let wanted: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
    match s.tier.states_exist_ns(ns, tokens, &wanted) {
        Some(found) => {
            probe.states = positions
                .iter()
                .zip(found)
                .filter_map(|(p, f)| f.then_some(*p))
                .collect();
        }
        None => return Ok((probe, true)),
    }
    if !probe.states.is_empty() {
        probe.kv_tokens = if states_hold_kv {
            u32::try_from(tokens.len()).unwrap_or(u32::MAX)
        } else {
            let blocks = s.tier.kv_prefix_ns(ns, tokens);
            u32::try_from(blocks.saturating_mul(keyer.config().block_size)).unwrap_or(u32::MAX)
        };
    }
    Ok((probe, false))
}
