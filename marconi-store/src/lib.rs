//! # marconi-store
//!
//! The store tier of libmarconi: the part that moves bytes (KV blocks and
//! recurrent states) to and from a store an operator already runs, while
//! the decisions (which entry lives where) stay in marconi-core.
//!
//! Three layers:
//!
//! - [`Store`]: a raw object store with batch operations, every call
//!   bounded by a timeout, errors typed ([`StoreError`]). Backends:
//!   [`DirStore`] (a local directory), [`RedisStore`] (Redis or Valkey),
//!   [`CallbackStore`] (the engine's own store through closures or, from
//!   C, function pointers).
//! - [`Keyer`]: object names from the chained block hashes vLLM's events
//!   use (`sha256_cbor`, marconi-events), the model/layout fingerprint and
//!   a namespace, so two engines of one model share entries and two models
//!   never do.
//! - [`StoreTier`]: a store plus a keyer, writing every value in an
//!   [`envelope`] (magic, versions, fingerprint, key, length, checksum) and
//!   reading nothing it has not verified. A store that is down, slow,
//!   emptied or that returns garbage gives misses, counted by kind
//!   ([`StoreStats`]), never a wrong value and never a call that outlasts
//!   its timeout by more than one operation's bound.
#![forbid(unsafe_code)]

mod callback;
mod dir;
pub mod envelope;
mod error;
mod key;
mod redis_store;
mod resp;
mod tier;

pub use callback::{CallbackStore, Callbacks, DeleteFn, ExistsFn, GetFn, PutFn};
pub use dir::DirStore;
pub use error::{ConfigError, StoreError};
pub use key::{Fingerprint, KeyKind, Keyer, KeyerConfig, StoreKey};
pub use redis_store::{RedisConfig, RedisStore};
pub use tier::{Lookup, MissKind, Payload, StoreStats, StoreTier, TierConfig};

use std::time::Duration;

/// What a store returned for one object of a [`Store::batch_get`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fetched {
    /// No object under that name.
    Absent,
    /// The object's bytes (at most the call's `max_bytes`).
    Value(Vec<u8>),
    /// The object is larger than the call's `max_bytes`; it was not read.
    Oversized,
    /// The name exists but is not a plain object (a directory, a symlink, a
    /// FIFO, a Redis list...); it was not read.
    NotRegular,
}

/// A raw object store: names to bytes, in batches.
///
/// Contract for implementors: every call returns within about
/// [`Store::timeout`] (a backend that cannot interrupt an operation checks
/// its deadline between operations and documents the bound of one); a
/// store that is down or slow returns an error quickly rather than waiting
/// for it; `batch_get` never returns more than `max_bytes` bytes for one
/// object; results are in the order of the names. A failed call has no
/// partial result (a `batch_put` may have stored some of its objects).
/// Names are made of `[A-Za-z0-9._:-]` and never start with a dot (what
/// [`Keyer`] writes); stores may refuse others with
/// [`StoreError::Invalid`].
pub trait Store: Send + Sync {
    /// A short name of the backend ("dir", "redis", "callback").
    fn kind(&self) -> &'static str;
    /// The bound of one call.
    fn timeout(&self) -> Duration;
    /// Whether each name has an object.
    fn batch_exists(&self, names: &[&str]) -> Result<Vec<bool>, StoreError>;
    /// The objects under `names`, none read past `max_bytes`.
    fn batch_get(&self, names: &[&str], max_bytes: usize) -> Result<Vec<Fetched>, StoreError>;
    /// Stores each `(name, bytes)`, replacing what was there.
    fn batch_put(&self, items: &[(&str, &[u8])]) -> Result<(), StoreError>;
    /// Stores each `(name, [head, body])` as the object `head ++ body`.
    /// The default joins the parts and calls [`Store::batch_put`]; a store
    /// that can write them one after the other without the copy (a file)
    /// overrides it.
    fn batch_put_parts(&self, items: &[(&str, [&[u8]; 2])]) -> Result<(), StoreError> {
        let joined: Vec<Vec<u8>> = items.iter().map(|(_, p)| p.concat()).collect();
        let refs: Vec<(&str, &[u8])> = items
            .iter()
            .zip(&joined)
            .map(|((n, _), b)| (*n, b.as_slice()))
            .collect();
        self.batch_put(&refs)
    }
    /// Removes the objects under `names` (absent names are not an error).
    fn delete(&self, names: &[&str]) -> Result<(), StoreError>;
}

/// Whether `name` is a valid object name (see [`Store`]).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 512
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// Refuses a batch that has an invalid name.
pub(crate) fn check_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), StoreError> {
    for n in names {
        if !valid_name(n) {
            return Err(StoreError::Invalid(format!("object name {n:?}")));
        }
    }
    Ok(())
}
