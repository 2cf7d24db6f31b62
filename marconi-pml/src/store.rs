//! The module store: a registered schema's modules as cache entries of its
//! namespace, pinned while the schema is registered, counted in one byte
//! budget, evicted by utility once unpinned; and the lookup that says, per
//! segment of a layout, which entry serves it and how.
//!
//! Two kinds of entry, never interchanged:
//!
//! * a **module entry** (one per named module and per anonymous text of a
//!   schema): the module's KV in every attention layer, computed on its own
//!   at its schema positions (Prompt Cache §3.3), and for hybrid models its
//!   end state from a zero state `h_B(0)` and its transition operator `Φ_B`
//!   (what composition needs: `h(A.B) = Φ_B h(A) + h_B(0)`). Served by
//!   [`ReuseMode::Attention`] and, after the exact run, by
//!   [`ReuseMode::Composed`]. Registration reserves every module entry of
//!   the schema (resident or not yet computed): pinned bytes.
//! * an **exact entry** (one per segment of a leading run, keyed by the run
//!   up to it): the segment's KV in every layer computed in context from
//!   position 0 and, for hybrids, the recurrent state at its end: an
//!   ordinary prefix's states. Served by [`ReuseMode::Exact`] and
//!   [`ReuseMode::Composed`] for the run. Never pinned: admitted when it
//!   fits after evicting unpinned entries, else refused.

use std::collections::HashMap;
use std::fmt;

use crate::layout::{Encoded, Layout, SegmentKind};
use crate::reuse::{namespace, ReuseMode};
use crate::schema::ModuleId;

/// The sizes and costs of a model's entries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModuleModel {
    /// KV bytes of one token across every attention layer (K and V).
    pub kv_bytes_per_token: u64,
    /// Bytes of the recurrent state of every SSM layer at one position
    /// (0: attention-only model).
    pub state_bytes: u64,
    /// Bytes of a module's transition operator `Φ_B` across SSM layers
    /// (hybrids; what state composition multiplies the incoming state by).
    pub operator_bytes: u64,
    /// Prefill FLOPs of `n` tokens are `flops_per_token · n +
    /// flops_per_token_squared · n²` (attention's quadratic term). With
    /// only byte sizes known, 1 and 0: FLOPs saved counts tokens.
    pub flops_per_token: f64,
    /// The quadratic coefficient (see `flops_per_token`).
    pub flops_per_token_squared: f64,
}

impl ModuleModel {
    /// An attention-only model with `kv_bytes_per_token` bytes of KV per
    /// token (all layers); FLOPs counted as tokens.
    pub fn attention(kv_bytes_per_token: u64) -> ModuleModel {
        ModuleModel::hybrid(kv_bytes_per_token, 0, 0)
    }

    /// A hybrid model: KV bytes per token (all attention layers), state
    /// bytes (all SSM layers) and transition-operator bytes per module.
    pub fn hybrid(kv_bytes_per_token: u64, state_bytes: u64, operator_bytes: u64) -> ModuleModel {
        ModuleModel {
            kv_bytes_per_token,
            state_bytes,
            operator_bytes,
            flops_per_token: 1.0,
            flops_per_token_squared: 0.0,
        }
    }

    /// Whether the model has recurrent layers (a state to carry).
    pub fn is_hybrid(&self) -> bool {
        self.state_bytes > 0
    }

    fn flops(&self, tokens: u32) -> f64 {
        let n = f64::from(tokens);
        self.flops_per_token * n + self.flops_per_token_squared * n * n
    }

    fn kv(&self, tokens: u32) -> u64 {
        self.kv_bytes_per_token.saturating_mul(u64::from(tokens))
    }
}

/// A registered schema, as [`ModuleCache::register`] returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SchemaId(pub u64);

/// One resident entry. Ids are never reused: an entry evicted and admitted
/// again gets a new id, so an engine's map from ids to its memory never
/// aliases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EntryId(pub u64);

/// A module of a schema: named, or the `i`-th anonymous text (in the
/// order of [`Encoded::anonymous_segments`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModuleRef {
    /// A named module.
    Named(ModuleId),
    /// The schema's `i`-th anonymous text.
    Anonymous(usize),
}

/// How one segment of a layout is served by a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Served {
    /// By an exact entry: KV of every layer and the state at its end, as an
    /// ordinary prefix (Exact and Composed modes, the leading run).
    Exact,
    /// By a module entry's KV at the schema's positions (Attention mode).
    Attention,
    /// By a module entry's KV and a composed state; the segment's first
    /// `recomputed` tokens are computed again (Composed mode, after the run).
    Composed {
        /// Tokens recomputed at the segment's start.
        recomputed: u32,
    },
    /// Cacheable, but the mode does not reuse it here (Exact mode, after
    /// the run): computed, not admitted.
    Recomputed,
    /// Cacheable and not resident: the engine computes it and admits it
    /// ([`ModuleCache::admit`] for a module entry, [`ModuleCache::admit_exact`]
    /// in the leading run).
    Miss,
    /// Never cached: an argument or the prompt's own text.
    Computed,
}

impl Served {
    /// `exact`, `attention`, `composed`, `recomputed`, `miss` or `computed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Served::Exact => "exact",
            Served::Attention => "attention",
            Served::Composed { .. } => "composed",
            Served::Recomputed => "recomputed",
            Served::Miss => "miss",
            Served::Computed => "computed",
        }
    }

    /// Whether an entry serves it.
    pub fn is_hit(self) -> bool {
        matches!(
            self,
            Served::Exact | Served::Attention | Served::Composed { .. }
        )
    }
}

/// One segment's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentLookup {
    /// How it is served.
    pub served: Served,
    /// The entry that serves it (hits only).
    pub entry: Option<EntryId>,
    /// The module it belongs to (module and anonymous text; for an
    /// argument, its module).
    pub module: Option<ModuleRef>,
}

/// What a lookup reuses, segment by segment, under one [`ReuseMode`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleLookup {
    /// The mode asked for.
    pub mode: ReuseMode,
    /// One per segment of the layout.
    pub segments: Vec<SegmentLookup>,
    /// Segments in the layout's exact leading run (cached, from position
    /// 0, no gap), whether resident or not.
    pub exact_run: usize,
}

impl ModuleLookup {
    /// Segments an entry serves.
    pub fn hits(&self) -> usize {
        self.segments.iter().filter(|s| s.served.is_hit()).count()
    }

    /// Segments to compute and admit.
    pub fn misses(&self) -> usize {
        self.segments
            .iter()
            .filter(|s| s.served == Served::Miss)
            .count()
    }

    /// Tokens of `layout` whose states come from entries.
    pub fn reused_tokens(&self, layout: &Layout) -> u64 {
        self.segments
            .iter()
            .zip(&layout.segments)
            .map(|(r, s)| match r.served {
                Served::Exact | Served::Attention => u64::from(s.len),
                Served::Composed { recomputed } => u64::from(s.len - recomputed.min(s.len)),
                _ => 0,
            })
            .sum()
    }
}

/// Counters and sizes ([`ModuleCache::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModuleCacheStats {
    /// Lookups answered.
    pub lookups: u64,
    /// Segments served by an entry.
    pub hits: u64,
    /// Cacheable segments not resident (to compute and admit).
    pub misses: u64,
    /// Cacheable segments the mode computes again (Exact, after the run).
    pub recomputed: u64,
    /// Entries admitted.
    pub admissions: u64,
    /// Admissions and registrations refused for lack of room.
    pub refused: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Resident entries.
    pub entries: u64,
    /// Bytes of resident entries.
    pub resident_bytes: u64,
    /// Bytes reserved by registered schemas (every module entry, resident
    /// or not): never evicted.
    pub pinned_bytes: u64,
    /// Bytes counted against the budget: pinned plus resident unpinned.
    pub used_bytes: u64,
    /// The budget.
    pub capacity_bytes: u64,
    /// Registered schemas.
    pub schemas: u64,
}

/// Why a call was refused. Nothing changes when a call fails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The budget is 0 bytes.
    ZeroCapacity,
    /// `kv_bytes_per_token` is 0 (a module cache needs attention KV).
    ZeroKvBytes,
    /// Registering would pin more than the budget.
    OverBudget {
        /// Bytes the schema's module entries take.
        need: u64,
        /// Bytes already pinned by other registered schemas.
        pinned: u64,
        /// The budget.
        capacity: u64,
    },
    /// An exact entry does not fit, even with every unpinned entry evicted.
    DoesNotFit {
        /// Its bytes.
        need: u64,
        /// Bytes not pinned.
        unpinned: u64,
    },
    /// No registered schema has this id (never given, or unregistered).
    UnknownSchema(SchemaId),
    /// The schema has no such module.
    UnknownModule(ModuleRef),
    /// The schema has no module of this name.
    NoModuleNamed(String),
    /// The mode does not apply to this model.
    ModeNotApplicable {
        /// The mode asked for.
        mode: ReuseMode,
        /// Whether the model is hybrid.
        hybrid: bool,
    },
    /// The layout is not one of this schema's.
    ForeignLayout {
        /// The first segment that does not match.
        segment: usize,
    },
    /// `admit_exact` of a segment outside the layout's exact leading run.
    NotInExactRun {
        /// The segment asked for.
        segment: usize,
        /// The run's length.
        run: usize,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::ZeroCapacity => write!(f, "capacity is 0 bytes"),
            StoreError::ZeroKvBytes => write!(f, "kv_bytes_per_token is 0"),
            StoreError::OverBudget {
                need,
                pinned,
                capacity,
            } => write!(
                f,
                "the schema's modules take {need} bytes; {pinned} of {capacity} are pinned by registered schemas"
            ),
            StoreError::DoesNotFit { need, unpinned } => write!(
                f,
                "the entry takes {need} bytes; only {unpinned} bytes are not pinned"
            ),
            StoreError::UnknownSchema(id) => write!(f, "schema {} is not registered", id.0),
            StoreError::UnknownModule(m) => write!(f, "the schema has no module {m:?}"),
            StoreError::NoModuleNamed(n) => write!(f, "the schema has no module named '{n}'"),
            StoreError::ModeNotApplicable { mode, hybrid } => write!(
                f,
                "mode {mode:?} does not apply to an {} model",
                if *hybrid { "hybrid" } else { "attention-only" }
            ),
            StoreError::ForeignLayout { segment } => write!(
                f,
                "segment {segment} of the layout is not one of this schema's"
            ),
            StoreError::NotInExactRun { segment, run } => write!(
                f,
                "segment {segment} is not in the layout's exact run ({run} segments)"
            ),
        }
    }
}

impl std::error::Error for StoreError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Module(ModuleRef),
    /// Hash of the exact run up to and including the segment.
    Exact(u64),
}

#[derive(Clone, Debug)]
struct Entry {
    id: EntryId,
    bytes: u64,
    flops: f64,
    last_use: u64,
}

/// An unpinned resident entry, as eviction ranks it.
struct Candidate {
    key: (u64, Key),
    last_use: u64,
    efficiency: f64,
    id: EntryId,
    bytes: u64,
}

#[derive(Clone, Debug)]
struct Registered {
    enc: Encoded,
    ns: u64,
    refs: u32,
    /// Bytes of every module entry: pinned.
    reserved: u64,
}

/// The module store. See the module docs for what an entry holds.
///
/// Eviction (Marconi's utility, paper §4.2 eq. 2): among unpinned resident
/// entries, the one with the lowest `norm(recency) + α · norm(efficiency)`
/// goes first, where recency is the tick of its last use, efficiency its
/// prefill FLOPs saved per byte, and `norm` min-max scales over the
/// candidates (ties: the older id first). α is [`ModuleCache::ALPHA`].
#[derive(Clone, Debug)]
pub struct ModuleCache {
    model: ModuleModel,
    capacity: u64,
    schemas: HashMap<SchemaId, Registered>,
    entries: HashMap<(u64, Key), Entry>,
    next_schema: u64,
    next_entry: u64,
    tick: u64,
    pinned: u64,
    unpinned_resident: u64,
    evicted: Vec<EntryId>,
    stats: ModuleCacheStats,
}

impl ModuleCache {
    /// The weight of FLOP efficiency against recency in eviction.
    pub const ALPHA: f64 = 1.0;

    /// An empty store of `capacity_bytes`.
    ///
    /// # Errors
    /// [`StoreError::ZeroCapacity`], [`StoreError::ZeroKvBytes`].
    pub fn new(model: ModuleModel, capacity_bytes: u64) -> Result<ModuleCache, StoreError> {
        if capacity_bytes == 0 {
            return Err(StoreError::ZeroCapacity);
        }
        if model.kv_bytes_per_token == 0 {
            return Err(StoreError::ZeroKvBytes);
        }
        Ok(ModuleCache {
            model,
            capacity: capacity_bytes,
            schemas: HashMap::new(),
            entries: HashMap::new(),
            next_schema: 1,
            next_entry: 1,
            tick: 0,
            pinned: 0,
            unpinned_resident: 0,
            evicted: Vec::new(),
            stats: ModuleCacheStats::default(),
        })
    }

    /// The model the sizes come from.
    pub fn model(&self) -> &ModuleModel {
        &self.model
    }

    /// The bytes a module entry takes: its own tokens' KV (text and
    /// parameter placeholders, nested modules aside) plus, for hybrids, its
    /// end state and transition operator.
    pub fn module_bytes(&self, enc: &Encoded, m: ModuleRef) -> Option<u64> {
        let tokens = module_tokens(enc, m)?;
        Some(
            self.model
                .kv(tokens)
                .saturating_add(self.model.state_bytes)
                .saturating_add(self.model.operator_bytes),
        )
    }

    fn modules_of(enc: &Encoded) -> impl Iterator<Item = ModuleRef> {
        let named = (0..enc.schema().modules().len()).map(|i| ModuleRef::Named(ModuleId(i)));
        let anon = (0..enc.anonymous_segments().len()).map(ModuleRef::Anonymous);
        named.chain(anon)
    }

    fn schema_bytes(&self, enc: &Encoded) -> u64 {
        Self::modules_of(enc)
            .filter_map(|m| self.module_bytes(enc, m))
            .fold(0u64, u64::saturating_add)
    }

    fn is_registered_ns(&self, ns: u64) -> bool {
        self.schemas.values().any(|r| r.ns == ns)
    }

    fn is_pinned(&self, ns: u64, key: Key) -> bool {
        matches!(key, Key::Module(_)) && self.is_registered_ns(ns)
    }

    /// Registers `enc` (its namespace is [`namespace`]): reserves and pins
    /// every module entry of it, evicting unpinned entries by utility to
    /// make room. Module entries of the same schema still resident from an
    /// earlier registration are pinned again and served at once.
    /// Registering a schema already registered returns its id and counts
    /// one more registration ([`unregister`](Self::unregister) once each).
    ///
    /// # Errors
    /// [`StoreError::OverBudget`] when the schema's module entries and
    /// those already pinned exceed the budget; nothing is evicted then.
    pub fn register(&mut self, enc: &Encoded) -> Result<SchemaId, StoreError> {
        let ns = namespace(enc);
        if let Some((&id, r)) = self.schemas.iter_mut().find(|(_, r)| r.ns == ns) {
            r.refs = r.refs.saturating_add(1);
            return Ok(id);
        }
        let need = self.schema_bytes(enc);
        if self.pinned.saturating_add(need) > self.capacity {
            self.stats.refused += 1;
            return Err(StoreError::OverBudget {
                need,
                pinned: self.pinned,
                capacity: self.capacity,
            });
        }
        // Its resident module entries move from unpinned to pinned.
        let own: u64 = self
            .entries
            .iter()
            .filter(|((n, k), _)| *n == ns && matches!(k, Key::Module(_)))
            .map(|(_, e)| e.bytes)
            .sum();
        self.unpinned_resident -= own;
        self.pinned += need;
        let id = SchemaId(self.next_schema);
        self.next_schema += 1;
        self.schemas.insert(
            id,
            Registered {
                enc: enc.clone(),
                ns,
                refs: 1,
                reserved: need,
            },
        );
        self.make_room(0);
        self.check();
        Ok(id)
    }

    /// Drops one registration of `id`; at the last one its module entries
    /// become unpinned (still resident, evicted by utility when the budget
    /// needs room) and its reservation for modules not resident is freed.
    ///
    /// # Errors
    /// [`StoreError::UnknownSchema`] (also on a second unregister).
    pub fn unregister(&mut self, id: SchemaId) -> Result<(), StoreError> {
        let r = self
            .schemas
            .get_mut(&id)
            .ok_or(StoreError::UnknownSchema(id))?;
        if r.refs > 1 {
            r.refs -= 1;
            return Ok(());
        }
        let Some(r) = self.schemas.remove(&id) else {
            return Err(StoreError::UnknownSchema(id));
        };
        self.pinned -= r.reserved;
        let own: u64 = self
            .entries
            .iter()
            .filter(|((n, k), _)| *n == r.ns && matches!(k, Key::Module(_)))
            .map(|(_, e)| e.bytes)
            .sum();
        self.unpinned_resident += own;
        self.check();
        Ok(())
    }

    fn schema(&self, id: SchemaId) -> Result<&Registered, StoreError> {
        self.schemas.get(&id).ok_or(StoreError::UnknownSchema(id))
    }

    /// Admits module `m` of schema `id` once the engine has computed it (its
    /// KV and, for hybrids, `h_B(0)` and `Φ_B`). Its bytes were reserved at
    /// registration: it always fits. Admitting a resident module returns
    /// its entry unchanged.
    ///
    /// # Errors
    /// [`StoreError::UnknownSchema`], [`StoreError::UnknownModule`].
    pub fn admit(&mut self, id: SchemaId, m: ModuleRef) -> Result<EntryId, StoreError> {
        let r = self.schema(id)?;
        let ns = r.ns;
        let Some(bytes) = self.module_bytes(&r.enc, m) else {
            return Err(StoreError::UnknownModule(m));
        };
        let flops = self.model.flops(module_tokens(&r.enc, m).unwrap_or(0));
        let key = (ns, Key::Module(m));
        self.tick += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            e.last_use = self.tick;
            return Ok(e.id);
        }
        let id = self.insert(key, bytes, flops);
        self.check();
        Ok(id)
    }

    /// The module `name` of schema `id` (named modules only).
    ///
    /// # Errors
    /// [`StoreError::UnknownSchema`], [`StoreError::NoModuleNamed`].
    pub fn module_named(&self, id: SchemaId, name: &str) -> Result<ModuleRef, StoreError> {
        let r = self.schema(id)?;
        r.enc
            .schema()
            .find(name)
            .map(ModuleRef::Named)
            .ok_or_else(|| StoreError::NoModuleNamed(name.into()))
    }

    /// Admits the exact entry of segment `segment` of `layout` (which must
    /// be in the layout's exact leading run) once the engine has computed
    /// the run up to it in context: the segment's KV in every layer and,
    /// for hybrids, the state at its end. Evicts unpinned entries by
    /// utility to make room. Admitting a resident one returns it.
    ///
    /// # Errors
    /// [`StoreError::UnknownSchema`], [`StoreError::ForeignLayout`],
    /// [`StoreError::NotInExactRun`], [`StoreError::DoesNotFit`] (nothing
    /// is evicted then).
    pub fn admit_exact(
        &mut self,
        id: SchemaId,
        layout: &Layout,
        segment: usize,
    ) -> Result<EntryId, StoreError> {
        let r = self.schema(id)?;
        let ns = r.ns;
        let refs = resolve(&r.enc, layout)?;
        let run = exact_run(layout);
        if segment >= run {
            return Err(StoreError::NotInExactRun { segment, run });
        }
        let keys = run_keys(ns, layout, &refs, run);
        let len = layout.segments[segment].len;
        let bytes = self.model.kv(len).saturating_add(self.model.state_bytes);
        let key = (ns, Key::Exact(keys[segment]));
        self.tick += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            e.last_use = self.tick;
            return Ok(e.id);
        }
        let unpinned = self.capacity - self.pinned;
        if bytes > unpinned {
            self.stats.refused += 1;
            return Err(StoreError::DoesNotFit {
                need: bytes,
                unpinned,
            });
        }
        self.make_room(bytes);
        let flops = self.model.flops(len);
        let id = self.insert(key, bytes, flops);
        self.check();
        Ok(id)
    }

    fn insert(&mut self, key: (u64, Key), bytes: u64, flops: f64) -> EntryId {
        let id = EntryId(self.next_entry);
        self.next_entry += 1;
        if !self.is_pinned(key.0, key.1) {
            self.unpinned_resident += bytes;
        }
        self.entries.insert(
            key,
            Entry {
                id,
                bytes,
                flops,
                last_use: self.tick,
            },
        );
        self.stats.admissions += 1;
        id
    }

    /// Evicts unpinned entries by utility until `extra` more bytes fit.
    /// The caller has checked that `pinned + extra <= capacity`.
    fn make_room(&mut self, extra: u64) {
        if self.used() + extra <= self.capacity {
            return;
        }
        let registered: Vec<u64> = self.schemas.values().map(|r| r.ns).collect();
        let mut cands: Vec<Candidate> = self
            .entries
            .iter()
            .filter(|((ns, k), _)| !(matches!(k, Key::Module(_)) && registered.contains(ns)))
            .map(|(k, e)| Candidate {
                key: *k,
                last_use: e.last_use,
                efficiency: if e.bytes == 0 {
                    f64::MAX
                } else {
                    e.flops / e.bytes as f64
                },
                id: e.id,
                bytes: e.bytes,
            })
            .collect();
        let range = |xs: &mut dyn Iterator<Item = f64>| {
            xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
                (lo.min(x), hi.max(x))
            })
        };
        let (rlo, rhi) = range(&mut cands.iter().map(|c| c.last_use as f64));
        let (elo, ehi) = range(&mut cands.iter().map(|c| c.efficiency));
        let norm = |x: f64, lo: f64, hi: f64| if hi > lo { (x - lo) / (hi - lo) } else { 0.0 };
        let score = |c: &Candidate| {
            norm(c.last_use as f64, rlo, rhi) + Self::ALPHA * norm(c.efficiency, elo, ehi)
        };
        cands.sort_by(|a, b| score(a).total_cmp(&score(b)).then(a.id.cmp(&b.id)));
        for c in cands {
            if self.used() + extra <= self.capacity {
                break;
            }
            self.entries.remove(&c.key);
            self.unpinned_resident -= c.bytes;
            self.evicted.push(c.id);
            self.stats.evictions += 1;
        }
    }

    fn used(&self) -> u64 {
        self.pinned + self.unpinned_resident
    }

    /// Says, segment by segment, how `layout` (a prompt of schema `id`) is
    /// served under `mode`, and which entries serve it. The modes are never
    /// mixed: Attention serves module entries only (attention-only models);
    /// Exact serves the leading run from exact entries and recomputes the
    /// rest; Composed serves the run from exact entries and later cached
    /// segments from module entries with a recomputed window (hybrids). In
    /// the run, a segment whose exact entry (or a predecessor's) is not
    /// resident is a miss, and so is every run segment after it. Entries
    /// used count as used now (recency).
    ///
    /// # Errors
    /// [`StoreError::UnknownSchema`], [`StoreError::ModeNotApplicable`]
    /// (Attention on a hybrid, Composed on an attention-only model),
    /// [`StoreError::ForeignLayout`].
    pub fn lookup(
        &mut self,
        id: SchemaId,
        layout: &Layout,
        mode: ReuseMode,
    ) -> Result<ModuleLookup, StoreError> {
        let hybrid = self.model.is_hybrid();
        match (mode, hybrid) {
            (ReuseMode::Attention, true) | (ReuseMode::Composed { .. }, false) => {
                return Err(StoreError::ModeNotApplicable { mode, hybrid })
            }
            _ => {}
        }
        let r = self.schema(id)?;
        let ns = r.ns;
        let refs = resolve(&r.enc, layout)?;
        let run = exact_run(layout);
        let keys = run_keys(ns, layout, &refs, run);
        self.tick += 1;
        let tick = self.tick;
        let mut chain = true;
        let mut out = Vec::with_capacity(layout.segments.len());
        for (i, (s, m)) in layout.segments.iter().zip(&refs).enumerate() {
            let (served, key) = if !s.cached {
                (Served::Computed, None)
            } else {
                match mode {
                    ReuseMode::Attention => (Served::Attention, m.map(Key::Module)),
                    _ if i < run => (Served::Exact, Some(Key::Exact(keys[i]))),
                    ReuseMode::Exact => (Served::Recomputed, None),
                    ReuseMode::Composed { window } => (
                        Served::Composed {
                            recomputed: window.min(s.len),
                        },
                        m.map(Key::Module),
                    ),
                }
            };
            let mut entry = None;
            let served = match key {
                None => served,
                Some(k) => match self.entries.get_mut(&(ns, k)) {
                    Some(e) if served != Served::Exact || chain => {
                        e.last_use = tick;
                        entry = Some(e.id);
                        served
                    }
                    _ => {
                        if served == Served::Exact {
                            chain = false;
                        }
                        Served::Miss
                    }
                },
            };
            match served {
                Served::Miss => self.stats.misses += 1,
                Served::Recomputed => self.stats.recomputed += 1,
                s if s.is_hit() => self.stats.hits += 1,
                _ => {}
            }
            out.push(SegmentLookup {
                served,
                entry,
                module: *m,
            });
        }
        self.stats.lookups += 1;
        Ok(ModuleLookup {
            mode,
            segments: out,
            exact_run: run,
        })
    }

    /// Entries evicted since the last call, oldest first: the engine frees
    /// their memory.
    pub fn drain_evicted(&mut self) -> Vec<EntryId> {
        std::mem::take(&mut self.evicted)
    }

    /// Evicted entries not drained yet.
    pub fn evicted_pending(&self) -> usize {
        self.evicted.len()
    }

    /// Whether entry `e` is resident.
    pub fn is_resident(&self, e: EntryId) -> bool {
        self.entries.values().any(|x| x.id == e)
    }

    /// Counters and sizes.
    pub fn stats(&self) -> ModuleCacheStats {
        ModuleCacheStats {
            entries: self.entries.len() as u64,
            resident_bytes: self.entries.values().map(|e| e.bytes).sum(),
            pinned_bytes: self.pinned,
            used_bytes: self.used(),
            capacity_bytes: self.capacity,
            schemas: self.schemas.len() as u64,
            ..self.stats
        }
    }

    /// Recounts the byte accounting from the entries and checks the budget;
    /// `Err` names the first broken invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        let pinned: u64 = self.schemas.values().map(|r| r.reserved).sum();
        if pinned != self.pinned {
            return Err(format!("pinned {} != recount {pinned}", self.pinned));
        }
        let unpinned: u64 = self
            .entries
            .iter()
            .filter(|((ns, k), _)| !self.is_pinned(*ns, *k))
            .map(|(_, e)| e.bytes)
            .sum();
        if unpinned != self.unpinned_resident {
            return Err(format!(
                "unpinned {} != recount {unpinned}",
                self.unpinned_resident
            ));
        }
        if self.used() > self.capacity {
            return Err(format!("used {} > capacity {}", self.used(), self.capacity));
        }
        Ok(())
    }

    fn check(&self) {
        debug_assert_eq!(self.check_invariants(), Ok(()));
    }
}

/// Tokens of a module's own encoding (text and parameter placeholders).
fn module_tokens(enc: &Encoded, m: ModuleRef) -> Option<u32> {
    match m {
        ModuleRef::Named(id) => {
            if id.0 >= enc.schema().modules().len() {
                return None;
            }
            Some(
                enc.module_segments(id)
                    .iter()
                    .fold(0u32, |a, s| a.saturating_add(s.len)),
            )
        }
        ModuleRef::Anonymous(i) => enc.anonymous_segments().get(i).map(|s| s.len),
    }
}

/// Each segment's module, checking that the layout is one of `enc`'s: a
/// cached segment is a text of its module (or an anonymous text) at the
/// schema's positions.
fn resolve(enc: &Encoded, layout: &Layout) -> Result<Vec<Option<ModuleRef>>, StoreError> {
    let anon = enc.anonymous_segments();
    let n_modules = enc.schema().modules().len();
    layout
        .segments
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let bad = StoreError::ForeignLayout { segment: i };
            if s.start.checked_add(s.len).is_none() {
                return Err(bad);
            }
            let named = |m: Option<ModuleId>| match m {
                Some(m) if m.0 < n_modules => Ok(m),
                _ => Err(bad.clone()),
            };
            match s.kind {
                SegmentKind::Module => {
                    let m = named(s.module)?;
                    let ok = s.cached
                        && enc.module_segments(m).iter().any(|g| {
                            g.kind == SegmentKind::Module && g.start == s.start && g.len == s.len
                        });
                    if !ok {
                        return Err(bad);
                    }
                    Ok(Some(ModuleRef::Named(m)))
                }
                SegmentKind::Anonymous => {
                    let k = anon
                        .iter()
                        .position(|g| g.start == s.start && g.len == s.len)
                        .filter(|_| s.cached && s.module.is_none())
                        .ok_or(bad)?;
                    Ok(Some(ModuleRef::Anonymous(k)))
                }
                SegmentKind::Param => {
                    if s.cached {
                        return Err(bad);
                    }
                    Ok(Some(ModuleRef::Named(named(s.module)?)))
                }
                SegmentKind::Text => {
                    if s.cached || s.module.is_some() {
                        return Err(bad);
                    }
                    Ok(None)
                }
            }
        })
        .collect()
}

/// Segments of the exact leading run: cached, from position 0, no gap.
fn exact_run(layout: &Layout) -> usize {
    let mut next = 0u32;
    layout
        .segments
        .iter()
        .take_while(|s| {
            let ok = s.cached && s.start == next;
            next = s.end();
            ok
        })
        .count()
}

/// The exact entries' keys of the run: FNV-1a over the namespace and each
/// segment's module, start and length up to it (the run's content is fixed
/// by the schema, so these identify it).
fn run_keys(ns: u64, layout: &Layout, refs: &[Option<ModuleRef>], run: usize) -> Vec<u64> {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let eat = |h: &mut u64, bytes: &[u8]| {
        for &b in bytes {
            *h ^= u64::from(b);
            *h = h.wrapping_mul(PRIME);
        }
    };
    eat(&mut h, &ns.to_le_bytes());
    layout.segments[..run]
        .iter()
        .zip(refs)
        .map(|(s, m)| {
            let (tag, idx) = match m {
                Some(ModuleRef::Named(id)) => (1u8, id.0 as u64),
                Some(ModuleRef::Anonymous(i)) => (2, *i as u64),
                None => (0, 0),
            };
            eat(&mut h, &[tag]);
            eat(&mut h, &idx.to_le_bytes());
            eat(&mut h, &s.start.to_le_bytes());
            eat(&mut h, &s.len.to_le_bytes());
            h
        })
        .collect()
}
