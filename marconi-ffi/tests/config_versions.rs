//! Versioned configs: a caller compiled against the first version of a
//! config struct initialises it with `..._config_init(&cfg, sizeof cfg)`
//! (its own, smaller size) and `..._new` reads it. Nothing past the
//! caller's struct is written; a size below the first version's is
//! refused by both.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::mem::{offset_of, size_of};
use std::ptr;

use marconi::config::*;
use marconi::events::*;
use marconi::status::marconi_status;
use marconi::store::*;
use marconi::tiered::*;

/// A caller's struct of `size` bytes in a larger, canary-filled buffer
/// (aligned like `T`).
struct Caller<T> {
    buf: Vec<u64>,
    size: usize,
    _t: std::marker::PhantomData<T>,
}

const CANARY: u8 = 0xA5;

impl<T> Caller<T> {
    fn new(size: usize) -> Self {
        let words = (size_of::<T>() + 64) / 8 + 1;
        let mut buf = vec![0u64; words];
        // SAFETY: the Vec owns words * 8 bytes.
        unsafe { ptr::write_bytes(buf.as_mut_ptr().cast::<u8>(), CANARY, words * 8) };
        Caller {
            buf,
            size,
            _t: std::marker::PhantomData,
        }
    }

    fn ptr(&mut self) -> *mut T {
        self.buf.as_mut_ptr().cast()
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the Vec owns len * 8 initialised bytes.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast(), self.buf.len() * 8) }
    }

    /// Nothing past the caller's struct was written.
    fn untouched_past(&self) -> bool {
        self.bytes()[self.size..].iter().all(|&b| b == CANARY)
    }

    fn struct_size(&self) -> u32 {
        u32::from_ne_bytes(self.bytes()[..4].try_into().unwrap())
    }

    /// The struct as this library sees it: the caller's bytes, then the
    /// rest zeroed (what a C caller's smaller struct is).
    fn widened(&self) -> T
    where
        T: Copy,
    {
        let mut out = vec![0u64; size_of::<T>().div_ceil(8)];
        // SAFETY: both buffers hold at least `size` bytes; T is plain data.
        unsafe {
            ptr::copy_nonoverlapping(
                self.buf.as_ptr().cast::<u8>(),
                out.as_mut_ptr().cast::<u8>(),
                self.size,
            );
            out.as_ptr().cast::<T>().read()
        }
    }
}

mod common;
use common::{init, ok};

#[test]
fn a_first_version_tiered_config_is_initialised_and_read() {
    let first = offset_of!(marconi_tiered_config, exclusive);
    let mut c = Caller::<marconi_tiered_config>::new(first);
    // SAFETY: c holds more than `first` writable bytes.
    ok(unsafe { marconi_tiered_config_init(c.ptr(), first) });
    assert!(
        c.untouched_past(),
        "config_init wrote past the caller's struct"
    );
    assert_eq!(c.struct_size() as usize, first);
    let mut dev = init(marconi_cache_config_init);
    dev.capacity_bytes = 1 << 40;
    let mut cfg = c.widened();
    cfg.device = &dev;
    cfg.host.capacity_bytes = 1 << 41;
    let mut t = ptr::null_mut();
    // SAFETY: cfg's first `first` bytes are the caller's (struct_size says so).
    ok(unsafe { marconi_tiered_new(&cfg, &mut t) });
    // SAFETY: from marconi_tiered_new.
    unsafe { marconi_tiered_free(t) };

    let mut small = Caller::<marconi_tiered_config>::new(first - 1);
    // SAFETY: small holds more than first - 1 writable bytes.
    let st = unsafe { marconi_tiered_config_init(small.ptr(), first - 1) };
    assert_eq!(st, marconi_status::UnsupportedStructSize);
    assert!(
        small.bytes().iter().all(|&b| b == CANARY),
        "a refused init wrote"
    );
}

/// A struct whose first version is its whole size: `init` takes that
/// size, writing nothing past it, and refuses one byte less.
fn takes_its_first_version<T>(init: unsafe extern "C" fn(*mut T, usize) -> marconi_status) {
    let first = size_of::<T>();
    let mut c = Caller::<T>::new(first);
    // SAFETY: c holds more than `first` writable bytes.
    ok(unsafe { init(c.ptr(), first) });
    assert!(c.untouched_past());
    // SAFETY: as above.
    let st = unsafe { init(c.ptr(), first - 1) };
    assert_eq!(st, marconi_status::UnsupportedStructSize);
}

#[test]
fn store_and_events_configs_take_their_first_version() {
    takes_its_first_version(marconi_store_config_init);
    takes_its_first_version(marconi_events_config_init);
}

#[test]
fn a_newer_callers_tail_is_zeroed() {
    let ours = size_of::<marconi_tiered_config>();
    let mut c = Caller::<marconi_tiered_config>::new(ours + 16);
    // SAFETY: c holds ours + 16 writable bytes and more.
    ok(unsafe { marconi_tiered_config_init(c.ptr(), ours + 16) });
    assert!(c.bytes()[ours..ours + 16].iter().all(|&b| b == 0));
    assert!(c.untouched_past());
}
