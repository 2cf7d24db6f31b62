//! Replay harness reproducing Table 1 of the AVMP paper from the
//! authors' 12 request traces, with the prototype's exact replay semantics
//! (`marconi-gpu/data/avmp/README.md`, built into the crate: [`builtin_traces`],
//! [`builtin_golden`]).
//!
//! Entry points for `marconi-sim avmp`: [`run_sweep`] (all 240 runs of the
//! paper's grid), [`render_table`] (the Table 1 text), [`RunResult`] (one JSON row
//! per run, same field names as `golden.jsonl`). [`run_cell`] runs one cell.
//!
//! One semantic difference from the README, found by replaying and confirmed in
//! the prototype's `padded_unified.py`: that baseline returns *raw page ids*, not
//! generational handles. A page evicted from request A and reused by request B is
//! therefore freed again when A departs (A still lists the id), which takes it
//! away from B: the page returns to the free list and leaves B's LRU entry (an
//! entry left empty is dropped). [`IdSemantics::RawPageIds`] reproduces that on
//! top of our allocator, explicitly, in the harness; the allocator itself rejects
//! such frees ([`crate::AllocError::StaleHandle`]). The dual-pool variants use
//! never-aliasing ids in the prototype and [`IdSemantics::Handles`] here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::alloc::{
    DualPool, DualPoolConfig, MigrationPolicy, ModelShape, PaddedUnified, PoolAllocator,
};
use crate::error::AllocError;
use crate::handle::{PoolKind, VirtualHandle};
use crate::policy::{self, DemandConfig};

/// Errors of the replay harness.
#[derive(Debug, thiserror::Error)]
pub enum AvmpError {
    /// A data file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A data file is not valid JSON of the expected shape.
    #[error("cannot parse {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// A trace the grid needs is absent from `traces.json`.
    #[error("trace {0} missing from traces.json")]
    MissingTrace(String),
    /// An unknown variant, model or workload name.
    #[error("unknown {kind} {name:?}")]
    Unknown {
        /// What was looked up.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// A replay worker thread stopped without a result.
    #[error("replay worker lost the result of cell {0}")]
    Worker(usize),
    /// The allocator refused something the replay semantics guarantee (a bug).
    #[error("allocator invariant broken during replay: {0}")]
    Allocator(#[from] AllocError),
}

/// Attention layers per model in the paper's grid (32 layers, attention where i % 8 == 0).
pub const ATTENTION_LAYERS: u32 = 4;
/// SSM layers per model in the paper's grid.
pub const SSM_LAYERS: u32 = 28;
/// Tokens per KV page.
pub const PAGE_TOKENS: u64 = 16;

/// The two model specifications of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Model {
    /// Jamba 1.5 Mini: KV page 64 KiB, SSM block 256 KiB.
    Jamba15Mini,
    /// Mamba2 1.3B: KV page 64 KiB, SSM block 2 MiB.
    Mamba2_1b3,
}

impl Model {
    /// Both models, in the golden file's order.
    pub const ALL: [Model; 2] = [Model::Jamba15Mini, Model::Mamba2_1b3];

    /// Name as in the golden file.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Model::Jamba15Mini => "jamba_1_5_mini",
            Model::Mamba2_1b3 => "mamba2_1b3",
        }
    }

    /// Parses [`Model::name`].
    pub fn parse(s: &str) -> Result<Self, AvmpError> {
        Model::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| AvmpError::Unknown {
                kind: "model",
                name: s.into(),
            })
    }

    /// Cache shape (bf16, 16 tokens per page).
    #[must_use]
    pub fn shape(self) -> ModelShape {
        let d_state = match self {
            Model::Jamba15Mini => 16,
            Model::Mamba2_1b3 => 128,
        };
        ModelShape {
            kv_heads: 8,
            head_dim: 128,
            d_inner: 8192,
            d_state,
            dtype_bytes: 2,
            tokens_per_page: PAGE_TOKENS,
        }
    }
}

/// The allocator variants of Table 1 (plus this crate's own policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variant {
    /// vLLM-style padded unified table.
    PaddedUnified,
    /// SGLang-style static split, mamba ratio 0.5.
    FixedDualMr05,
    /// SGLang-style static split, mamba ratio 0.9 (SGLang's default).
    FixedDualMr09,
    /// AVMP handles, static split at 0.5.
    AvmpStaticMr05,
    /// AVMP with forced migration of 128 donor units on a second failure.
    AvmpDynamicB128,
    /// Beyond the paper ([`crate::policy`]): demand-sized migration in 2 MiB-chunk
    /// steps, before evicting when the donor is mostly free, and after a failed
    /// eviction before the paper's forced batch (which stays as the last resort).
    AvmpDemand,
}

impl Variant {
    /// The five variants of the paper's Table 1, in its row order.
    pub const TABLE1: [Variant; 5] = [
        Variant::PaddedUnified,
        Variant::FixedDualMr05,
        Variant::FixedDualMr09,
        Variant::AvmpStaticMr05,
        Variant::AvmpDynamicB128,
    ];

    /// Name as in the golden file.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Variant::PaddedUnified => "padded_unified",
            Variant::FixedDualMr05 => "fixed_dual_mr05",
            Variant::FixedDualMr09 => "fixed_dual_mr09",
            Variant::AvmpStaticMr05 => "avmp_static_mr05",
            Variant::AvmpDynamicB128 => "avmp_dynamic_b128",
            Variant::AvmpDemand => "avmp_demand",
        }
    }

    /// Parses [`Variant::name`].
    pub fn parse(s: &str) -> Result<Self, AvmpError> {
        Variant::TABLE1
            .into_iter()
            .chain([Variant::AvmpDemand])
            .find(|v| v.name() == s)
            .ok_or_else(|| AvmpError::Unknown {
                kind: "variant",
                name: s.into(),
            })
    }

    /// How the prototype's variant hands out ids.
    #[must_use]
    pub fn id_semantics(self) -> IdSemantics {
        match self {
            Variant::PaddedUnified => IdSemantics::RawPageIds,
            _ => IdSemantics::Handles,
        }
    }

    fn reports_rebalances(self) -> bool {
        matches!(
            self,
            Variant::AvmpStaticMr05 | Variant::AvmpDynamicB128 | Variant::AvmpDemand
        )
    }

    /// Builds the allocator of this variant for `model` and a budget of `total_bytes`.
    pub fn build(
        self,
        model: Model,
        total_bytes: u64,
    ) -> Result<Box<dyn PoolAllocator + Send>, AllocError> {
        let shape = model.shape();
        let (kv, ssm) = (shape.kv_page_bytes(), shape.ssm_block_bytes());
        let dual = |ratio: f64, policy| {
            DualPool::new(
                self.name(),
                DualPoolConfig {
                    total_bytes,
                    ssm_ratio: ratio,
                    kv_unit: kv,
                    ssm_unit: ssm,
                    policy,
                },
            )
            .map(|p| Box::new(p) as Box<dyn PoolAllocator + Send>)
        };
        match self {
            Variant::PaddedUnified => Ok(Box::new(PaddedUnified::new(total_bytes, kv, ssm)?)),
            Variant::FixedDualMr05 | Variant::AvmpStaticMr05 => dual(0.5, MigrationPolicy::Static),
            Variant::FixedDualMr09 => dual(0.9, MigrationPolicy::Static),
            Variant::AvmpDynamicB128 => dual(0.5, MigrationPolicy::forced(128)),
            Variant::AvmpDemand => dual(0.5, MigrationPolicy::forced(128)),
        }
    }
}

/// How the replayed caller remembers what it allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdSemantics {
    /// Generational handles: a departure's frees of evicted units are rejected.
    Handles,
    /// Raw page indices, as the prototype's padded baseline: a departure frees
    /// whatever currently occupies each index it remembers.
    RawPageIds,
}

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Request {
    /// Prompt tokens.
    pub prompt_len: u64,
    /// Generated tokens.
    pub gen_len: u64,
    /// Arrival tick.
    pub arrival: u64,
}

/// The traces of `traces.json`, keyed `"<workload>/<seed>"`.
pub type Traces = BTreeMap<String, Vec<Request>>;

/// Loads `traces.json` (each trace a list of `[prompt_len, gen_len, arrival_tick]`).
pub fn load_traces(path: &Path) -> Result<Traces, AvmpError> {
    let text = std::fs::read_to_string(path).map_err(|source| AvmpError::Io {
        path: path.into(),
        source,
    })?;
    parse_traces(&text, path)
}

/// The conformance data shipped in the crate (`marconi-gpu/data/avmp`,
/// a copy of the authors' traces and of the 240 golden runs).
const BUILTIN_TRACES: &str = include_str!("../data/avmp/traces.json");
const BUILTIN_GOLDEN: &str = include_str!("../data/avmp/golden.jsonl");

/// The paper's 12 traces, built into the crate: no file to find.
pub fn builtin_traces() -> Traces {
    parse_traces(BUILTIN_TRACES, Path::new("<builtin>/traces.json"))
        .expect("the built-in traces parse (checked by a test)")
}

/// The 240 golden runs of the authors' prototype, built into the crate.
pub fn builtin_golden() -> Vec<RunResult> {
    parse_golden(BUILTIN_GOLDEN, Path::new("<builtin>/golden.jsonl"))
        .expect("the built-in golden runs parse (checked by a test)")
}

fn parse_traces(text: &str, path: &Path) -> Result<Traces, AvmpError> {
    let raw: BTreeMap<String, Vec<(u64, u64, u64)>> =
        serde_json::from_str(text).map_err(|source| AvmpError::Parse {
            path: path.into(),
            source,
        })?;
    Ok(raw
        .into_iter()
        .map(|(k, v)| {
            let reqs = v
                .into_iter()
                .map(|(prompt_len, gen_len, arrival)| Request {
                    prompt_len,
                    gen_len,
                    arrival,
                })
                .collect();
            (k, reqs)
        })
        .collect())
}

/// Result of one run, serialized with the field names of `golden.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Variant name.
    pub variant: String,
    /// Workload name.
    pub workload: String,
    /// Model name.
    pub model: String,
    /// Budget in GiB.
    pub tb_gib: u64,
    /// Trace seed.
    pub seed: u64,
    /// Failed allocate calls (evictions are not OOMs).
    pub oom: u64,
    /// Requests with no failed call / requests, rounded to 4 decimals.
    pub completion_ratio: f64,
    /// Successful migrations (`None` for the non-AVMP baselines).
    pub rebalance_count: Option<f64>,
    /// Donor bytes migrated, in MiB.
    #[serde(rename = "bytes_migrated_MiB")]
    pub bytes_migrated_mib: f64,
}

/// One cell of the grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    /// Allocator variant.
    pub variant: Variant,
    /// Workload name (`uniform_short`, `mixed_long`, `agentic_burst`, `sharegpt_replay`).
    pub workload: String,
    /// Model.
    pub model: Model,
    /// Budget in GiB.
    pub tb_gib: u64,
    /// Trace seed.
    pub seed: u64,
}

/// The workloads of the grid with their seeds, in Table 1's column order.
pub const WORKLOADS: [(&str, [u64; 3]); 4] = [
    ("uniform_short", [1, 2, 3]),
    ("mixed_long", [2, 3, 4]),
    ("agentic_burst", [3, 4, 5]),
    ("sharegpt_replay", [4, 5, 6]),
];

/// The paper's 240-run grid for `variants` (5 × 4 workloads × 2 models × 2 budgets × 3 seeds).
#[must_use]
pub fn grid(variants: &[Variant]) -> Vec<Cell> {
    let mut cells = Vec::new();
    for &variant in variants {
        for (workload, seeds) in WORKLOADS {
            for model in Model::ALL {
                for tb_gib in [1, 4] {
                    for seed in seeds {
                        cells.push(Cell {
                            variant,
                            workload: workload.into(),
                            model,
                            tb_gib,
                            seed,
                        });
                    }
                }
            }
        }
    }
    cells
}

const DEPARTURE: u8 = 0;
const GROWTH: u8 = 1;
const ARRIVAL: u8 = 2;

/// Events `(tick, priority, request)` in heap order: departure < growth < arrival,
/// ties by request id.
fn events(trace: &[Request]) -> Vec<(u64, u8, u32)> {
    let mut ev = Vec::with_capacity(trace.len() * 4);
    for (rid, r) in (0u32..).zip(trace) {
        ev.push((r.arrival, ARRIVAL, rid));
        ev.push((r.arrival + r.prompt_len + r.gen_len, DEPARTURE, rid));
        if r.prompt_len == 0 {
            continue;
        }
        let mut total = r.prompt_len;
        let mut cur = total.div_ceil(PAGE_TOKENS);
        for step in 0..r.gen_len {
            total += 1;
            let need = total.div_ceil(PAGE_TOKENS);
            if need > cur {
                cur = need;
                ev.push((r.arrival + r.prompt_len + step + 1, GROWTH, rid));
            }
        }
    }
    ev.sort_unstable();
    ev
}

/// Per-pool LRU of requests: least recently touched (by a logical clock) first.
#[derive(Default)]
struct Lru {
    by_touch: BTreeMap<u64, u32>,
    entries: HashMap<u32, (u64, Vec<VirtualHandle>)>,
}

impl Lru {
    fn touch(&mut self, rid: u32, clock: u64, handles: &[VirtualHandle]) {
        let e = self.entries.entry(rid).or_insert((0, Vec::new()));
        if e.0 != 0 {
            self.by_touch.remove(&e.0);
        }
        e.0 = clock;
        e.1.extend_from_slice(handles);
        self.by_touch.insert(clock, rid);
    }

    fn pop_oldest(&mut self) -> Option<(u32, Vec<VirtualHandle>)> {
        let (_, rid) = self.by_touch.pop_first()?;
        let (_, hs) = self.entries.remove(&rid)?;
        Some((rid, hs))
    }

    fn remove_handle(&mut self, rid: u32, h: VirtualHandle) {
        if let Some(e) = self.entries.get_mut(&rid) {
            e.1.retain(|&x| x != h);
            if e.1.is_empty() {
                self.by_touch.remove(&e.0);
                self.entries.remove(&rid);
            }
        }
    }
}

/// Replay state of one run.
struct Replay {
    alloc: Box<dyn PoolAllocator + Send>,
    variant: Variant,
    semantics: IdSemantics,
    /// One tracker per pool, or one shared (padded unified: "one LRU over both").
    lrus: Vec<Lru>,
    /// Owner request of each live unit, per table: `owner[table][unit index]`.
    owner: [HashMap<u32, u32>; 2],
    clock: u64,
    buf: Vec<VirtualHandle>,
    evictions: u64,
    demand: DemandConfig,
}

impl Replay {
    fn lru_index(&self, pool: PoolKind) -> usize {
        if self.lrus.len() == 1 {
            0
        } else {
            pool.index()
        }
    }

    fn table_of(&self, pool: PoolKind) -> usize {
        if self.lrus.len() == 1 {
            0
        } else {
            pool.index()
        }
    }

    /// Frees a live handle and forgets it in its owner's LRU entry.
    fn free_tracked(&mut self, h: VirtualHandle) -> Result<(), AvmpError> {
        self.alloc.free(h)?;
        let t = self.table_of(h.pool());
        let idx = self.alloc.unit_index(h);
        if let Some(rid) = self.owner[t].remove(&idx) {
            let li = self.lru_index(h.pool());
            self.lrus[li].remove_handle(rid, h);
        }
        Ok(())
    }

    fn evict_one(&mut self, pool: PoolKind) -> Result<(), AvmpError> {
        let li = self.lru_index(pool);
        if let Some((_, handles)) = self.lrus[li].pop_oldest() {
            self.evictions += 1;
            for h in handles {
                self.alloc.free(h)?;
                let t = self.table_of(h.pool());
                self.owner[t].remove(&self.alloc.unit_index(h));
            }
        }
        Ok(())
    }

    /// One allocate call of the replayed engine: try; evict one LRU request of the
    /// pool and retry; then the layout's migration path. Returns false on OOM.
    fn call(
        &mut self,
        rid: u32,
        pool: PoolKind,
        n: u32,
        held: &mut Vec<VirtualHandle>,
    ) -> Result<bool, AvmpError> {
        self.buf.clear();
        let demand = (self.variant == Variant::AvmpDemand).then_some(self.demand);
        if let Some(keep) = demand.and_then(|p| p.before_evict_keep_free) {
            if self.alloc.free_units(pool) < n {
                policy::migrate_for_demand(self.alloc.as_mut(), pool, n, keep, 0);
            }
        }
        let ok = match self.alloc.allocate(pool, n, &mut self.buf) {
            Ok(()) => true,
            Err(AllocError::OutOfCapacity { .. }) => {
                self.evict_one(pool)?;
                let mut forced = true;
                if let Some(p) = demand {
                    forced = p.forced_fallback;
                    if p.demand_after_evict && self.alloc.free_units(pool) < n {
                        policy::migrate_for_demand(
                            self.alloc.as_mut(),
                            pool,
                            n,
                            0.0,
                            p.headroom_units,
                        );
                    }
                }
                let second = if forced {
                    self.alloc
                        .allocate_or_migrate(pool, n, &mut self.buf)
                        .map(|_| ())
                } else {
                    self.alloc.allocate(pool, n, &mut self.buf)
                };
                match second {
                    Ok(_) => true,
                    Err(AllocError::OutOfCapacity { .. }) => false,
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        };
        if !ok {
            return Ok(false);
        }
        self.clock += 1;
        let t = self.table_of(pool);
        for &h in &self.buf {
            self.owner[t].insert(self.alloc.unit_index(h), rid);
        }
        let li = self.lru_index(pool);
        self.lrus[li].touch(rid, self.clock, &self.buf);
        held.extend_from_slice(&self.buf);
        Ok(true)
    }

    fn depart(&mut self, rid: u32, held: Vec<VirtualHandle>) -> Result<(), AvmpError> {
        match self.semantics {
            IdSemantics::Handles => {
                for h in held {
                    match self.alloc.free(h) {
                        Ok(()) => {
                            let t = self.table_of(h.pool());
                            self.owner[t].remove(&self.alloc.unit_index(h));
                        }
                        // Evicted earlier: the generation rejects it, as it must.
                        Err(AllocError::StaleHandle(_) | AllocError::DoubleFree(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                for lru in &mut self.lrus {
                    if let Some((touch, _)) = lru.entries.remove(&rid) {
                        lru.by_touch.remove(&touch);
                    }
                }
            }
            IdSemantics::RawPageIds => {
                let mut seen = HashSet::new();
                let mut victims = Vec::new();
                for h in held {
                    let idx = self.alloc.unit_index(h);
                    if !seen.insert((self.table_of(h.pool()), idx)) {
                        continue;
                    }
                    if let Some(live) = self.alloc.live_handle_at(h.pool(), idx) {
                        victims.push(live);
                    }
                }
                for live in victims {
                    self.free_tracked(live)?;
                }
            }
        }
        Ok(())
    }
}

/// Replays `trace` against `variant` for `model` with a budget of `tb_gib` GiB.
pub fn run_cell(
    trace: &[Request],
    variant: Variant,
    model: Model,
    tb_gib: u64,
) -> Result<CellOutcome, AvmpError> {
    run_cell_with(trace, variant, model, tb_gib, policy::DEMAND)
}

/// [`run_cell`] with explicit tunables for [`Variant::AvmpDemand`] (ignored by
/// the other variants).
pub fn run_cell_with(
    trace: &[Request],
    variant: Variant,
    model: Model,
    tb_gib: u64,
    demand: DemandConfig,
) -> Result<CellOutcome, AvmpError> {
    let alloc = variant.build(model, tb_gib << 30)?;
    let n_lru = if variant == Variant::PaddedUnified {
        1
    } else {
        2
    };
    let mut rp = Replay {
        alloc,
        variant,
        semantics: variant.id_semantics(),
        lrus: (0..n_lru).map(|_| Lru::default()).collect(),
        owner: [HashMap::new(), HashMap::new()],
        clock: 0,
        buf: Vec::new(),
        evictions: 0,
        demand,
    };
    let mut held: HashMap<u32, Vec<VirtualHandle>> = HashMap::new();
    let mut failed = vec![false; trace.len()];
    let mut oom = 0u64;
    for (_, kind, rid) in events(trace) {
        let r = trace[rid as usize];
        match kind {
            ARRIVAL => {
                let mut mine = Vec::new();
                let pages =
                    u32::try_from(r.prompt_len.div_ceil(PAGE_TOKENS).max(1)).unwrap_or(u32::MAX);
                for (pool, n, times) in [
                    (PoolKind::Kv, pages, ATTENTION_LAYERS),
                    (PoolKind::Ssm, 1, SSM_LAYERS),
                ] {
                    for _ in 0..times {
                        if !rp.call(rid, pool, n, &mut mine)? {
                            oom += 1;
                            failed[rid as usize] = true;
                        }
                    }
                }
                held.insert(rid, mine);
            }
            GROWTH => {
                if let Some(mut mine) = held.remove(&rid) {
                    for _ in 0..ATTENTION_LAYERS {
                        if !rp.call(rid, PoolKind::Kv, 1, &mut mine)? {
                            oom += 1;
                            failed[rid as usize] = true;
                        }
                    }
                    held.insert(rid, mine);
                }
            }
            _ => {
                if let Some(mine) = held.remove(&rid) {
                    rp.depart(rid, mine)?;
                }
            }
        }
    }
    let stats = rp.alloc.stats();
    let completed = failed.iter().filter(|f| !**f).count();
    Ok(CellOutcome {
        oom,
        completed: completed as u64,
        requests: trace.len() as u64,
        rebalance_count: stats.rebalance_count,
        bytes_migrated: stats.bytes_migrated,
        evictions: rp.evictions,
    })
}

/// Raw counters of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CellOutcome {
    /// Failed allocate calls.
    pub oom: u64,
    /// Requests with no failed call.
    pub completed: u64,
    /// Requests in the trace.
    pub requests: u64,
    /// Successful migrations.
    pub rebalance_count: u64,
    /// Donor bytes migrated.
    pub bytes_migrated: u64,
    /// Requests evicted from a pool's LRU (not OOMs).
    pub evictions: u64,
}

#[expect(clippy::cast_precision_loss, reason = "counts far below 2^52")]
fn to_result(cell: &Cell, o: CellOutcome) -> RunResult {
    let ratio = o.completed as f64 / o.requests.max(1) as f64;
    RunResult {
        variant: cell.variant.name().into(),
        workload: cell.workload.clone(),
        model: cell.model.name().into(),
        tb_gib: cell.tb_gib,
        seed: cell.seed,
        oom: o.oom,
        // Python's round(x, 4): ties to even.
        completion_ratio: (ratio * 10_000.0).round_ties_even() / 10_000.0,
        rebalance_count: cell
            .variant
            .reports_rebalances()
            .then_some(o.rebalance_count as f64),
        bytes_migrated_mib: o.bytes_migrated as f64 / f64::from(1u32 << 20),
    }
}

/// Runs `cells` over `traces`, spreading cells over the available cores; results
/// come back in `cells` order.
pub fn run_cells(traces: &Traces, cells: &[Cell]) -> Result<Vec<RunResult>, AvmpError> {
    for c in cells {
        let key = format!("{}/{}", c.workload, c.seed);
        if !traces.contains_key(&key) {
            return Err(AvmpError::MissingTrace(key));
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(cells.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut slots: Vec<Option<Result<RunResult, AvmpError>>> =
        (0..cells.len()).map(|_| None).collect();
    let done = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(cell) = cells.get(i) else { break };
                let trace = &traces[&format!("{}/{}", cell.workload, cell.seed)];
                let r = run_cell(trace, cell.variant, cell.model, cell.tb_gib)
                    .map(|o| to_result(cell, o));
                if let Ok(mut d) = done.lock() {
                    d[i] = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or(Err(AvmpError::Worker(i))))
        .collect()
}

/// Runs the paper's full 240-run grid from `dir` (holding `traces.json`).
pub fn run_sweep(dir: &Path) -> Result<Vec<RunResult>, AvmpError> {
    let traces = load_traces(&dir.join("traces.json"))?;
    run_sweep_on(&traces)
}

/// Runs the paper's full 240-run grid over `traces` (e.g. [`builtin_traces`]).
pub fn run_sweep_on(traces: &Traces) -> Result<Vec<RunResult>, AvmpError> {
    run_cells(traces, &grid(&Variant::TABLE1))
}

/// Loads `golden.jsonl` (one [`RunResult`] per line).
pub fn load_golden(path: &Path) -> Result<Vec<RunResult>, AvmpError> {
    let text = std::fs::read_to_string(path).map_err(|source| AvmpError::Io {
        path: path.into(),
        source,
    })?;
    parse_golden(&text, path)
}

fn parse_golden(text: &str, path: &Path) -> Result<Vec<RunResult>, AvmpError> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|source| AvmpError::Parse {
                path: path.into(),
                source,
            })
        })
        .collect()
}

/// Table 1 cell value: the sum over (model, budget) of the mean over seeds of `oom`.
#[must_use]
#[expect(clippy::cast_precision_loss, reason = "small counts")]
pub fn table_value(results: &[RunResult], variant: &str, workload: &str) -> f64 {
    let mut groups: BTreeMap<(&str, u64), (u64, u64)> = BTreeMap::new();
    for r in results
        .iter()
        .filter(|r| r.variant == variant && r.workload == workload)
    {
        let g = groups.entry((r.model.as_str(), r.tb_gib)).or_default();
        g.0 += r.oom;
        g.1 += 1;
    }
    groups.values().map(|&(s, n)| s as f64 / n as f64).sum()
}

/// Renders Table 1 (markdown) for the variants present in `results`, in the
/// README's column order: the three synthetic workloads, their total, ShareGPT.
#[must_use]
pub fn render_table(results: &[RunResult]) -> String {
    let mut variants: Vec<&str> = Vec::new();
    for r in results {
        if !variants.contains(&r.variant.as_str()) {
            variants.push(&r.variant);
        }
    }
    let mut out = String::from(
        "| variant | uniform_short | mixed_long | agentic_burst | Total | sharegpt_replay |\n|---|---|---|---|---|---|\n",
    );
    for v in variants {
        let cols: Vec<f64> = [
            "uniform_short",
            "mixed_long",
            "agentic_burst",
            "sharegpt_replay",
        ]
        .iter()
        .map(|w| table_value(results, v, w))
        .collect();
        let total = cols[0] + cols[1] + cols[2];
        let _ = writeln!(
            out,
            "| {v} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            cols[0], cols[1], cols[2], total, cols[3]
        );
    }
    out
}
