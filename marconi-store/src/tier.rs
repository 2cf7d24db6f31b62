//! A store plus a keyer: values in envelopes, read only once verified.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::envelope::{self, Expect, Refusal, HEADER_LEN};
use crate::error::{ConfigError, StoreError};
use crate::key::{Keyer, KeyerConfig, StoreKey};
use crate::{valid_name, Fetched, Store};

/// How a tier names and bounds its values.
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// How keys are made (model fingerprint, block size, namespace...).
    pub keyer: KeyerConfig,
    /// Prepended to every object name (`[A-Za-z0-9._:-]`, not starting
    /// with a dot). Default `"marconi-"`.
    pub prefix: String,
    /// The largest payload read or written; a larger object is a miss and
    /// is not read. Default 256 MiB.
    pub max_value_bytes: usize,
}

impl TierConfig {
    /// The defaults for `model` with blocks of `block_size` tokens.
    pub fn new(model: &str, block_size: usize) -> Self {
        TierConfig {
            keyer: KeyerConfig::new(model, block_size),
            prefix: "marconi-".into(),
            max_value_bytes: 256 << 20,
        }
    }
}

/// Why a value was not returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MissKind {
    /// No object under the key (never written, evicted, store emptied).
    Absent,
    /// Shorter than its envelope says.
    Truncated,
    /// Failed its magic or checksum.
    Corrupt,
    /// Another envelope format or value layout version.
    Version,
    /// Written by another model or layout.
    ForeignModel,
    /// Written under another key (copied or swapped).
    WrongKey,
    /// Larger than `max_value_bytes`, or a KV block of the wrong size.
    Oversized,
    /// Not a plain object (directory, symlink, FIFO, another Redis type).
    NotRegular,
    /// The store call timed out.
    Timeout,
    /// The store could not be reached.
    Unavailable,
    /// The store answered with an error.
    Failed,
}

impl MissKind {
    /// Every kind, in [`StoreStats`] field order.
    pub const ALL: [MissKind; 11] = [
        MissKind::Absent,
        MissKind::Truncated,
        MissKind::Corrupt,
        MissKind::Version,
        MissKind::ForeignModel,
        MissKind::WrongKey,
        MissKind::Oversized,
        MissKind::NotRegular,
        MissKind::Timeout,
        MissKind::Unavailable,
        MissKind::Failed,
    ];

    fn of_error(e: &StoreError) -> MissKind {
        match e {
            StoreError::Timeout(_) => MissKind::Timeout,
            StoreError::Unavailable(_) => MissKind::Unavailable,
            StoreError::Failed(_) | StoreError::Invalid(_) => MissKind::Failed,
        }
    }

    fn of_refusal(r: Refusal) -> MissKind {
        match r {
            Refusal::Truncated => MissKind::Truncated,
            Refusal::Corrupt => MissKind::Corrupt,
            Refusal::Version => MissKind::Version,
            Refusal::ForeignModel => MissKind::ForeignModel,
            Refusal::WrongKey => MissKind::WrongKey,
        }
    }
}

/// A verified payload (the envelope it came in, without a copy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Payload {
    buf: Vec<u8>,
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[HEADER_LEN..]
    }
}

/// The result of reading one value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The verified value.
    Hit(Payload),
    /// No value, and why.
    Miss(MissKind),
}

/// What a tier has done since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Values returned (verified).
    pub hits: u64,
    /// Misses: no object.
    pub absent: u64,
    /// Misses: truncated.
    pub truncated: u64,
    /// Misses: bad magic or checksum.
    pub corrupt: u64,
    /// Misses: another format or layout version.
    pub version: u64,
    /// Misses: another model's value.
    pub foreign_model: u64,
    /// Misses: a value written under another key.
    pub wrong_key: u64,
    /// Misses: too large or of the wrong size.
    pub oversized: u64,
    /// Misses: not a plain object.
    pub not_regular: u64,
    /// Misses: the store timed out.
    pub timeout: u64,
    /// Misses: the store was unreachable.
    pub unavailable: u64,
    /// Misses: the store answered with an error.
    pub failed: u64,
    /// Values written.
    pub puts: u64,
    /// Values not written (the store failed).
    pub put_failures: u64,
    /// Payload bytes returned by hits.
    pub bytes_read: u64,
    /// Payload bytes written.
    pub bytes_written: u64,
}

impl StoreStats {
    /// All misses.
    pub fn misses(&self) -> u64 {
        MissKind::ALL.iter().map(|k| self.miss(*k)).sum()
    }

    /// The misses of one kind.
    pub fn miss(&self, k: MissKind) -> u64 {
        match k {
            MissKind::Absent => self.absent,
            MissKind::Truncated => self.truncated,
            MissKind::Corrupt => self.corrupt,
            MissKind::Version => self.version,
            MissKind::ForeignModel => self.foreign_model,
            MissKind::WrongKey => self.wrong_key,
            MissKind::Oversized => self.oversized,
            MissKind::NotRegular => self.not_regular,
            MissKind::Timeout => self.timeout,
            MissKind::Unavailable => self.unavailable,
            MissKind::Failed => self.failed,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: [AtomicU64; MissKind::ALL.len()],
    puts: AtomicU64,
    put_failures: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A store with keys and envelopes: what an engine's store tier calls.
///
/// Every read is verified ([`envelope::open`]) against the key, the
/// fingerprint and the layout version it is read for; anything else is a
/// [`Lookup::Miss`] counted by kind. Store failures are misses too: a read
/// never fails. Safe to share between threads.
pub struct StoreTier {
    store: Box<dyn Store>,
    keyer: Keyer,
    prefix: String,
    max_value_bytes: usize,
    counters: Counters,
}

impl std::fmt::Debug for StoreTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreTier")
            .field("store", &self.store.kind())
            .field("keyer", self.keyer.config())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl StoreTier {
    /// A tier over `store`.
    pub fn new(store: Box<dyn Store>, cfg: TierConfig) -> Result<StoreTier, ConfigError> {
        if !cfg.prefix.is_empty() && !valid_name(&cfg.prefix) {
            return Err(ConfigError(format!(
                "prefix {:?}: use [A-Za-z0-9._:-], not starting with a dot",
                cfg.prefix
            )));
        }
        if cfg.max_value_bytes == 0 || cfg.max_value_bytes > isize::MAX as usize - HEADER_LEN {
            return Err(ConfigError(format!(
                "max_value_bytes {} is 0 or absurd",
                cfg.max_value_bytes
            )));
        }
        Ok(StoreTier {
            store,
            keyer: Keyer::new(cfg.keyer)?,
            prefix: cfg.prefix,
            max_value_bytes: cfg.max_value_bytes,
            counters: Counters::default(),
        })
    }

    /// The keyer.
    pub fn keyer(&self) -> &Keyer {
        &self.keyer
    }

    /// The store.
    pub fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// The largest payload.
    pub fn max_value_bytes(&self) -> usize {
        self.max_value_bytes
    }

    /// The object name of `key`.
    pub fn name(&self, key: &StoreKey) -> String {
        key.name(&self.prefix)
    }

    fn expect(&self, key: StoreKey) -> Expect {
        let c = self.keyer.config();
        Expect {
            key,
            fingerprint: c.fingerprint,
            layout_version: c.layout_version,
        }
    }

    fn miss(&self, k: MissKind, n: u64) {
        add(&self.counters.misses[k as usize], n);
    }

    /// What the counters say now.
    pub fn stats(&self) -> StoreStats {
        let c = &self.counters;
        let m = |k: MissKind| c.misses[k as usize].load(Ordering::Relaxed);
        StoreStats {
            hits: c.hits.load(Ordering::Relaxed),
            absent: m(MissKind::Absent),
            truncated: m(MissKind::Truncated),
            corrupt: m(MissKind::Corrupt),
            version: m(MissKind::Version),
            foreign_model: m(MissKind::ForeignModel),
            wrong_key: m(MissKind::WrongKey),
            oversized: m(MissKind::Oversized),
            not_regular: m(MissKind::NotRegular),
            timeout: m(MissKind::Timeout),
            unavailable: m(MissKind::Unavailable),
            failed: m(MissKind::Failed),
            puts: c.puts.load(Ordering::Relaxed),
            put_failures: c.put_failures.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
        }
    }

    /// The namespace of the calls without one: the keyer's configured `ns`.
    pub fn default_ns(&self) -> u64 {
        self.keyer.config().ns
    }

    fn state_key(&self, ns: u64, tokens: &[u32], position: usize) -> Result<StoreKey, StoreError> {
        self.keyer
            .state_key_ns(ns, tokens, position)
            .ok_or_else(|| {
                StoreError::Invalid(format!(
                    "state position {position} is not in 1..={}",
                    tokens.len()
                ))
            })
    }

    fn put(&self, keys: &[StoreKey], payloads: &[&[u8]]) -> Result<(), StoreError> {
        if let Some(p) = payloads.iter().find(|p| p.len() > self.max_value_bytes) {
            return Err(StoreError::Invalid(format!(
                "a value of {} bytes is over max_value_bytes {}",
                p.len(),
                self.max_value_bytes
            )));
        }
        let names: Vec<String> = keys.iter().map(|k| self.name(k)).collect();
        let heads: Vec<[u8; HEADER_LEN]> = keys
            .iter()
            .zip(payloads)
            .map(|(k, p)| envelope::seal_header(&self.expect(*k), p))
            .collect();
        let items: Vec<(&str, [&[u8]; 2])> = names
            .iter()
            .zip(&heads)
            .zip(payloads)
            .map(|((n, h), p)| (n.as_str(), [&h[..], *p]))
            .collect();
        match self.store.batch_put_parts(&items) {
            Ok(()) => {
                add(&self.counters.puts, keys.len() as u64);
                let bytes: usize = payloads.iter().map(|p| p.len()).sum();
                add(&self.counters.bytes_written, bytes as u64);
                Ok(())
            }
            Err(e) => {
                add(&self.counters.put_failures, keys.len() as u64);
                Err(e)
            }
        }
    }

    /// Reads `keys`, verifying each; `want_len` refuses payloads of
    /// another size (as [`MissKind::Oversized`]). With `prefix_only`,
    /// stops at the first miss (what follows it is neither returned nor
    /// counted).
    fn get(&self, keys: &[StoreKey], want_len: Option<usize>, prefix_only: bool) -> Vec<Lookup> {
        let names: Vec<String> = keys.iter().map(|k| self.name(k)).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let max = want_len.unwrap_or(self.max_value_bytes) + HEADER_LEN;
        let fetched = match self.store.batch_get(&refs, max) {
            Ok(f) if f.len() == keys.len() => f,
            Ok(_) => {
                let n = if prefix_only { 1 } else { keys.len() as u64 };
                self.miss(MissKind::Failed, n);
                return vec![Lookup::Miss(MissKind::Failed); keys.len()];
            }
            Err(e) => {
                let k = MissKind::of_error(&e);
                let n = if prefix_only { 1 } else { keys.len() as u64 };
                self.miss(k, n.min(keys.len() as u64));
                return vec![Lookup::Miss(k); keys.len()];
            }
        };
        let mut out = Vec::with_capacity(keys.len());
        for (key, f) in keys.iter().zip(fetched) {
            let r = match f {
                Fetched::Absent => Lookup::Miss(MissKind::Absent),
                Fetched::Oversized => Lookup::Miss(MissKind::Oversized),
                Fetched::NotRegular => Lookup::Miss(MissKind::NotRegular),
                Fetched::Value(buf) => match envelope::open(&self.expect(*key), &buf) {
                    Err(r) => Lookup::Miss(MissKind::of_refusal(r)),
                    Ok(range) if want_len.is_some_and(|w| w != range.len()) => {
                        Lookup::Miss(MissKind::Oversized)
                    }
                    Ok(_) => Lookup::Hit(Payload { buf }),
                },
            };
            match &r {
                Lookup::Hit(p) => {
                    add(&self.counters.hits, 1);
                    add(&self.counters.bytes_read, p.len() as u64);
                }
                Lookup::Miss(k) => self.miss(*k, 1),
            }
            let stop = prefix_only && matches!(r, Lookup::Miss(_));
            out.push(r);
            if stop {
                break;
            }
        }
        out.resize(keys.len(), Lookup::Miss(MissKind::Absent));
        out
    }

    /// Writes the state after `tokens[..position]`. `Invalid` when the
    /// position is not in `1..=tokens.len()` or the value is over
    /// `max_value_bytes`; a store failure is returned (and counted), and an
    /// engine may ignore it: the value is simply not there later.
    pub fn put_state(
        &self,
        tokens: &[u32],
        position: usize,
        value: &[u8],
    ) -> Result<(), StoreError> {
        self.put_state_ns(self.default_ns(), tokens, position, value)
    }

    /// [`put_state`](Self::put_state) in cache namespace `ns`: read only
    /// by calls in `ns` (the key and the envelope's key derive from it).
    pub fn put_state_ns(
        &self,
        ns: u64,
        tokens: &[u32],
        position: usize,
        value: &[u8],
    ) -> Result<(), StoreError> {
        let key = self.state_key(ns, tokens, position)?;
        self.put(&[key], &[value])
    }

    /// Reads the state after `tokens[..position]`. `Err(Invalid)` only for
    /// a position not in `1..=tokens.len()`; everything the store does
    /// wrong is a miss.
    pub fn get_state(&self, tokens: &[u32], position: usize) -> Result<Lookup, StoreError> {
        self.get_state_ns(self.default_ns(), tokens, position)
    }

    /// [`get_state`](Self::get_state) in namespace `ns`.
    pub fn get_state_ns(
        &self,
        ns: u64,
        tokens: &[u32],
        position: usize,
    ) -> Result<Lookup, StoreError> {
        let key = self.state_key(ns, tokens, position)?;
        Ok(self.get(&[key], None, false).remove(0))
    }

    /// Removes the state after `tokens[..position]`.
    pub fn delete_state(&self, tokens: &[u32], position: usize) -> Result<(), StoreError> {
        self.delete_state_ns(self.default_ns(), tokens, position)
    }

    /// [`delete_state`](Self::delete_state) in namespace `ns`.
    pub fn delete_state_ns(
        &self,
        ns: u64,
        tokens: &[u32],
        position: usize,
    ) -> Result<(), StoreError> {
        let key = self.state_key(ns, tokens, position)?;
        self.store.delete(&[&self.name(&key)])
    }

    fn kv_range(
        &self,
        ns: u64,
        tokens: &[u32],
        first_block: usize,
        n: usize,
    ) -> Result<Vec<StoreKey>, StoreError> {
        let keys = self.keyer.kv_keys_ns(ns, tokens);
        match first_block.checked_add(n) {
            Some(end) if end <= keys.len() => Ok(keys[first_block..end].to_vec()),
            _ => Err(StoreError::Invalid(format!(
                "blocks {first_block}..+{n}: the tokens have {} full blocks",
                keys.len()
            ))),
        }
    }

    /// Writes KV blocks `first_block..first_block + blocks.len()` of
    /// `tokens` (full blocks of `block_size` tokens).
    pub fn put_kv(
        &self,
        tokens: &[u32],
        first_block: usize,
        blocks: &[&[u8]],
    ) -> Result<(), StoreError> {
        self.put_kv_ns(self.default_ns(), tokens, first_block, blocks)
    }

    /// [`put_kv`](Self::put_kv) in namespace `ns`.
    pub fn put_kv_ns(
        &self,
        ns: u64,
        tokens: &[u32],
        first_block: usize,
        blocks: &[&[u8]],
    ) -> Result<(), StoreError> {
        let keys = self.kv_range(ns, tokens, first_block, blocks.len())?;
        self.put(&keys, blocks)
    }

    /// Reads KV blocks from `first_block`, at most `max_blocks` and no
    /// further than `tokens`' full blocks, each `block_bytes` long when
    /// given, in one store call: the verified blocks up to the first miss.
    pub fn get_kv(
        &self,
        tokens: &[u32],
        first_block: usize,
        max_blocks: usize,
        block_bytes: Option<usize>,
    ) -> Result<Vec<Payload>, StoreError> {
        self.get_kv_ns(
            self.default_ns(),
            tokens,
            first_block,
            max_blocks,
            block_bytes,
        )
    }

    /// [`get_kv`](Self::get_kv) in namespace `ns`.
    pub fn get_kv_ns(
        &self,
        ns: u64,
        tokens: &[u32],
        first_block: usize,
        max_blocks: usize,
        block_bytes: Option<usize>,
    ) -> Result<Vec<Payload>, StoreError> {
        let all = self.keyer.kv_keys_ns(ns, tokens);
        if first_block > all.len() {
            return Err(StoreError::Invalid(format!(
                "first block {first_block}: the tokens have {} full blocks",
                all.len()
            )));
        }
        let end = first_block.saturating_add(max_blocks).min(all.len());
        let keys = &all[first_block..end];
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self
            .get(keys, block_bytes, true)
            .into_iter()
            .map_while(|l| match l {
                Lookup::Hit(p) => Some(p),
                Lookup::Miss(_) => None,
            })
            .collect())
    }

    /// Which of `positions` have a state of `tokens` in the store (one
    /// `batch_exists`; a hint: a later read verifies). `None` when the
    /// store fails (counted as one miss of its kind).
    pub fn states_exist(&self, tokens: &[u32], positions: &[usize]) -> Option<Vec<bool>> {
        self.states_exist_ns(self.default_ns(), tokens, positions)
    }

    /// [`states_exist`](Self::states_exist) in namespace `ns`.
    pub fn states_exist_ns(
        &self,
        ns: u64,
        tokens: &[u32],
        positions: &[usize],
    ) -> Option<Vec<bool>> {
        let keys = self.keyer.state_keys_ns(ns, tokens, positions);
        let names: Vec<Option<String>> = keys.iter().map(|k| k.map(|k| self.name(&k))).collect();
        let refs: Vec<&str> = names.iter().flatten().map(String::as_str).collect();
        if refs.is_empty() {
            return Some(vec![false; positions.len()]);
        }
        match self.store.batch_exists(&refs) {
            Ok(e) if e.len() == refs.len() => {
                let mut found = e.into_iter();
                Some(
                    names
                        .iter()
                        .map(|n| n.is_some() && found.next().unwrap_or(false))
                        .collect(),
                )
            }
            Ok(_) => {
                self.miss(MissKind::Failed, 1);
                None
            }
            Err(e) => {
                self.miss(MissKind::of_error(&e), 1);
                None
            }
        }
    }

    /// How many of `tokens`' full blocks, from block 0, the store says it
    /// has (one `batch_exists`; a hint: a later read verifies). 0 when the
    /// store fails.
    pub fn kv_prefix(&self, tokens: &[u32]) -> usize {
        self.kv_prefix_ns(self.default_ns(), tokens)
    }

    /// [`kv_prefix`](Self::kv_prefix) in namespace `ns`.
    pub fn kv_prefix_ns(&self, ns: u64, tokens: &[u32]) -> usize {
        let keys = self.keyer.kv_keys_ns(ns, tokens);
        if keys.is_empty() {
            return 0;
        }
        let names: Vec<String> = keys.iter().map(|k| self.name(k)).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        match self.store.batch_exists(&refs) {
            Ok(e) => e.iter().take_while(|b| **b).count(),
            Err(e) => {
                self.miss(MissKind::of_error(&e), 1);
                0
            }
        }
    }
}
