//! The one handle check: every handle the library hands out (cache, pool,
//! host pool, store, events, prompt schema, module store) is a boxed value
//! registered in a process-wide table of live handles while it lives. A
//! pointer is dereferenced only once the table holds it with the expected
//! kind, so a handle of another kind (a pool passed as a cache), a freed
//! one, or a pointer to anything else is refused with `InvalidArgument`
//! without a byte of it being read.
//!
//! A handle type implements [`Handle`] (with [`handle_kind!`]); creating,
//! checking and freeing are [`publish`], [`borrow`] and [`release`].

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::{PoisonError, RwLock};

use crate::status::{check_pointer, marconi_status, FfiError, FfiResult};

/// The kind of a live handle, as the registry records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Cache,
    Events,
    Pool,
    HostPool,
    PmlSchema,
    PmlCache,
    Store,
}

/// A type the library hands to C as an opaque pointer.
///
/// # Safety
///
/// `KIND` is this type's alone: the registry's kind is what makes a
/// pointer to it safe to dereference as `Self`.
pub(crate) unsafe trait Handle: Sized + Sync {
    /// The registry's kind for this type.
    const KIND: Kind;
    /// The C type name, for refusals ("cache is not a marconi_cache handle").
    const NAME: &'static str;
}

/// Implements [`Handle`] for `$ty` with kind `$kind` and C name `$name`.
macro_rules! handle_kind {
    ($ty:ty, $kind:ident, $name:literal) => {
        // SAFETY: each kind is named by exactly one type (one invocation a kind).
        unsafe impl $crate::handle::Handle for $ty {
            const KIND: $crate::handle::Kind = $crate::handle::Kind::$kind;
            const NAME: &'static str = $name;
        }
    };
}
pub(crate) use handle_kind;

/// Hashes a handle address: addresses are distinct, so a multiply spreads
/// them (the low bits are alignment).
#[derive(Default)]
struct AddrHasher(u64);

impl std::hash::Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64 >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type LiveShard = RwLock<HashMap<usize, Kind, BuildHasherDefault<AddrHasher>>>;

/// Shards of the registry (a call reads one shard's lock: threads working
/// on different handles rarely meet).
const SHARDS: usize = 16;

static LIVE: [LiveShard; SHARDS] =
    [const { RwLock::new(HashMap::with_hasher(BuildHasherDefault::new())) }; SHARDS];

fn shard(addr: usize) -> &'static LiveShard {
    &LIVE[(addr >> 4) % SHARDS]
}

/// Boxes `value`, registers it and writes the pointer to `*out`.
///
/// # Safety
///
/// `out` is non-NULL, aligned and writable.
pub(crate) unsafe fn publish<H: Handle>(value: H, out: *mut *mut H) {
    let raw = Box::into_raw(Box::new(value));
    shard(raw as usize)
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(raw as usize, H::KIND);
    // SAFETY: the caller's contract.
    unsafe { out.write(raw) };
}

/// Checks `ptr` (`what` names the argument): NULL is `NullArgument`, a
/// misaligned pointer or one the registry does not hold as a live `H` is
/// `InvalidArgument`, and nothing behind it is read; then borrows it.
///
/// # Safety
///
/// None beyond the caller not freeing the handle while the borrow lives
/// (the calls' contract: no call runs concurrently with a free).
pub(crate) unsafe fn borrow<'a, H: Handle>(ptr: *const H, what: &str) -> FfiResult<&'a H> {
    check_pointer(ptr, what)?;
    let found = shard(ptr as usize)
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&(ptr as usize))
        .copied();
    if found != Some(H::KIND) {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!(
                "{what} is not a {} handle (another kind of handle, a freed one, or not a handle)",
                H::NAME
            ),
        ));
    }
    // SAFETY: a live handle of this type (registered by `publish`, not yet
    // released); only shared references are formed (handles are Sync).
    Ok(unsafe { &*ptr })
}

/// Unregisters and frees a handle from [`publish`]. False, and nothing read
/// or freed, for NULL or anything the registry does not hold as a live `H`
/// (freed already, of another kind, foreign).
///
/// # Safety
///
/// No other call on the handle runs during or after this one.
pub(crate) unsafe fn release<H: Handle>(ptr: *mut H) -> bool {
    let addr = ptr as usize;
    if ptr.is_null() || !ptr.is_aligned() {
        return false;
    }
    {
        let mut live = shard(addr).write().unwrap_or_else(PoisonError::into_inner);
        if live.get(&addr) != Some(&H::KIND) {
            return false;
        }
        live.remove(&addr);
    }
    // SAFETY: it was live: from Box::into_raw in `publish`, and no longer
    // registered, so freed once.
    drop(unsafe { Box::from_raw(ptr) });
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Thing(#[expect(dead_code, reason = "gives the box a size")] u64);
    handle_kind!(Thing, Store, "thing");
    struct Other(#[expect(dead_code, reason = "gives the box a size")] u64);
    handle_kind!(Other, Events, "other");

    #[test]
    fn a_handle_is_live_from_publish_to_release() {
        let mut out: *mut Thing = std::ptr::null_mut();
        // SAFETY: out is a local.
        unsafe { publish(Thing(7), &mut out) };
        // SAFETY: live.
        assert!(unsafe { borrow(out, "thing") }.is_ok());
        let e = unsafe { borrow(out.cast::<Other>(), "other") }
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.status, marconi_status::InvalidArgument);
        assert!(e.detail.contains("is not a other handle"), "{}", e.detail);
        // Another kind's release leaves it alone.
        assert!(!unsafe { release(out.cast::<Other>()) });
        assert!(unsafe { release(out) });
        // Freed: refused without being read, and not freed twice.
        let e = unsafe { borrow(out, "thing") }.map(|_| ()).unwrap_err();
        assert_eq!(e.status, marconi_status::InvalidArgument);
        assert!(!unsafe { release(out) });
        let e = unsafe { borrow(std::ptr::null::<Thing>(), "thing") }
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.status, marconi_status::NullArgument);
        assert!(!unsafe { release(std::ptr::null_mut::<Thing>()) });
    }
}
