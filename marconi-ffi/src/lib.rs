//! # marconi-ffi
//!
//! The stable C ABI of libmarconi, built as `libmarconi.so` and
//! `libmarconi.a`; the header is `include/marconi.h`, generated from this
//! crate by a pinned cbindgen (see `tests/header.rs`).
//!
//! Every exported function runs its body through [`status`]'s boundary: a
//! panic becomes `MARCONI_STATUS_PANIC`, every pointer is checked for NULL and
//! alignment before use, slices are formed only after the NULL and length
//! checks, and the detail of a failure is kept as the thread's last error
//! (`marconi_last_error`). The calling convention is written in the header's
//! preamble (`cbindgen.toml`), once: its memory rules are the safety
//! contract of every exported function, whose own `# Safety` section (a
//! few have one) says only what differs.
//!
//! A cache handle holds the core `PrefixCache` behind a `Mutex`, so engine
//! threads may share it. Lease ids are drawn once from a process-wide
//! sequence that never wraps, and a cache accepts only the ids it issued and
//! has not seen released, so a lease of a freed or different cache is refused.
#![expect(
    non_camel_case_types,
    reason = "C type names (marconi_cache, marconi_status, ...) are the ABI"
)]
#![expect(
    clippy::missing_safety_doc,
    reason = "the header's preamble states the one memory contract of every exported function"
)]

use std::ffi::c_char;

pub mod cache;
pub mod config;
pub mod cycle;
pub mod events;
pub mod gguf;
mod handle;
pub mod hf_config;
pub mod host_pool;
pub mod lookup;
pub mod plan;
pub mod pml;
pub mod pml_cache;
pub mod pool;
pub mod pooled;
pub mod status;
pub mod store;
pub mod tiered;

pub use cache::{
    marconi_admit_result, marconi_cache, marconi_copy_order, marconi_lookup, marconi_saved_state,
    marconi_stats, MARCONI_NO_SLOT,
};
pub use config::{
    marconi_admission, marconi_alpha_mode, marconi_cache_config, marconi_eviction,
    marconi_model_spec, marconi_tuning_objective,
};
pub use events::{
    marconi_event_layout, marconi_events, marconi_events_config, marconi_hash_format,
    MARCONI_NO_SEQ,
};
pub use host_pool::{
    marconi_host_pool, marconi_host_pool_config, marconi_host_pool_stats, marconi_unit_move,
};
pub use plan::{marconi_converged_split, marconi_memory_plan, marconi_plan_request};
pub use pml::{
    marconi_pml_error, marconi_pml_schema, marconi_pml_segment, marconi_pml_segment_kind,
    marconi_pml_tokenize_fn,
};
pub use pml_cache::{
    marconi_pml_cache, marconi_pml_cache_config, marconi_pml_cache_stats, marconi_pml_reuse_mode,
    marconi_pml_served, marconi_pml_served_how, MARCONI_PML_MAX_SEGMENTS,
};
pub use pool::{
    marconi_migration, marconi_pool, marconi_pool_backend, marconi_pool_config, marconi_pool_kind,
    marconi_pool_migration, marconi_pool_stats, marconi_promote_mode, marconi_state_buffer,
    marconi_unit_location,
};
pub use pooled::{marconi_pooled_cache, marconi_pooled_lookup, marconi_pooled_stats};
pub use status::marconi_status;
pub use store::{
    marconi_store, marconi_store_backend, marconi_store_config, marconi_store_delete_fn,
    marconi_store_exists_fn, marconi_store_get_fn, marconi_store_put_fn, marconi_store_stats,
    MARCONI_STORE_CB_ABSENT, MARCONI_STORE_CB_OK, MARCONI_STORE_CB_TOO_SMALL,
};
pub use tiered::{
    marconi_load_kind, marconi_load_order, marconi_tier, marconi_tier_op, marconi_tier_op_kind,
    marconi_tier_spec, marconi_tier_write, marconi_tiered, marconi_tiered_config,
    marconi_tiered_hit, marconi_tiered_stats,
};

/// The library version, "MAJOR.MINOR.PATCH", NUL-terminated, from Cargo.toml.
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The library version as a static NUL-terminated string ("0.2.0"); equals
/// MARCONI_VERSION_STRING of the header the library was built with. Never
/// NULL; the caller must not free it.
#[no_mangle]
pub extern "C" fn marconi_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

/// Writes the fixed text of `status` into `buf` as a NUL-terminated string
/// truncated to `cap - 1` bytes, and returns the full length of the text
/// (without the NUL), as snprintf does: NULL with cap 0 asks for the length.
/// Unknown values give the text of MARCONI_STATUS_INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn marconi_status_message(
    status: u32,
    buf: *mut c_char,
    cap: usize,
) -> usize {
    status::boundary_or("marconi_status_message", 0, || {
        let text = marconi_status::from_u32(status).message();
        // SAFETY: buf is NULL or has cap writable bytes (caller contract).
        unsafe { status::write_c_string(text, buf, cap) }
    })
}

/// Writes the detail of the most recent failing call made by this thread
/// (e.g. "marconi_cache_lookup: tokens is NULL but length is 12") into `buf`,
/// with the same truncation and return value as marconi_status_message.
/// Successful calls leave it unchanged; it is empty before the first failure.
///
/// Thread safety: each thread has its own last error.
#[no_mangle]
pub unsafe extern "C" fn marconi_last_error(buf: *mut c_char, cap: usize) -> usize {
    status::boundary_or("marconi_last_error", 0, || {
        let text = status::last_error();
        // SAFETY: buf is NULL or has cap writable bytes (caller contract).
        unsafe { status::write_c_string(&text, buf, cap) }
    })
}
