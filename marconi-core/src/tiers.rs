//! Memory tiers below the device: a host tier and a store tier, each a
//! prefix cache of its own, fed by what the device (or the tier above)
//! evicts or writes through, and read back by a lookup that weighs loading
//! against recomputing.
//!
//! [`TieredCache`] keeps the device's [`PrefixCache`] exactly as it is
//! (with no lower tier it is that cache, call for call) and adds up to two
//! lower tiers. Each lower tier holds whole chains: a state at position `p`
//! together with the KV of `0..p` (prefixes shared in its tree), so a hit
//! there is complete once the KV the device lacks and the state are
//! loaded. Each tier judges what it keeps with its own eviction policy
//! (FLOP-aware utility for Marconi, LRU for the HiCache-like baseline).
//!
//! A lookup probes every tier, then picks the hit that saves the most time:
//! the prefill FLOPs of the tokens it skips beyond the device's own hit, at
//! [`TierConfig::compute_flops`], less the time to load what the device lacks
//! (bytes / the tier's bandwidth + its per-load latency). A lower-tier hit
//! that loads slower than it recomputes is declined (and counted). The
//! chosen hit comes with its [`LoadOrder`]s: the KV token range and the
//! state, from which tier, with the lower tier's ids when it tracks them.
//!
//! Pure like the rest of core: no clock, no I/O; times are arithmetic on
//! configured rates.

use std::sync::Arc;

use serde::Serialize;

use crate::admission::{AdmitOutcome, SavedState};
use crate::cache::PrefixCache;
use crate::config::CacheConfig;
use crate::error::CacheError;
use crate::events::CacheEvent;
use crate::eviction::{Freed, UnitBudget, UnitKind, UnitUse};
use crate::lookup::{Lookup, LookupOptions, Peek};
use crate::tree::NodeId;

/// Where an entry lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tier {
    /// The engine's GPU memory: the [`PrefixCache`] the engine resumes from.
    Device,
    /// Host memory (pinned RAM), PCIe-class bandwidth.
    Host,
    /// A store (local disk, a remote key-value store), slower still.
    Store,
}

impl Tier {
    /// Index into per-tier arrays (device 0, host 1, store 2).
    pub fn index(self) -> usize {
        match self {
            Tier::Device => 0,
            Tier::Host => 1,
            Tier::Store => 2,
        }
    }
}

/// When a lower tier receives an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriteMode {
    /// When the tier above evicts it (demotion; write-back). The lower tier
    /// holds what the upper one dropped, plus what it kept from before.
    Back,
    /// As soon as the tier above stores it (write-through, as SGLang's
    /// HiCache does): the lower tier also holds what the upper one holds.
    Through,
}

/// One lower tier.
#[derive(Clone, Debug, PartialEq)]
pub struct TierSpec {
    /// The tier's cache: capacity in bytes, admission and eviction policy
    /// (its tokens and states; the model must be the device's).
    pub cache: CacheConfig,
    /// Bytes per second from this tier into the device.
    pub bandwidth_bytes_per_s: f64,
    /// Fixed cost of one load from this tier, seconds.
    pub latency_s: f64,
}

/// The tiers below the device and how entries move between them.
#[derive(Clone, Debug, PartialEq)]
pub struct TierConfig {
    /// The host tier (required for a store tier).
    pub host: Option<TierSpec>,
    /// The store tier, below the host.
    pub store: Option<TierSpec>,
    /// Effective prefill FLOP/s of the device (peak × utilisation): what a
    /// skipped token is worth in time.
    pub compute_flops: f64,
    /// When entries reach the lower tiers.
    pub write: WriteMode,
    /// Save the state of a lower-tier hit on the device with the request
    /// (its KV goes in with the request's admission either way).
    pub promote: bool,
    /// Load every longer lower-tier hit, without weighing it against
    /// recomputing (the HiCache-like baseline).
    pub always_load: bool,
    /// Plan on the device the checkpoints the lower tiers' admission
    /// plans (branch points of paths only a lower tier still holds).
    pub lower_plans: bool,
    /// Leave the moves into the lower tiers to [`TieredCache::settle`],
    /// called by the engine off the request path (between decode steps),
    /// instead of doing them in `admit` and `release`. Decisions are the
    /// same as long as `settle` runs before the next lookup.
    pub defer_moves: bool,
    /// Keep each chain in one tier (exclusive tiers): once a lower-tier
    /// hit is loaded and the device has admitted the request's state at or
    /// beyond the hit, the lower tier drops the chain it served
    /// ([`PrefixCache::discard`]); the device's eviction demotes it again
    /// later. Without it the tiers are inclusive: the lower tier keeps a
    /// copy of what it promoted, and device + host hold about what the
    /// host alone would.
    pub exclusive: bool,
}

impl TierConfig {
    /// Marconi's tiers: write-back demotion, no promotion of a hit's state
    /// (the request's own KV and final state reach the device anyway), the
    /// lower tiers' branch checkpoints planned on the device, a hit loaded
    /// only when loading beats recomputing. `compute_flops` 989e12 × 0.4
    /// (an H100 SXM in bf16 at 40 % utilisation).
    pub fn marconi(host: Option<TierSpec>, store: Option<TierSpec>) -> Self {
        TierConfig {
            host,
            store,
            compute_flops: 989e12 * 0.4,
            write: WriteMode::Back,
            promote: false,
            always_load: false,
            lower_plans: true,
            defer_moves: false,
            exclusive: true,
        }
    }

    /// The HiCache-like baseline: write-through, promotion, every longer
    /// hit loaded (the tiers' caches should be LRU: `CacheConfig::sglang_plus`).
    pub fn hicache(host: Option<TierSpec>, store: Option<TierSpec>) -> Self {
        TierConfig {
            write: WriteMode::Through,
            promote: true,
            always_load: true,
            lower_plans: false,
            exclusive: false,
            ..TierConfig::marconi(host, store)
        }
    }

    fn validate(&self, device: &CacheConfig) -> Result<(), CacheError> {
        let bad = |s: String| Err(CacheError::InvalidConfig(s));
        if self.store.is_some() && self.host.is_none() {
            return bad("a store tier needs a host tier above it".into());
        }
        if !(self.compute_flops.is_finite() && self.compute_flops > 0.0) {
            return bad(format!(
                "compute FLOP/s {} is not finite and > 0",
                self.compute_flops
            ));
        }
        for (name, t) in [("host", &self.host), ("store", &self.store)] {
            let Some(t) = t else { continue };
            if !(t.bandwidth_bytes_per_s.is_finite() && t.bandwidth_bytes_per_s > 0.0) {
                return bad(format!(
                    "{name} bandwidth {} B/s is not finite and > 0",
                    t.bandwidth_bytes_per_s
                ));
            }
            if !(t.latency_s.is_finite() && t.latency_s >= 0.0) {
                return bad(format!(
                    "{name} latency {} s is not finite and >= 0",
                    t.latency_s
                ));
            }
            if t.cache.model != device.model || t.cache.page_size != device.page_size {
                return bad(format!(
                    "{name} tier must cache the device's model with its page size"
                ));
            }
        }
        Ok(())
    }
}

/// What a load moves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum LoadWhat {
    /// The KV of tokens `start..end` (page-aligned), with the tier's page
    /// ids for them when the tier tracks pages (empty otherwise).
    Kv {
        /// First token.
        start: u32,
        /// End (exclusive).
        end: u32,
        /// The tier's page ids of `start..end`, when tracked.
        pages: Vec<u32>,
    },
    /// The recurrent state at `position`, with the tier's slot id when
    /// tracked.
    State {
        /// Tokens the state covers.
        position: u32,
        /// The tier's slot id, when tracked.
        slot: Option<u32>,
    },
}

/// One load the engine carries out before it prefills: from `tier` into
/// the request's own device pages and state slot (where a device hit's
/// state is copied too).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LoadOrder {
    /// The tier read.
    pub tier: Tier,
    /// What is read.
    pub what: LoadWhat,
    /// Bytes moved.
    pub bytes: u64,
}

/// What [`TieredCache::lookup`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct TieredLookup {
    /// The device's lookup (its lease, device hit and plan).
    pub device: Lookup,
    /// Tokens the engine may skip once the loads are done (at least the
    /// device's hit).
    pub hit_tokens: u32,
    /// The tier whose state the hit resumes from.
    pub tier: Tier,
    /// Loads to carry out before prefill (empty for a device hit).
    pub loads: Vec<LoadOrder>,
    /// Modelled time of the loads, seconds.
    pub load_s: f64,
    /// Modelled time to recompute `device.hit_tokens..hit_tokens` instead.
    pub recompute_s: f64,
    /// A longer lower-tier hit left unused because recomputing is faster.
    pub declined: Option<(Tier, u32)>,
    /// Positions to save states at during this prefill (ascending, above
    /// the hit; with promotion the hit's own position, whose state the
    /// engine loaded).
    pub plan: Vec<u32>,
    /// The hit resumes from a state only a shared store probe knew of
    /// (another process wrote it; [`TieredCache::lookup_probed`]).
    pub shared: bool,
    ns: u64,
    leases: [Option<u64>; 2],
}

/// An entry written into a lower tier (the engine copies its bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Move {
    /// The tier written.
    pub to: Tier,
    /// Namespace.
    pub ns: u64,
    /// The state's position; the chain is its first `position` tokens.
    pub position: u32,
    /// Bytes the tier charges for the chain: the KV of its `position`
    /// tokens and the state (what the engine copies), whatever the tier
    /// already shares with other chains.
    pub bytes: u64,
}

/// What the engine does to its copies in a lower tier, in the order the
/// tiers decided it ([`TieredCache::drain_ops`]): a write before a later
/// drop of the same chain, a drop before a later write of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum TierOp {
    /// Copy the chain (the state at `position` and the KV of its first
    /// `position` tokens) into `to`: from the device when `to` is the host,
    /// from the host when it is the store.
    Write {
        /// The tier written.
        to: Tier,
        /// Namespace.
        ns: u64,
        /// The state's position.
        position: u32,
        /// Bytes the tier charges for the chain: the KV of its
        /// `position` tokens and the state (what the engine copies).
        bytes: u64,
        /// Tokens from 0 to at least `position` (the chain's identity).
        prefix: Vec<u32>,
    },
    /// The tier no longer holds the state at `position` (evicted there):
    /// the engine may free its copy.
    Drop {
        /// The tier dropped from.
        from: Tier,
        /// Namespace.
        ns: u64,
        /// The state's position.
        position: u32,
        /// Tokens from 0 to at least `position`.
        prefix: Vec<u32>,
    },
}

/// What a shared store says it holds for one input, read by the engine (an
/// I/O step outside core) before [`TieredCache::lookup_probed`]: entries
/// other processes wrote, which this process's own store tier does not know.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreProbe {
    /// Leading input tokens whose KV the store holds (its KV prefix; an
    /// engine whose state objects carry their KV passes the input length).
    pub kv_tokens: u32,
    /// Positions whose state the store holds (any order; the probe of
    /// [`TieredCache::store_probe_positions`]).
    pub states: Vec<u32>,
}

/// Counters per tier (index [`Tier::index`]), counted at each lookup.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TierStats {
    /// Requests looked up.
    pub requests: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Tokens skipped, all tiers.
    pub hit_tokens: u64,
    /// Tokens skipped, by the tier of the state resumed from.
    pub hit_tokens_by_tier: [u64; 3],
    /// Requests whose hit resumed from each tier.
    pub hits_by_tier: [u64; 3],
    /// Bytes loaded from each tier into the device.
    pub bytes_loaded: [u64; 3],
    /// Bytes written into each tier (demotions or write-through).
    pub bytes_written: [u64; 3],
    /// Entries written into each tier.
    pub writes: [u64; 3],
    /// Entries not demoted: their reload would cost more than recomputing.
    pub demotions_skipped: u64,
    /// Longer lower-tier hits declined: recomputing was faster.
    pub loads_declined: u64,
    /// Requests whose hit resumed from a state only a shared store probe
    /// knew of (written by another process).
    pub shared_hits: u64,
    /// Tokens those requests skipped.
    pub shared_hit_tokens: u64,
    /// Modelled load time, seconds, all requests.
    pub load_s: f64,
    /// Prefill FLOPs saved, all tiers.
    pub flops_saved: f64,
    /// Prefill FLOPs with no cache.
    pub flops_total: f64,
}

impl TierStats {
    /// `hit_tokens / input_tokens`.
    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.hit_tokens as f64, self.input_tokens as f64)
    }

    /// Tokens skipped from `tier`'s states / input tokens.
    pub fn tier_hit_rate(&self, tier: Tier) -> f64 {
        ratio(
            self.hit_tokens_by_tier[tier.index()] as f64,
            self.input_tokens as f64,
        )
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// A chain moved or dropped: namespace, the state's position, the tokens
/// from 0 to at least the state.
type Chain = (u64, u32, Arc<[u32]>);

/// What a tier's log recorded: the states stored and removed.
#[derive(Debug, Default)]
struct Drained {
    stored: Vec<Chain>,
    removed: Vec<Chain>,
}

impl Drained {
    fn extend(&mut self, other: Drained) {
        self.stored.extend(other.stored);
        self.removed.extend(other.removed);
    }
}

struct Lower {
    cache: PrefixCache,
    bandwidth: f64,
    latency: f64,
}

/// A device [`PrefixCache`] with a host and optionally a store tier below it.
pub struct TieredCache {
    device: PrefixCache,
    lower: [Option<Lower>; 2],
    cfg: TierConfig,
    stats: TierStats,
    moves: Vec<Move>,
    /// Whether the device's events were asked for by the caller (else they
    /// are consumed here).
    device_events_wanted: bool,
    /// The device's events kept for the caller.
    device_events: Vec<CacheEvent>,
    /// Writes and drops in order, when recorded ([`TieredCache::record_ops`]).
    ops: Option<Vec<TierOp>>,
    /// What the host's log held before a discard, not yet moved into the
    /// store (drained early so that a discard's removals are not demoted).
    host_pending: Drained,
    /// Lower-tier leases for `settle` to release: (tier, lease, whether
    /// to discard the chain it pins).
    pending: Vec<(usize, u64, bool)>,
    /// The device lookup's hints, reused from request to request.
    hints: Vec<u32>,
    /// With deferred moves, the device ids freed up to the last `settle`:
    /// their chains' writes are among the ops drained before them, so the
    /// engine may reuse them. Ids freed since are withheld until the next
    /// `settle` orders the writes that read them.
    freed_ready: Freed,
}

/// A candidate hit in one lower tier.
#[derive(Clone, Copy, Debug)]
struct Probe {
    hit: u32,
    kv: u32,
}

impl TieredCache {
    /// A tiered cache; with no lower tier it behaves as `PrefixCache::new(device)`.
    pub fn new(device: CacheConfig, tiers: TierConfig) -> Result<Self, CacheError> {
        tiers.validate(&device)?;
        let wanted = device.events;
        // Write-back reads only removals: an admission then records no
        // event (and copies no prefix) unless the caller wants the stream.
        let through = tiers.write == WriteMode::Through;
        let mut dev = device.clone();
        dev.events = wanted || (tiers.host.is_some() && through);
        let mut device = PrefixCache::new(dev)?;
        if tiers.host.is_some() {
            device.enable_removal_events();
        }
        let mut lower: [Option<Lower>; 2] = [None, None];
        for (i, spec) in [&tiers.host, &tiers.store].into_iter().enumerate() {
            if let Some(s) = spec {
                let mut c = s.cache.clone();
                // The host's evictions feed the store.
                let feeds = i == 0 && tiers.store.is_some();
                c.events = feeds && through;
                let mut cache = PrefixCache::new(c)?;
                // A lower tier holds whole chains: no KV without the state
                // of its chain (what the engine's copies hold, byte for byte).
                cache.set_chains_only();
                if feeds {
                    cache.enable_removal_events();
                }
                lower[i] = Some(Lower {
                    cache,
                    bandwidth: s.bandwidth_bytes_per_s,
                    latency: s.latency_s,
                });
            }
        }
        Ok(TieredCache {
            device,
            lower,
            cfg: tiers,
            stats: TierStats::default(),
            moves: Vec::new(),
            device_events_wanted: wanted,
            device_events: Vec::new(),
            ops: None,
            host_pending: Drained::default(),
            pending: Vec::new(),
            hints: Vec::new(),
            freed_ready: Freed::default(),
        })
    }

    /// The device cache.
    pub fn device(&self) -> &PrefixCache {
        &self.device
    }

    /// The cache of a lower tier (`None` for the device or an absent tier).
    pub fn tier(&self, tier: Tier) -> Option<&PrefixCache> {
        match tier {
            Tier::Device => Some(&self.device),
            Tier::Host => self.lower[0].as_ref().map(|l| &l.cache),
            Tier::Store => self.lower[1].as_ref().map(|l| &l.cache),
        }
    }

    /// The tier configuration.
    pub fn config(&self) -> &TierConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> &TierStats {
        &self.stats
    }

    /// Bytes each tier holds (device, host, store; 0 where absent).
    pub fn used_bytes(&self) -> [u64; 3] {
        let mut b = [self.device.used_bytes(), 0, 0];
        for (i, l) in self.lower.iter().enumerate() {
            b[i + 1] = l.as_ref().map_or(0, |l| l.cache.used_bytes());
        }
        b
    }

    /// Capacity of each tier in bytes (0 where absent).
    pub fn capacity_bytes(&self) -> [u64; 3] {
        let mut b = [self.device.config().capacity_bytes, 0, 0];
        for (i, l) in self.lower.iter().enumerate() {
            b[i + 1] = l.as_ref().map_or(0, |l| l.cache.config().capacity_bytes);
        }
        b
    }

    /// The entries written into lower tiers since the last call (the
    /// engine copies them before the upper tier's ids are reused).
    pub fn drain_moves(&mut self) -> Vec<Move> {
        std::mem::take(&mut self.moves)
    }

    /// Records every write into and drop from a lower tier, in order, for
    /// [`drain_ops`](Self::drain_ops) (off by default). An engine that
    /// keeps copies in the lower tiers needs both: what to copy where, and
    /// which copies to free.
    pub fn record_ops(&mut self, on: bool) {
        if on && self.ops.is_none() {
            self.ops = Some(Vec::new());
        } else if !on {
            self.ops = None;
        }
        let store = self.lower[1].is_some();
        for (i, l) in self.lower.iter_mut().enumerate() {
            let Some(l) = l else { continue };
            if on {
                // Removals are what the drops need (a no-op where the
                // host's full log feeds a write-through store).
                l.cache.enable_removal_events();
            } else if !(i == 0 && store) {
                // The host's events feed the store; nothing else reads them.
                l.cache.disable_events();
            }
        }
    }

    /// The writes and drops recorded since the last call (empty unless
    /// [`record_ops`](Self::record_ops)).
    pub fn drain_ops(&mut self) -> Vec<TierOp> {
        self.ops.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The engine ids (device KV pages, state slots) the device freed
    /// since the last call ([`PrefixCache::drain_freed`]) whose content no
    /// pending move still reads. With [`TierConfig::defer_moves`] and a
    /// lower tier, an id the device freed is handed out only after the
    /// [`settle`](Self::settle) that ordered the writes reading it (drain
    /// the ops first, then the freed ids): an engine that reuses every id
    /// it is handed never overwrites a chain a later write copies.
    pub fn drain_freed(&mut self) -> Freed {
        if self.cfg.defer_moves && self.lower[0].is_some() {
            return std::mem::take(&mut self.freed_ready);
        }
        self.device.drain_freed()
    }

    /// Makes the ids the device freed so far available to
    /// [`drain_freed`](Self::drain_freed): the writes of what they held
    /// are ordered.
    fn release_freed(&mut self) {
        if self.cfg.defer_moves && self.lower[0].is_some() {
            let f = self.device.drain_freed();
            self.freed_ready.kv_pages.extend(f.kv_pages);
            self.freed_ready.state_slots.extend(f.state_slots);
        }
    }

    /// The positions of an input of `input_len` tokens whose state a shared
    /// store probe should ask about: page-aligned, below the input's end (a
    /// hit leaves the last token to compute), longest first, at most `max`.
    pub fn store_probe_positions(&self, input_len: usize, max: usize) -> Vec<u32> {
        let page = self.device.config().page_size.max(1) as usize;
        let top = input_len.saturating_sub(1) / page * page;
        (1..=top / page)
            .rev()
            .take(max)
            .map(|k| (k * page) as u32)
            .collect()
    }

    /// Modelled seconds to load `bytes` from lower tier `i` (0 host, 1 store).
    fn load_time(&self, i: usize, bytes: u64) -> f64 {
        match &self.lower[i] {
            Some(l) if bytes > 0 => l.latency + bytes as f64 / l.bandwidth,
            _ => 0.0,
        }
    }

    fn recompute_time(&self, from: u32, to: u32) -> f64 {
        if to <= from {
            return 0.0;
        }
        let m = &self.device.config().model;
        m.prefill_flops(from as u64, to as u64) / self.cfg.compute_flops
    }

    fn kv_bytes(&self, tokens: u32) -> u64 {
        let m = &self.device.config().model;
        (tokens as u64).saturating_mul(m.kv_bytes_per_token())
    }

    fn state_bytes(&self) -> u64 {
        self.device.config().model.state_bytes()
    }

    /// Looks `input` up in every tier: the usable hit, the loads that make
    /// it complete and the device's lease and plan. Release with
    /// [`release`](Self::release).
    pub fn lookup(&mut self, ns: u64, input: &[u32]) -> Result<TieredLookup, CacheError> {
        self.lookup_hinted(ns, input, &[])
    }

    /// [`lookup`](Self::lookup) with application checkpoint hints for the
    /// device ([`PrefixCache::lookup_hinted`]).
    pub fn lookup_hinted(
        &mut self,
        ns: u64,
        input: &[u32],
        checkpoints: &[u32],
    ) -> Result<TieredLookup, CacheError> {
        self.lookup_probed(ns, input, checkpoints, None)
    }

    /// [`lookup_hinted`](Self::lookup_hinted) that also weighs what a
    /// shared store holds beyond this process's own tiers: the longest
    /// probed state position whose KV is covered (by the store's KV prefix,
    /// the host's or the device's) is a store-tier candidate, loaded or
    /// declined by the same rule as any lower-tier hit. Without a store
    /// tier configured the probe is ignored (no bandwidth to weigh it by).
    /// The probe is a hint: the engine's read may still miss (the entry
    /// was evicted or is corrupt), and then it recomputes from the device's
    /// hit.
    pub fn lookup_probed(
        &mut self,
        ns: u64,
        input: &[u32],
        checkpoints: &[u32],
        probe: Option<&StoreProbe>,
    ) -> Result<TieredLookup, CacheError> {
        self.lookup_opts(
            ns,
            input,
            checkpoints,
            probe,
            LookupOptions::default(),
            false,
        )
    }

    /// [`lookup_probed`](Self::lookup_probed) with the device lookup's
    /// options ([`PrefixCache::lookup_with`]) and, with `device_only`, the
    /// view of an engine that loads nothing from the lower tiers: the hit
    /// is the device's own (the lower tiers are still peeked at for the
    /// branch points they see, but no lower-tier hit is chosen, pinned or
    /// counted, and the probe is ignored).
    pub fn lookup_opts(
        &mut self,
        ns: u64,
        input: &[u32],
        checkpoints: &[u32],
        probe: Option<&StoreProbe>,
        opts: LookupOptions,
        device_only: bool,
    ) -> Result<TieredLookup, CacheError> {
        let probe = if device_only { None } else { probe };
        // The lower tiers are peeked at (one walk each, nothing changes
        // there); only the tier whose hit is taken is looked up for real
        // (its lease pins the hit while it loads).
        let mut probes: [Option<Probe>; 2] = [None, None];
        let mut peeks: [Option<(Peek, NodeId)>; 2] = [None, None];
        self.hints.clear();
        self.hints.extend_from_slice(checkpoints);
        for i in 0..2 {
            let Some(l) = self.lower[i].as_ref() else {
                continue;
            };
            let (p, node) = l.cache.peek_node(ns, input, self.cfg.lower_plans)?;
            probes[i] = Some(Probe {
                hit: p.hit_tokens,
                kv: p.kv_matched_tokens,
            });
            // The branch points a lower tier sees (its admission plans them
            // where the input leaves a path it holds) are branch points of
            // the whole cache: the device plans them too, or a small device
            // would only ever see the branches it still holds.
            self.hints.extend_from_slice(&p.plan);
            peeks[i] = Some((p, node));
        }
        // The longest lower hit is hinted so that the device plans its state
        // (promotion); dropped by the device when not above its own hit.
        let best_lower = probes.iter().flatten().map(|p| p.hit).max().unwrap_or(0);
        if self.cfg.promote && best_lower > 0 {
            self.hints.push(best_lower);
        }
        let device = if opts == LookupOptions::default() {
            self.device.lookup_hinted(ns, input, &self.hints)?
        } else {
            self.device
                .lookup_hinted_with(ns, input, &self.hints, opts)?
        };
        let d = device.hit_tokens;
        // The device KV the engine can use is its hit's pages (the lease
        // gives none past the hit): KV the device matched past its hit has
        // no page the engine knows, so a lower tier's hit loads it too.
        let page = self.device.config().page_size.max(1);
        let dkv = (d / page * page).min(device.kv_matched_tokens);
        let shared_hit = self.shared_candidate(input.len(), dkv, &probes, probe);
        if let Some(p) = shared_hit {
            probes[1] = Some(Probe { hit: p, kv: p });
        }
        // Choose the hit that saves the most time.
        let mut best: (f64, Tier, u32, f64, f64) = (0.0, Tier::Device, d, 0.0, 0.0);
        let mut declined = None;
        for i in 0..2 {
            let Some(p) = probes[i] else { continue };
            if p.hit <= d || device_only {
                continue;
            }
            let load = self.load_plan(i, p.hit, dkv, &probes);
            let load_s: f64 = load
                .iter()
                .enumerate()
                .map(|(t, &b)| self.load_time(t, b))
                .sum();
            let recompute_s = self.recompute_time(d, p.hit);
            let gain = recompute_s - load_s;
            let tier = if i == 0 { Tier::Host } else { Tier::Store };
            if !self.cfg.always_load && gain <= 0.0 {
                if declined.is_none_or(|(_, h)| h < p.hit) {
                    declined = Some((tier, p.hit));
                }
                continue;
            }
            let better = if self.cfg.always_load {
                p.hit > best.2 || best.1 == Tier::Device
            } else {
                gain > best.0
            };
            if better {
                best = (gain, tier, p.hit, load_s, recompute_s);
            }
        }
        let (_, tier, hit, load_s, recompute_s) = best;
        if declined.is_some_and(|(_, h)| h <= hit) {
            declined = None;
        }
        let mut leases: [Option<u64>; 2] = [None, None];
        let loads = if tier == Tier::Device {
            Vec::new()
        } else {
            // The tier whose state is loaded, and the host when it gives KV
            // to a store hit.
            let mut lower_lookups: [Option<Lookup>; 2] = [None, None];
            let i = tier.index() - 1;
            let host_kv = i == 1 && probes[0].is_some_and(|p| p.kv.min(hit) > dkv && p.hit > 0);
            // A state only a shared probe knew of is not in this store
            // tier: nothing of it to pin there (nor to discard later).
            let shared = i == 1 && shared_hit == Some(hit);
            for j in 0..2 {
                if (j != i || shared) && !(j == 0 && host_kv) {
                    continue;
                }
                let (Some(l), Some((p, node))) = (self.lower[j].as_mut(), &peeks[j]) else {
                    continue;
                };
                // The tier is as peeked: nothing changed it since.
                let lk = l.cache.lease_peeked(ns, input.len() as u32, p, *node);
                leases[j] = Some(lk.lease);
                lower_lookups[j] = Some(lk);
            }
            self.load_orders(tier, hit, dkv, &probes, &lower_lookups)
        };
        let plan = device
            .plan
            .iter()
            .copied()
            .filter(|&p| p > hit || (p == hit && tier != Tier::Device))
            .collect();
        let l = TieredLookup {
            device,
            hit_tokens: hit,
            tier,
            loads,
            load_s,
            recompute_s,
            declined,
            plan,
            shared: tier == Tier::Store && shared_hit == Some(hit),
            ns,
            leases,
        };
        self.account(&l, input.len());
        Ok(l)
    }

    /// The longest usable position of a shared store probe that beats the
    /// store tier's own hit: below the input's end, its KV covered by the
    /// store's KV prefix, the host's or the device's match.
    fn shared_candidate(
        &self,
        input_len: usize,
        dkv: u32,
        probes: &[Option<Probe>; 2],
        probe: Option<&StoreProbe>,
    ) -> Option<u32> {
        let probe = probe?;
        self.lower[1].as_ref()?;
        let own = probes[1].map_or(0, |p| p.hit);
        let kv = probe.kv_tokens.max(dkv).max(probes[0].map_or(0, |p| p.kv));
        let end = u32::try_from(input_len).unwrap_or(u32::MAX);
        probe
            .states
            .iter()
            .copied()
            .filter(|&p| p > own && p < end && p <= kv)
            .max()
    }

    /// Bytes each lower tier (host, store) would load for a hit of `hit`
    /// tokens whose state is in lower tier `i`: the KV the device lacks
    /// (from the host where it holds it, it is faster) and the state.
    fn load_plan(&self, i: usize, hit: u32, dkv: u32, probes: &[Option<Probe>; 2]) -> [u64; 2] {
        let mut b = [0u64; 2];
        let host_kv = if i == 1 {
            probes[0].map_or(0, |p| p.kv.min(hit))
        } else {
            hit
        };
        let from_host_end = host_kv.max(dkv);
        b[0] = self.kv_bytes(from_host_end.saturating_sub(dkv));
        b[i] = b[i].saturating_add(self.kv_bytes(hit.saturating_sub(from_host_end)));
        b[i] = b[i].saturating_add(self.state_bytes());
        b
    }

    fn load_orders(
        &self,
        tier: Tier,
        hit: u32,
        dkv: u32,
        probes: &[Option<Probe>; 2],
        lookups: &[Option<Lookup>; 2],
    ) -> Vec<LoadOrder> {
        let i = tier.index() - 1;
        let host_kv = if i == 1 {
            probes[0].map_or(0, |p| p.kv.min(hit))
        } else {
            hit
        };
        let split = host_kv.max(dkv);
        let page = self.device.config().page_size;
        let pages = |lk: &Option<Lookup>, start: u32, end: u32| -> Vec<u32> {
            match lk {
                Some(l) if !l.kv_pages.is_empty() => {
                    let (s, e) = ((start / page) as usize, (end / page) as usize);
                    l.kv_pages
                        .get(s..e)
                        .map(<[u32]>::to_vec)
                        .unwrap_or_default()
                }
                _ => Vec::new(),
            }
        };
        let mut out = Vec::new();
        if split > dkv {
            out.push(LoadOrder {
                tier: Tier::Host,
                what: LoadWhat::Kv {
                    start: dkv,
                    end: split,
                    pages: pages(&lookups[0], dkv, split),
                },
                bytes: self.kv_bytes(split - dkv),
            });
        }
        if hit > split {
            out.push(LoadOrder {
                tier,
                what: LoadWhat::Kv {
                    start: split,
                    end: hit,
                    pages: pages(&lookups[i], split, hit),
                },
                bytes: self.kv_bytes(hit - split),
            });
        }
        out.push(LoadOrder {
            tier,
            what: LoadWhat::State {
                position: hit,
                slot: lookups[i].as_ref().and_then(|l| l.state_slot),
            },
            bytes: self.state_bytes(),
        });
        out
    }

    /// Admits the request into the device (as [`PrefixCache::admit`]) and
    /// moves what the device evicted or stored into the lower tiers.
    pub fn admit(
        &mut self,
        l: &TieredLookup,
        tokens: &[u32],
        states: &[SavedState],
        kv_pages: &[u32],
    ) -> Result<AdmitOutcome, CacheError> {
        let out = self
            .device
            .admit(l.device.lease, tokens, states, kv_pages)?;
        // Exclusive tiers: the device now holds a state at or beyond the
        // lower-tier hit, so the tier that served it drops that chain (in
        // `settle`, through the lease that pins it).
        if self.cfg.exclusive
            && l.tier != Tier::Device
            && out.states_taken.iter().any(|&p| p >= l.hit_tokens)
        {
            let i = l.tier.index() - 1;
            if let Some(lease) = l.leases[i] {
                if !self.pending.iter().any(|&(j, p, _)| j == i && p == lease) {
                    self.pending.push((i, lease, true));
                }
            }
        }
        if !self.cfg.defer_moves {
            self.settle()?;
        }
        // What the device could not hold (a sequence larger than the room
        // left by leased entries) is in the engine's working memory: it goes
        // straight to the host rather than being lost.
        if self.lower[0].is_some() && (out.rejected.is_some() || out.truncated_to.is_some()) {
            for s in states {
                if !out.states_taken.contains(&s.position) {
                    self.write_lower(0, l.ns, s.position, tokens)?;
                    self.settle_host()?;
                }
            }
        }
        Ok(out)
    }

    /// Releases the lookup's leases in every tier (the lower tiers' in
    /// [`settle`](Self::settle) when moves are deferred).
    pub fn release(&mut self, l: &TieredLookup) -> Result<(), CacheError> {
        for (i, lease) in l.leases.iter().enumerate() {
            let Some(lease) = *lease else { continue };
            if self.pending.iter().any(|&(j, p, _)| j == i && p == lease) {
                continue;
            }
            if self.cfg.defer_moves {
                self.pending.push((i, lease, false));
            } else if let Some(low) = self.lower[i].as_mut() {
                // Unknown once released (a discard in `settle`): no-op.
                let _ = low.cache.release(lease);
            }
        }
        self.device.release(l.device.lease)?;
        if self.cfg.defer_moves {
            return Ok(());
        }
        self.settle()
    }

    /// Evicts from the device until at least `bytes` are free there (as
    /// [`PrefixCache::evict`]) and moves what it evicted into the lower
    /// tiers (unless [`TierConfig::defer_moves`]: then at the next
    /// [`settle`](Self::settle)). Returns the device's free bytes.
    pub fn evict(&mut self, bytes: u64) -> Result<u64, CacheError> {
        let free = self.device.evict(bytes);
        if !self.cfg.defer_moves {
            self.settle()?;
        }
        Ok(free)
    }

    /// Sets the device's unit budget ([`PrefixCache::set_unit_budget`]):
    /// for a memory manager whose units are the device's capacity (a cache
    /// over pools). Refused as there when what is cached does not fit.
    pub fn set_device_unit_budget(&mut self, budget: Option<UnitBudget>) -> Result<(), CacheError> {
        self.device.set_unit_budget(budget)
    }

    /// Evicts the device's lowest-utility candidate
    /// ([`PrefixCache::evict_lowest`]) and moves it into the lower tiers as
    /// [`evict`](Self::evict) does. `None` when there is no candidate.
    pub fn evict_lowest(&mut self, kind: Option<UnitKind>) -> Result<Option<UnitUse>, CacheError> {
        let freed = self.device.evict_lowest(kind);
        if freed.is_some() && !self.cfg.defer_moves {
            self.settle()?;
        }
        Ok(freed)
    }

    /// Drains the device's decision records ([`PrefixCache::drain_log`]);
    /// the lower tiers keep none.
    pub fn drain_device_log(&mut self) -> Vec<crate::Decision> {
        self.device.drain_log()
    }

    /// Turns the device's event stream on for the caller, as
    /// [`PrefixCache::enable_events`] does: the next
    /// [`drain_device_events`](Self::drain_device_events) starts with
    /// `AllCleared` and the device's content. Runs the moves
    /// [`TierConfig::defer_moves`] left waiting first, so that no change
    /// from before is delivered twice. No-op when the events are on.
    pub fn enable_device_events(&mut self) -> Result<(), CacheError> {
        if self.device_events_wanted {
            return Ok(());
        }
        if self.lower[0].is_none() {
            self.device.enable_events();
            self.device_events_wanted = true;
            return Ok(());
        }
        self.settle()?;
        self.device_events = self.device.restart_events();
        self.device_events_wanted = true;
        Ok(())
    }

    /// Turns the caller's device event stream off (what the tiers read of
    /// the device stays on); pending events are dropped.
    pub fn disable_device_events(&mut self) {
        self.device_events_wanted = false;
        self.device_events.clear();
        if self.lower[0].is_none() {
            self.device.disable_events();
        }
    }

    /// The device's events, when the device configuration asked for them
    /// (the tiers read them too, to move entries down).
    pub fn drain_device_events(&mut self) -> Vec<CacheEvent> {
        if self.lower[0].is_none() {
            return self.device.drain_events();
        }
        std::mem::take(&mut self.device_events)
    }

    /// Releases the lower tiers' leases of released lookups, drops the
    /// chains exclusive tiers served, moves what the device evicted
    /// (write-back) or stored (write-through) since the last call into the
    /// host, and the host's into the store. `admit` and `release` call it
    /// unless [`TierConfig::defer_moves`].
    pub fn settle(&mut self) -> Result<(), CacheError> {
        if self.lower[0].is_none() {
            return Ok(());
        }
        if !self.pending.is_empty() {
            // What the host evicted so far is demoted; what it discards
            // now is not (the device holds it). With ops recorded the
            // host's log is empty here (each write into it is settled at
            // once); settling it now keeps its drops before the discards'.
            if self.ops.is_some() {
                self.settle_host()?;
            } else {
                let before = self.drain_log(1);
                self.host_pending.extend(before);
            }
            for (i, lease, discard) in std::mem::take(&mut self.pending) {
                let Some(low) = self.lower[i].as_mut() else {
                    continue;
                };
                // Unknown leases (released already) are no-ops.
                let _ = if discard {
                    low.cache.release_discarding(lease).map(drop)
                } else {
                    low.cache.release(lease)
                };
                // A discarded chain is dropped from its tier (the engine
                // frees its copy there), not moved further down.
                let d = self.drain_log(i + 1);
                self.record_drops(i, &d.removed);
            }
        }
        let mut d = self.drain_log(0);
        let chains = self.to_move(&mut d);
        self.move_down(0, &chains)?;
        self.release_freed();
        Ok(())
    }

    /// What tier `t`'s log (0 device, 1 host, 2 store) recorded since the
    /// last call: the states it stored (a full log only) and removed, as
    /// chains. The device's events are kept for the caller when it asked
    /// for them.
    fn drain_log(&mut self, t: usize) -> Drained {
        let wanted = t == 0 && self.device_events_wanted;
        let cache = match t {
            0 => &mut self.device,
            _ => match self.lower[t - 1].as_mut() {
                Some(l) => &mut l.cache,
                None => return Drained::default(),
            },
        };
        let mut d = Drained {
            stored: Vec::new(),
            removed: cache
                .drain_removed()
                .into_iter()
                .map(|r| (r.ns, r.position, r.tokens()))
                .collect(),
        };
        let events = cache.drain_events();
        for e in &events {
            match e {
                CacheEvent::StateRemoved {
                    ns,
                    position,
                    prefix,
                } => d.removed.push((*ns, *position, Arc::clone(prefix))),
                CacheEvent::StateStored {
                    ns,
                    position,
                    prefix,
                } => d.stored.push((*ns, *position, Arc::clone(prefix))),
                _ => {}
            }
        }
        if wanted {
            self.device_events.extend(events);
        }
        d
    }

    /// The chains of `d` the tier below receives: what was evicted
    /// (write-back) or stored (write-through).
    fn to_move(&self, d: &mut Drained) -> Vec<Chain> {
        match self.cfg.write {
            WriteMode::Back => d.removed.clone(),
            WriteMode::Through => std::mem::take(&mut d.stored),
        }
    }

    /// Writes `chains` (of the tier above lower tier `i`) into lower tier
    /// `i`, then what that moved out of the host into the store. When ops
    /// are recorded, each write is followed by the drops it caused (and,
    /// into the host, by the store's writes of what the host evicted), so
    /// that an engine replaying them sees a drop after the write that
    /// caused it and before a later write of the same chain.
    fn move_down(&mut self, i: usize, chains: &[Chain]) -> Result<(), CacheError> {
        if self.lower[i].is_none() {
            return Ok(());
        }
        for (ns, position, prefix) in chains {
            self.write_lower(i, *ns, *position, prefix)?;
            if self.ops.is_some() {
                if i == 0 {
                    self.settle_host()?;
                } else {
                    let d = self.drain_log(2);
                    self.record_drops(1, &d.removed);
                }
            }
        }
        if i == 0 {
            self.settle_host()?;
        }
        Ok(())
    }

    /// Moves the host's evictions or stores into the store, then records
    /// the host's drops (after the store's writes that copy from them) and
    /// the store's.
    fn settle_host(&mut self) -> Result<(), CacheError> {
        if self.lower[1].is_none() && self.ops.is_none() {
            return Ok(());
        }
        let mut d = std::mem::take(&mut self.host_pending);
        d.extend(self.drain_log(1));
        let chains = self.to_move(&mut d);
        self.move_down(1, &chains)?;
        self.record_drops(0, &d.removed);
        let s = self.drain_log(2);
        self.record_drops(1, &s.removed);
        Ok(())
    }

    /// Records `removed` as drops from lower tier `i` (when ops are
    /// recorded).
    fn record_drops(&mut self, i: usize, removed: &[Chain]) {
        let Some(ops) = self.ops.as_mut() else {
            return;
        };
        let from = if i == 0 { Tier::Host } else { Tier::Store };
        for (ns, position, prefix) in removed {
            ops.push(TierOp::Drop {
                from,
                ns: *ns,
                position: *position,
                prefix: prefix[..(*position as usize).min(prefix.len())].to_vec(),
            });
        }
    }

    fn write_lower(
        &mut self,
        i: usize,
        ns: u64,
        position: u32,
        prefix: &[u32],
    ) -> Result<(), CacheError> {
        let record = self.ops.is_some();
        let p = position as usize;
        if p == 0 || p > prefix.len() {
            return Ok(());
        }
        let chain_bytes = self.kv_bytes(position).saturating_add(self.state_bytes());
        if !self.cfg.always_load
            && self.load_time(i, chain_bytes) >= self.recompute_time(0, position)
        {
            self.stats.demotions_skipped += 1;
            return Ok(());
        }
        let Some(l) = self.lower[i].as_mut() else {
            return Ok(());
        };
        let tokens = &prefix[..p];
        let lk = l.cache.lookup(ns, tokens)?;
        let state = [SavedState {
            position,
            slot: None,
        }];
        let admitted = l.cache.admit(lk.lease, tokens, &state, &[]);
        l.cache.release(lk.lease)?;
        let out = admitted?;
        if !out.states_taken.contains(&position) {
            // Not written (the chain does not fit, or the tier holds this
            // state already): KV the admission kept without its state
            // would be bytes no chain of the engine's copies holds.
            l.cache.prune_stateless_tail(ns, tokens);
            return Ok(());
        }
        {
            let tier = if i == 0 { Tier::Host } else { Tier::Store };
            // What the tier charges for the chain (its KV and its state),
            // whatever it shares with chains it holds: the engine copies
            // the whole chain.
            let bytes = chain_bytes;
            self.stats.bytes_written[tier.index()] += bytes;
            self.stats.writes[tier.index()] += 1;
            self.moves.push(Move {
                to: tier,
                ns,
                position,
                bytes,
            });
            if let (true, Some(ops)) = (record, self.ops.as_mut()) {
                ops.push(TierOp::Write {
                    to: tier,
                    ns,
                    position,
                    bytes,
                    prefix: tokens.to_vec(),
                });
            }
        }
        Ok(())
    }

    /// One whole request, as a sequential simulator runs it: lookup, the
    /// loads, admission of `full` with the planned states above the hit and
    /// the final state, release. `full[..input_len]` is the input.
    pub fn serve_full(
        &mut self,
        ns: u64,
        input_len: usize,
        full: &[u32],
    ) -> Result<TieredLookup, CacheError> {
        self.serve_full_hinted(ns, input_len, full, &[])
    }

    /// [`serve_full`](Self::serve_full) with application checkpoint hints.
    pub fn serve_full_hinted(
        &mut self,
        ns: u64,
        input_len: usize,
        full: &[u32],
        checkpoints: &[u32],
    ) -> Result<TieredLookup, CacheError> {
        if input_len > full.len() {
            return Err(CacheError::PrefixMismatch { input_len });
        }
        let l = self.lookup_hinted(ns, &full[..input_len], checkpoints)?;
        let mut states = self.device.states_to_save(&l.device, full.len());
        states.retain(|s| {
            s.position > l.hit_tokens || (s.position == l.hit_tokens && l.tier != Tier::Device)
        });
        let admitted = self.admit(&l, full, &states, &[]);
        let released = self.release(&l);
        admitted?;
        released?;
        Ok(l)
    }

    /// Counts a looked-up request.
    fn account(&mut self, l: &TieredLookup, input_len: usize) {
        let m = &self.device.config().model;
        let s = &mut self.stats;
        s.requests += 1;
        s.input_tokens += input_len as u64;
        s.hit_tokens += l.hit_tokens as u64;
        if l.hit_tokens > 0 {
            s.hit_tokens_by_tier[l.tier.index()] += l.hit_tokens as u64;
            s.hits_by_tier[l.tier.index()] += 1;
        }
        for o in &l.loads {
            s.bytes_loaded[o.tier.index()] += o.bytes;
        }
        if l.declined.is_some() {
            s.loads_declined += 1;
        }
        if l.shared {
            s.shared_hits += 1;
            s.shared_hit_tokens += l.hit_tokens as u64;
        }
        s.load_s += l.load_s;
        s.flops_saved += m.prefill_flops(0, l.hit_tokens as u64);
        s.flops_total += m.prefill_flops(0, input_len as u64);
    }

    /// Checks every tier's invariants and that none holds more than its
    /// capacity (panics otherwise; for tests).
    pub fn check_invariants(&self) {
        self.device.check_invariants();
        for l in self.lower.iter().flatten() {
            l.cache.check_invariants();
            assert!(l.cache.used_bytes() <= l.cache.config().capacity_bytes);
        }
    }
}
