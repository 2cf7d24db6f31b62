//! A store the engine provides: closures (or, through the C ABI, function
//! pointers) over its own storage (LMCache, SGLang HiCache storage...).

use std::time::{Duration, Instant};

use crate::error::StoreError;
use crate::{check_names, Fetched, Store};

/// `get(name, max_bytes)`: the object, read no further than `max_bytes`.
pub type GetFn = dyn Fn(&str, usize) -> Result<Fetched, StoreError> + Send + Sync;
/// `put(name, bytes)`.
pub type PutFn = dyn Fn(&str, &[u8]) -> Result<(), StoreError> + Send + Sync;
/// `exists(name)`.
pub type ExistsFn = dyn Fn(&str) -> Result<bool, StoreError> + Send + Sync;
/// `delete(name)` (an absent name is not an error).
pub type DeleteFn = dyn Fn(&str) -> Result<(), StoreError> + Send + Sync;

/// The engine's operations on one object each.
pub struct Callbacks {
    /// Reads one object.
    pub get: Box<GetFn>,
    /// Writes one object.
    pub put: Box<PutFn>,
    /// Whether one object exists.
    pub exists: Box<ExistsFn>,
    /// Removes one object.
    pub delete: Box<DeleteFn>,
}

/// A store over [`Callbacks`], called once per object in batch order.
///
/// Bound: the deadline is checked before each callback; a batch that runs
/// past it fails with [`StoreError::Timeout`] (its objects read as misses).
/// A callback itself cannot be interrupted, so each must bound its own
/// time (the engine's store client usually has a timeout of its own).
pub struct CallbackStore {
    cb: Callbacks,
    timeout: Duration,
}

impl std::fmt::Debug for CallbackStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallbackStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl CallbackStore {
    /// A store over `cb` whose batches are bounded by `timeout`.
    pub fn new(cb: Callbacks, timeout: Duration) -> CallbackStore {
        CallbackStore { cb, timeout }
    }

    fn each<T>(
        &self,
        n: usize,
        mut f: impl FnMut(usize) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        let start = Instant::now();
        (0..n)
            .map(|i| {
                if start.elapsed() > self.timeout {
                    return Err(StoreError::Timeout(self.timeout));
                }
                f(i)
            })
            .collect()
    }
}

impl Store for CallbackStore {
    fn kind(&self) -> &'static str {
        "callback"
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn batch_exists(&self, names: &[&str]) -> Result<Vec<bool>, StoreError> {
        check_names(names.iter().copied())?;
        self.each(names.len(), |i| (self.cb.exists)(names[i]))
    }

    fn batch_get(&self, names: &[&str], max_bytes: usize) -> Result<Vec<Fetched>, StoreError> {
        check_names(names.iter().copied())?;
        self.each(names.len(), |i| {
            let r = (self.cb.get)(names[i], max_bytes)?;
            // The bound holds whatever the engine's callback returned.
            Ok(match r {
                Fetched::Value(v) if v.len() > max_bytes => Fetched::Oversized,
                r => r,
            })
        })
    }

    fn batch_put(&self, items: &[(&str, &[u8])]) -> Result<(), StoreError> {
        check_names(items.iter().map(|(n, _)| *n))?;
        self.each(items.len(), |i| (self.cb.put)(items[i].0, items[i].1))
            .map(drop)
    }

    fn delete(&self, names: &[&str]) -> Result<(), StoreError> {
        check_names(names.iter().copied())?;
        self.each(names.len(), |i| (self.cb.delete)(names[i]))
            .map(drop)
    }
}
