//! Status codes, the thread-local last-error detail, and the boundary
//! machinery every exported function goes through (panic catching, NULL and
//! length checks, output writes).

use std::cell::{Cell, RefCell};
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use marconi_core::CacheError;

/// The result of every fallible call. Values are explicit and never reused
/// once released; new values are only appended. The numeric value is part of
/// the ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_status {
    /// Success.
    Ok = 0,
    /// A required pointer was NULL, or a buffer was NULL with a length > 0.
    NullArgument = 1,
    /// An argument is out of range (unknown enum value, absurd length,
    /// misaligned pointer, a destination slot the cache owns, ...).
    InvalidArgument = 2,
    /// An output buffer is too small; the needed size was written where the
    /// function documents it, and nothing else changed.
    BufferTooSmall = 3,
    /// A Rust panic was caught at the boundary (a bug in libmarconi); the
    /// cache it happened in is unusable from now on (MARCONI_STATUS_POISONED).
    Panic = 4,
    /// The cache's lock was poisoned by an earlier panic; the cache refuses
    /// every call except marconi_cache_free.
    Poisoned = 5,
    /// The configuration cannot drive a cache (zero capacity, zero page size,
    /// block size not a multiple of the page size, bad model dimensions, ...).
    InvalidConfig = 6,
    /// The model preset name is not known.
    UnknownPreset = 7,
    /// A token array was empty where at least one token is needed.
    EmptyTokens = 8,
    /// A token array has 2^32 - 1 tokens or more.
    TooManyTokens = 9,
    /// The lease is unknown: never issued by this cache, or already released.
    UnknownLease = 10,
    /// The admitted tokens do not start with the input the lease looked up.
    PrefixMismatch = 11,
    /// The KV page list has the wrong length (0 or one id per full page).
    BadPageList = 12,
    /// A state was offered at a position the cache did not plan.
    NotPlanned = 13,
    /// A state position outside 1..=number of admitted tokens.
    PositionOutOfRange = 14,
    /// The same state position was given twice in one call.
    DuplicatePosition = 15,
    /// A state slot was given twice, or is already owned by the cache.
    DuplicateSlot = 16,
    /// A KV page id was given twice, or is already owned by the cache.
    DuplicatePage = 17,
    /// marconi_cache_check found a broken internal invariant (a bug).
    InvariantViolated = 18,
    /// A versioned struct's struct_size is smaller than its first version, or
    /// larger with non-zero bytes this library does not know.
    UnsupportedStructSize = 19,
    /// A pool handle is not live: 0, stale (its unit was freed and reused),
    /// of another pool, cache over pools or pool kind, or one the call does
    /// not accept (a page the cache holds for another prefix).
    UnknownHandle = 20,
    /// A pool handle was already freed (or is listed twice in one call).
    DoubleFree = 21,
    /// A pool has too few free units for the request, even after the
    /// capacity migration its configuration allows.
    OutOfMemory = 22,
    /// The operation or backend is not available in this build or on this
    /// machine (CUDA without the `cuda` feature or a driver, snapshot copies
    /// on a pool without memory, migration on a static split).
    Unsupported = 23,
    /// The memory backend failed (an operating-system or driver call).
    BackendFailure = 24,
    /// marconi_events_publish: the publisher thread is too far behind; the
    /// batch was dropped and its sequence number skipped.
    QueueFull = 25,
}

impl marconi_status {
    /// Every status, in value order. In C: the `marconi_status_ALL`
    /// initialiser, which `tests/header.rs` writes from this list
    /// (cbindgen would spell its elements with the Rust variant names).
    ///
    /// cbindgen:ignore
    pub const ALL: [marconi_status; 26] = [
        marconi_status::Ok,
        marconi_status::NullArgument,
        marconi_status::InvalidArgument,
        marconi_status::BufferTooSmall,
        marconi_status::Panic,
        marconi_status::Poisoned,
        marconi_status::InvalidConfig,
        marconi_status::UnknownPreset,
        marconi_status::EmptyTokens,
        marconi_status::TooManyTokens,
        marconi_status::UnknownLease,
        marconi_status::PrefixMismatch,
        marconi_status::BadPageList,
        marconi_status::NotPlanned,
        marconi_status::PositionOutOfRange,
        marconi_status::DuplicatePosition,
        marconi_status::DuplicateSlot,
        marconi_status::DuplicatePage,
        marconi_status::InvariantViolated,
        marconi_status::UnsupportedStructSize,
        marconi_status::UnknownHandle,
        marconi_status::DoubleFree,
        marconi_status::OutOfMemory,
        marconi_status::Unsupported,
        marconi_status::BackendFailure,
        marconi_status::QueueFull,
    ];

    /// The status with value `v`; unknown values map to `InvalidArgument`.
    pub fn from_u32(v: u32) -> marconi_status {
        Self::ALL
            .get(v as usize)
            .copied()
            .unwrap_or(marconi_status::InvalidArgument)
    }

    /// The fixed text of the status.
    pub fn message(self) -> &'static str {
        match self {
            marconi_status::Ok => "ok",
            marconi_status::NullArgument => "a required pointer is NULL",
            marconi_status::InvalidArgument => "invalid argument",
            marconi_status::BufferTooSmall => "output buffer too small",
            marconi_status::Panic => "internal panic caught at the C boundary (a libmarconi bug)",
            marconi_status::Poisoned => "cache unusable after an earlier internal panic",
            marconi_status::InvalidConfig => "invalid configuration",
            marconi_status::UnknownPreset => "unknown preset name (model or policy)",
            marconi_status::EmptyTokens => "token array is empty",
            marconi_status::TooManyTokens => "token array too long",
            marconi_status::UnknownLease => "lease is unknown or already released",
            marconi_status::PrefixMismatch => "admitted tokens do not extend the looked-up input",
            marconi_status::BadPageList => "kv page list has the wrong length",
            marconi_status::NotPlanned => "state position was not planned",
            marconi_status::PositionOutOfRange => "state position out of range",
            marconi_status::DuplicatePosition => "state position given twice",
            marconi_status::DuplicateSlot => "state slot given twice or already owned by the cache",
            marconi_status::DuplicatePage => "kv page given twice or already owned by the cache",
            marconi_status::InvariantViolated => "internal invariant violated (a libmarconi bug)",
            marconi_status::UnsupportedStructSize => "unsupported struct_size",
            marconi_status::UnknownHandle => "pool handle is not live (stale, foreign or 0)",
            marconi_status::DoubleFree => "pool handle already freed or listed twice",
            marconi_status::OutOfMemory => "pool out of free units",
            marconi_status::Unsupported => "not supported by this build, backend or machine",
            marconi_status::BackendFailure => "memory backend failed (OS or driver call)",
            marconi_status::QueueFull => "event publisher queue full: batch dropped",
        }
    }
}

/// A refused call: the status and the detail for `marconi_last_error`.
#[derive(Debug)]
pub(crate) struct FfiError {
    pub(crate) status: marconi_status,
    pub(crate) detail: String,
}

impl FfiError {
    pub(crate) fn new(status: marconi_status, detail: impl Into<String>) -> Self {
        FfiError {
            status,
            detail: detail.into(),
        }
    }
}

impl From<CacheError> for FfiError {
    fn from(e: CacheError) -> Self {
        let status = match &e {
            CacheError::InvalidConfig(_) => marconi_status::InvalidConfig,
            CacheError::EmptyTokens => marconi_status::EmptyTokens,
            CacheError::TooManyTokens { .. } => marconi_status::TooManyTokens,
            CacheError::UnknownLease(_) => marconi_status::UnknownLease,
            CacheError::PrefixMismatch { .. } => marconi_status::PrefixMismatch,
            CacheError::BadPageList { .. } => marconi_status::BadPageList,
            CacheError::NotPlanned { .. } => marconi_status::NotPlanned,
            CacheError::PositionOutOfRange { .. } => marconi_status::PositionOutOfRange,
            CacheError::DuplicatePosition(_) => marconi_status::DuplicatePosition,
            CacheError::DuplicateSlot(_) => marconi_status::DuplicateSlot,
            CacheError::DuplicatePage(_) => marconi_status::DuplicatePage,
        };
        FfiError::new(status, e.to_string())
    }
}

/// The result type of every boundary body.
pub(crate) type FfiResult<T = ()> = Result<T, FfiError>;

thread_local! {
    /// The detail of this thread's last failing call.
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// Boundary calls running on this thread: a panic while it is non-zero
    /// is caught by [`boundary`] or [`boundary_or`]. No destructor, so it is
    /// readable even during thread teardown.
    static BOUNDARY_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The panic hook's description (message and location) of this thread's
    /// latest panic inside a boundary.
    static CAUGHT_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

// Thread-locals are reached only through `try_with` and `try_borrow*`: a
// boundary call can run after this thread's thread-local destructors (from a
// C++ `thread_local` object's destructor, a pthread key destructor), where
// `with` would panic outside any `catch_unwind` and abort the host. The text
// is then dropped; the status is still returned.

/// Records `detail` as this thread's last error (dropped silently when the
/// thread-local is already destroyed).
pub(crate) fn set_last_error(detail: &str) {
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            e.clear();
            e.push_str(detail);
        }
    });
}

/// This thread's last error detail (empty once the thread-local is destroyed).
pub(crate) fn last_error() -> String {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map(|e| e.clone()).unwrap_or_default())
        .unwrap_or_default()
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_owned()
    }
}

/// The panic hook, installed once by the first boundary call.
///
/// Why a hook at all: the default hook prints every panic, caught or not, on
/// the host's stderr, and a library must not write there. Why this one is
/// safe to install: for a panic outside a boundary call (a host thread, a
/// panic this library does not catch) it calls the hook that was in place
/// before, so the host sees exactly what it saw without libmarconi. Only a
/// panic that a boundary will catch and turn into MARCONI_STATUS_PANIC is
/// kept quiet: its message and location go to the last-error text and to a
/// `tracing` error event (target "marconi"). In libmarconi.so and .a the
/// hook belongs to the library's own copy of std, so a host never sees it;
/// only a Rust program linking the rlib shares it (and may replace it).
static HOOK: Once = Once::new();

fn install_panic_hook() {
    // set_hook panics on a panicking thread; try again on a later call.
    if std::thread::panicking() {
        return;
    }
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let inside = BOUNDARY_DEPTH.try_with(|d| d.get() > 0).unwrap_or(false);
            if !inside {
                return previous(info);
            }
            let mut text = panic_text(info.payload());
            if let Some(l) = info.location() {
                text = format!("{text} (at {}:{}:{})", l.file(), l.line(), l.column());
            }
            tracing::error!(target: "marconi", panic = %text, "panic caught at the C boundary");
            let _ = CAUGHT_PANIC.try_with(|c| {
                if let Ok(mut c) = c.try_borrow_mut() {
                    *c = text;
                }
            });
        }));
    });
}

/// The last-error text of a caught panic: the hook's description (with the
/// location) when it describes this payload, else the payload's message.
fn caught_panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    let message = panic_text(&*payload);
    // A payload's Drop may itself panic; nothing may unwind from here.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
    let described = CAUGHT_PANIC
        .try_with(|c| {
            c.try_borrow_mut()
                .map(|mut c| std::mem::take(&mut *c))
                .unwrap_or_default()
        })
        .unwrap_or_default();
    if described.starts_with(&message) {
        described
    } else {
        message
    }
}

/// Runs `body` with panics caught, counting it as a boundary call so that
/// the panic hook keeps a panic inside quiet. Nothing here can panic outside
/// the `catch_unwind`.
fn catch<T>(body: impl FnOnce() -> T) -> Result<T, String> {
    let _ = BOUNDARY_DEPTH.try_with(|d| d.set(d.get().saturating_add(1)));
    let r = catch_unwind(AssertUnwindSafe(|| {
        install_panic_hook();
        body()
    }));
    let _ = BOUNDARY_DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
    r.map_err(caught_panic_text)
}

/// Runs the body of an exported function that returns a status: catches
/// panics (which become `Panic`), records the detail of a failure as the
/// thread's last error, and returns the status.
pub(crate) fn boundary(name: &str, body: impl FnOnce() -> FfiResult) -> marconi_status {
    match catch(body) {
        Ok(Ok(())) => marconi_status::Ok,
        Ok(Err(e)) => {
            set_last_error(&format!("{name}: {}", e.detail));
            e.status
        }
        Err(text) => {
            set_last_error(&format!("{name}: panic: {text}"));
            marconi_status::Panic
        }
    }
}

/// Runs the body of an exported function that cannot fail in a status:
/// a panic returns `default` (documented per function) instead of unwinding.
pub(crate) fn boundary_or<T>(name: &str, default: T, body: impl FnOnce() -> T) -> T {
    match catch(body) {
        Ok(v) => v,
        Err(text) => {
            set_last_error(&format!("{name}: panic: {text}"));
            default
        }
    }
}

/// Fails with `NullArgument` when a required pointer is NULL (`require!(p)`)
/// or a buffer is NULL with a non-zero length (`require!(p, len = n)`,
/// `require!(p, cap = n)`). Every exported function runs it on all its
/// pointers before any other check, so NULL is what a call reports whatever
/// else is wrong with it (the header's convention).
macro_rules! require {
    ($ptr:ident) => {
        if $ptr.is_null() {
            return Err($crate::status::FfiError::new(
                $crate::status::marconi_status::NullArgument,
                concat!(stringify!($ptr), " is NULL"),
            ));
        }
    };
    ($ptr:ident, len = $len:expr) => {
        if $ptr.is_null() && $len > 0 {
            return Err($crate::status::FfiError::new(
                $crate::status::marconi_status::NullArgument,
                format!(concat!(stringify!($ptr), " is NULL but length is {}"), $len),
            ));
        }
    };
    ($ptr:ident, cap = $cap:expr) => {
        if $ptr.is_null() && $cap > 0 {
            return Err($crate::status::FfiError::new(
                $crate::status::marconi_status::NullArgument,
                format!(
                    concat!(stringify!($ptr), " is NULL but its capacity is {}"),
                    $cap
                ),
            ));
        }
    };
}
pub(crate) use require;

/// Fails with `NullArgument` when a pointer argument is NULL, and with
/// `InvalidArgument` when it is not aligned for its type. Use it on every
/// pointer before dereferencing it.
macro_rules! check_ptr {
    ($ptr:ident) => {
        $crate::status::check_pointer($ptr, stringify!($ptr))?
    };
}
pub(crate) use check_ptr;

/// A required pointer argument (`what` names it): NULL is
/// MARCONI_STATUS_NULL_ARGUMENT, a pointer not aligned for `T`
/// MARCONI_STATUS_INVALID_ARGUMENT. Reads nothing behind it.
pub(crate) fn check_pointer<T>(ptr: *const T, what: &str) -> FfiResult {
    if ptr.is_null() {
        return Err(FfiError::new(
            marconi_status::NullArgument,
            format!("{what} is NULL"),
        ));
    }
    if !ptr.is_aligned() {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("{what} is not aligned for its type"),
        ));
    }
    Ok(())
}

/// The slice `ptr[..len]` after the checks: NULL is allowed only with
/// `len == 0`, the pointer must be aligned, and `len` elements must fit in
/// `isize::MAX` bytes.
///
/// # Safety
///
/// When `ptr` is not NULL, it must point to `len` readable, initialised
/// elements that nothing writes during the returned lifetime.
pub(crate) unsafe fn in_slice<'a, T>(ptr: *const T, len: usize, what: &str) -> FfiResult<&'a [T]> {
    if ptr.is_null() {
        if len == 0 {
            return Ok(&[]);
        }
        return Err(FfiError::new(
            marconi_status::NullArgument,
            format!("{what} is NULL but length is {len}"),
        ));
    }
    if !ptr.is_aligned() {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("{what} is not aligned"),
        ));
    }
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("{what} length {len} is absurd"),
        ));
    }
    // SAFETY: ptr is non-NULL and aligned, the byte size fits in isize, and
    // the caller guarantees `len` readable elements (the header's contract).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Checks an output buffer `ptr[..cap]` (NULL allowed with `cap == 0`) and
/// returns it as a mutable slice.
///
/// # Safety
///
/// When `ptr` is not NULL it must point to `cap` writable elements that
/// nothing else accesses during the returned lifetime.
pub(crate) unsafe fn out_slice<'a, T>(
    ptr: *mut T,
    cap: usize,
    what: &str,
) -> FfiResult<&'a mut [T]> {
    if ptr.is_null() {
        if cap == 0 {
            return Ok(&mut []);
        }
        return Err(FfiError::new(
            marconi_status::NullArgument,
            format!("{what} is NULL but its capacity is {cap}"),
        ));
    }
    if !ptr.is_aligned() {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("{what} is not aligned"),
        ));
    }
    if cap > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("{what} capacity {cap} is absurd"),
        ));
    }
    // SAFETY: ptr is non-NULL and aligned, the byte size fits in isize, and
    // the caller guarantees `cap` writable elements (the header's contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, cap) })
}

/// Writes a versioned output struct for a caller that knows its first
/// `size` bytes (an older, shorter version of it, or all of it): the first
/// `min(size, size_of::<T>())` bytes of `value`. Every struct written this
/// way is plain data whose versions only ever append fields.
///
/// # Safety
///
/// `out` is non-NULL and has `size` writable bytes (callers check `size`
/// against the struct's first version before calling).
pub(crate) unsafe fn write_versioned<T: Copy>(value: &T, out: *mut T, size: usize) {
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `value` has size_of::<T>() >= n readable bytes, `out` has
    // size >= n writable ones (caller contract); a local value and the
    // caller's memory do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::from_ref(value).cast::<u8>(), out.cast::<u8>(), n);
    }
}

/// A versioned input struct of the ABI (configs, options, requests):
/// plain data that starts with its u32 struct_size and whose versions only
/// append fields. [`init_struct`] is the body of its `marconi_<x>_init`,
/// [`read_struct`] reads a caller's into this library's layout.
///
/// # Safety
///
/// `Self` is `repr(C)` plain data (any bit pattern of its fields is valid)
/// whose first field is its u32 struct_size.
pub(crate) unsafe trait Versioned: Copy {
    /// The first version's size: the smallest struct_size accepted.
    const FIRST: usize;
    /// The C type name, for refusals.
    const NAME: &'static str;
    /// What `marconi_<x>_init` writes.
    fn initial() -> Self;
}

/// Implements [`Versioned`] for `$ty` (whose `defaults()` is what init
/// writes), with first version size `$first`.
macro_rules! versioned {
    ($ty:ident, $first:expr) => {
        // SAFETY: a repr(C) plain-data ABI struct starting with its u32
        // struct_size (checked by the struct's definition and the header test).
        unsafe impl $crate::status::Versioned for $ty {
            const FIRST: usize = $first;
            const NAME: &'static str = stringify!($ty);
            fn initial() -> Self {
                <$ty>::defaults()
            }
        }
    };
}
pub(crate) use versioned;

/// Fills the caller's `*p` of `struct_size` bytes with [`Versioned::initial`] and sets
/// its struct_size, so that a caller compiled against any released header
/// can initialise the struct it has: an older (shorter) struct gets its
/// first `struct_size` bytes, a newer (longer) one our fields and zeros
/// past them ("not set"). `what` names the argument. NULL is
/// MARCONI_STATUS_NULL_ARGUMENT, a struct_size below the first version's
/// MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE, and nothing is written.
///
/// # Safety
///
/// `p` is NULL or points to `struct_size` writable bytes.
pub(crate) unsafe fn init_struct<T: Versioned>(
    p: *mut T,
    struct_size: usize,
    what: &str,
) -> FfiResult<()> {
    // SAFETY: forwarded contract.
    unsafe { init_struct_as(p, struct_size, T::initial(), what) }
}

/// [`init_struct`] with `value` instead of [`Versioned::initial`] (a
/// preset).
///
/// # Safety
///
/// As [`init_struct`].
pub(crate) unsafe fn init_struct_as<T: Versioned>(
    p: *mut T,
    struct_size: usize,
    value: T,
    what: &str,
) -> FfiResult<()> {
    check_pointer(p, what)?;
    if struct_size < T::FIRST || struct_size > u32::MAX as usize {
        return Err(FfiError::new(
            marconi_status::UnsupportedStructSize,
            format!(
                "struct_size {struct_size}: {} is {} bytes in its first version and {} in this library",
                T::NAME,
                T::FIRST,
                std::mem::size_of::<T>()
            ),
        ));
    }
    let mut d = value;
    // SAFETY: T starts with its u32 struct_size (trait contract).
    unsafe {
        std::ptr::addr_of_mut!(d)
            .cast::<u32>()
            .write(struct_size as u32)
    };
    let ours = std::mem::size_of::<T>();
    let n = struct_size.min(ours);
    // SAFETY: p is non-NULL and aligned (checked) with struct_size writable
    // bytes (contract), n <= struct_size and n <= ours; a local value and
    // the caller's memory do not overlap. A newer caller's bytes past ours
    // are zeroed ("not set").
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::from_ref(&d).cast::<u8>(), p.cast::<u8>(), n);
        if struct_size > ours {
            std::ptr::write_bytes(p.cast::<u8>().add(ours), 0, struct_size - ours);
        }
    }
    Ok(())
}

/// Reads the caller's `*p` into this library's layout: a struct_size below
/// the first version's is refused, a larger one only when the bytes past
/// ours are zero, an older (smaller) one is read over [`Versioned::initial`].
///
/// # Safety
///
/// `p` is non-NULL, aligned, and points to its struct_size readable bytes.
pub(crate) unsafe fn read_struct<T: Versioned>(p: *const T) -> FfiResult<T> {
    let (min, what) = (T::FIRST, T::NAME);
    // SAFETY: p is non-NULL and aligned and starts with its u32 size (trait).
    let size = unsafe { p.cast::<u32>().read() } as usize;
    let ours = std::mem::size_of::<T>();
    if size < min {
        return Err(FfiError::new(
            marconi_status::UnsupportedStructSize,
            format!("{what} struct_size is {size}, smaller than the first version ({min})"),
        ));
    }
    if size > ours {
        // SAFETY: the caller's struct has `size` readable bytes.
        let extra = unsafe { std::slice::from_raw_parts(p.cast::<u8>().add(ours), size - ours) };
        if extra.iter().any(|&b| b != 0) {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("{what} struct_size is {size} and sets fields this library ({ours} bytes) does not know"),
            ));
        }
        // SAFETY: size > ours, so a whole current struct is readable.
        return Ok(unsafe { p.read() });
    }
    let mut out = T::initial();
    // SAFETY: the caller's struct has `size` <= ours readable bytes; out has
    // ours writable ones; plain data (trait).
    unsafe {
        std::ptr::copy_nonoverlapping(
            p.cast::<u8>(),
            std::ptr::addr_of_mut!(out).cast::<u8>(),
            size,
        );
    }
    Ok(out)
}

/// Copies `text` into `buf[..cap]` as a NUL-terminated string, truncated to
/// `cap - 1` bytes (nothing is written when `cap` is 0 or `buf` is NULL), and
/// returns the full length of `text` without the NUL, as `snprintf` does.
///
/// # Safety
///
/// When `buf` is not NULL it must point to `cap` writable bytes.
pub(crate) unsafe fn write_c_string(text: &str, buf: *mut c_char, cap: usize) -> usize {
    if !buf.is_null() && cap > 0 {
        let n = text.len().min(cap - 1);
        // SAFETY: buf has `cap` writable bytes (caller contract) and n + 1 <= cap;
        // text and buf cannot overlap (text is Rust-owned).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
            buf.add(n).write(0);
        }
    }
    text.len()
}

/// Copies `list` into `buf` and writes its length to `*out_len`, or, when
/// `buf` is too small, writes only the length and fails with
/// `BufferTooSmall` (the drains' and lease lists' all-or-nothing rule).
/// `out_len` was checked non-NULL and aligned by the caller.
pub(crate) fn copy_list<T: Copy>(list: &[T], buf: &mut [T], out_len: *mut usize) -> FfiResult {
    // SAFETY: non-NULL and aligned (the caller's check), writable by the
    // caller's contract.
    unsafe { out_len.write(list.len()) };
    if buf.len() < list.len() {
        return Err(FfiError::new(
            marconi_status::BufferTooSmall,
            format!("buffer holds {} ids, {} needed", buf.len(), list.len()),
        ));
    }
    buf[..list.len()].copy_from_slice(list);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_round_trips_and_unknown_values_are_invalid_argument() {
        for (i, s) in marconi_status::ALL.iter().enumerate() {
            assert_eq!(*s as u32, i as u32);
            assert_eq!(marconi_status::from_u32(i as u32), *s);
        }
        assert_eq!(
            marconi_status::from_u32(9999),
            marconi_status::InvalidArgument
        );
    }

    #[test]
    fn boundary_turns_errors_and_panics_into_statuses() {
        let st = boundary("f", || Err(FfiError::from(CacheError::UnknownLease(7))));
        assert_eq!(st, marconi_status::UnknownLease);
        assert_eq!(last_error(), "f: lease 7 is unknown or already released");
        assert_eq!(boundary("g", || Ok(())), marconi_status::Ok);
        assert_eq!(
            last_error(),
            "f: lease 7 is unknown or already released",
            "success keeps it"
        );
        let st = boundary("h", || panic!("boom {}", 1));
        assert_eq!(st, marconi_status::Panic);
        let e = last_error();
        assert!(e.starts_with("h: panic: boom 1 (at "), "{e}");
        assert!(e.contains("status.rs:"), "the panic's location: {e}");
        assert_eq!(boundary_or("i", 42usize, || panic!("x")), 42);
        assert!(last_error().starts_with("i: panic: x (at "));
    }

    /// A panic caught at the boundary prints nothing on the host's stderr (its
    /// text goes to the last error); a panic elsewhere still reaches the
    /// hook that was there before. Runs itself in a child process, whose
    /// stderr is the real one.
    #[test]
    #[cfg_attr(miri, ignore = "starts a child process")]
    fn caught_panics_are_quiet_and_others_are_not() {
        const NAME: &str = "status::tests::caught_panics_are_quiet_and_others_are_not";
        if std::env::var_os("MARCONI_PANIC_CHILD").is_some() {
            assert_eq!(boundary("q", || panic!("SILENT-1")), marconi_status::Panic);
            assert!(last_error().starts_with("q: panic: SILENT-1 (at "));
            assert_eq!(boundary_or("r", 1u8, || panic!("SILENT-2")), 1);
            let loud = std::thread::spawn(|| panic!("loud boom")).join();
            assert!(loud.is_err());
            return;
        }
        let exe = std::env::current_exe().expect("test binary");
        let out = std::process::Command::new(exe)
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env("MARCONI_PANIC_CHILD", "1")
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child failed: {stderr}");
        assert!(
            !stderr.contains("SILENT"),
            "a caught panic printed: {stderr}"
        );
        assert!(
            stderr.contains("loud boom"),
            "the previous hook is chained: {stderr}"
        );
    }

    #[test]
    fn null_and_length_checks() {
        // SAFETY: NULL pointers are never dereferenced by in_slice.
        let e = unsafe { in_slice::<u32>(std::ptr::null(), 12, "tokens") }.unwrap_err();
        assert_eq!(e.status, marconi_status::NullArgument);
        assert_eq!(e.detail, "tokens is NULL but length is 12");
        // SAFETY: as above.
        assert!(
            unsafe { in_slice::<u32>(std::ptr::null(), 0, "tokens") }.is_ok_and(|s| s.is_empty())
        );
        let x = [1u32];
        // SAFETY: the absurd length is refused before a slice is formed.
        let e = unsafe { in_slice(x.as_ptr(), usize::MAX, "tokens") }.unwrap_err();
        assert_eq!(e.status, marconi_status::InvalidArgument);
        let mut buf = [0x55 as c_char; 4];
        // SAFETY: buf has 4 writable bytes.
        let n = unsafe { write_c_string("hello", buf.as_mut_ptr(), 4) };
        assert_eq!(
            (n, buf),
            (5, [b'h' as c_char, b'e' as c_char, b'l' as c_char, 0])
        );
    }
}
