//! Online α tuning (paper §4.2 "Managing the balance"), extended to keep
//! re-tuning on later windows.
//!
//! The grid search runs on background threads, as in the paper ("Marconi
//! asynchronously launches a grid search"), so that the request which closes
//! a window does not stall the engine for the whole replay. When its result
//! is adopted depends on [`AlphaAdoption`]:
//!
//! - `Deterministic`: at a fixed point, `apply_after` requests after the
//!   window closed (waiting for the search there if it is not done), so
//!   replays stay deterministic: the same trace gives the same α at the same
//!   request whatever the machine's speed or thread count.
//! - `WhenReady` (engines): every request after the window closed polls the
//!   result without waiting and the first that finds it adopts it; no request
//!   ever waits for a search.
//!
//! The request that opens a window pays only for sharing the tree's
//! copy-on-write chunks ([`window_snapshot`]: O(nodes / 16), not O(cached
//! tokens)); turning it into a replay copy
//! (index rebuilt, page ids dropped) happens on the search thread, and
//! starting the search copies nothing. The search yields the core after each replayed request, so an
//! engine thread that shares its core is not held for a scheduler slice.
//!
//! Searches run on one persistent worker thread per cache (shared by its
//! clones), spawned by the first search and fed through a channel, so no
//! request pays for a thread spawn after that one; a search with
//! `threads > 1` fans out over scoped threads on the worker, off the request
//! path.
//!
//! A replay that panics (a bug) or a thread that cannot be had never leaves
//! the request that adopts the result waiting: every search ends with a
//! result or a failure, and on failure α stays as it was. A worker that is
//! gone (it cannot be spawned, or died) is replaced at the next search; if
//! none can be had, a deterministic search replays on the request that
//! started it (same result), and a when-ready round is skipped (α kept): no
//! request waits for tuning in that mode. Dropping the last clone of a
//! cache cancels its search at the next replayed request and ends the
//! worker; nothing joins it, so a drop never waits.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};

use crate::cache::{Core, LeaseInfoOut};
use crate::config::{AlphaAdoption, EvictionPolicy, TunerConfig, TuningObjective};
use crate::log::{Decision, DecisionLog};

#[derive(Clone, Debug)]
enum Phase {
    /// Before the first eviction: α stays at its initial value (0).
    Warmup,
    /// Recording a window of requests from a snapshot.
    Recording,
    /// A grid search is running; its result is adopted after this many more
    /// requests.
    Searching(u64, Search),
    /// Between re-tuning windows: this many requests to go.
    Waiting(u64),
    /// One-shot tuning finished.
    Done,
}

/// The eviction rules a tuning round can pick
/// ([`TunerConfig::tune_rules`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rules {
    lru: bool,
    protect_branch_states: bool,
}

impl Rules {
    fn of(core: &Core) -> Self {
        Rules {
            lru: core.cfg.eviction == EvictionPolicy::Lru,
            protect_branch_states: core.cfg.protect_branch_states,
        }
    }

    /// Puts these rules in force on `core`: the eviction policy is rebuilt
    /// and the candidate index re-derived (which nodes are candidates
    /// depends on the rules). O(nodes).
    fn apply(self, core: &mut Core) {
        if Rules::of(core) == self {
            return;
        }
        core.cfg.eviction = if self.lru {
            EvictionPolicy::Lru
        } else {
            EvictionPolicy::FlopAware
        };
        core.cfg.protect_branch_states = self.protect_branch_states;
        core.eviction = crate::eviction::from_config(&core.cfg);
        core.index.clear();
        for id in 0..core.tree.nodes.len() as crate::tree::NodeId {
            core.tree.node_mut(id).cand = None;
        }
        for id in 0..core.tree.nodes.len() as crate::tree::NodeId {
            if core.tree.node(id).live {
                core.refresh(id);
            }
        }
    }
}

/// One point of a round's grid: an α under some eviction rules.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate {
    alpha: f64,
    rules: Rules,
}

#[derive(Clone, Debug)]
struct Recorded {
    ns: u64,
    input_len: u32,
    /// The admitted sequence: `Window::tokens[start..end]`.
    start: usize,
    end: usize,
    /// The lookup's application checkpoint hints:
    /// `Window::hints[hints_start..hints_end]` (empty without hints).
    hints_start: usize,
    hints_end: usize,
}

/// A window's requests, their sequences in one buffer and their
/// application checkpoint hints in another: recording a request copies its
/// tokens and hints (O(request)) and allocates nothing once the buffers
/// have grown, and the buffers come back from the search thread for the
/// next window ([`Spare`]). Per-request sequences allocated by the
/// engine's thread and freed in bulk by the search thread when the search
/// ended would come back to the engine's allocator all at once, the next
/// allocation of the engine's thread sorting thousands of freed blocks.
#[derive(Clone, Debug, Default)]
struct Window {
    requests: Vec<Recorded>,
    tokens: Vec<u32>,
    hints: Vec<u32>,
}

impl Window {
    /// Records a request: `full` (its first `input_len` tokens the input)
    /// looked up with `hints`; those past the input are not kept (the
    /// lookup dropped them).
    fn push(&mut self, ns: u64, input_len: u32, full: &[u32], hints: &[u32]) {
        let start = self.tokens.len();
        self.tokens.extend_from_slice(full);
        let hints_start = self.hints.len();
        self.hints
            .extend(hints.iter().copied().filter(|&h| h > 0 && h <= input_len));
        self.requests.push(Recorded {
            ns,
            input_len,
            start,
            end: self.tokens.len(),
            hints_start,
            hints_end: self.hints.len(),
        });
    }

    fn len(&self) -> usize {
        self.requests.len()
    }

    /// Each request: namespace, input, input + output, hints.
    fn iter(&self) -> impl Iterator<Item = (u64, &[u32], &[u32], &[u32])> {
        self.requests.iter().map(|r| {
            let full = &self.tokens[r.start..r.end];
            let hints = &self.hints[r.hints_start..r.hints_end];
            (r.ns, &full[..r.input_len as usize], full, hints)
        })
    }

    fn clear(&mut self) {
        self.requests.clear();
        self.tokens.clear();
        self.hints.clear();
    }
}

/// Where the search thread leaves a window's buffers, emptied, for the next
/// window to reuse (taken with `try_lock`: never waited for).
type Spare = Arc<Mutex<Option<Window>>>;

/// What a grid search gives per grid value: the objective after the
/// window, and what each half of the window added to it; or why it failed.
type Outcome = Result<Vec<[f64; 3]>, String>;

/// Where a search leaves its outcome, and the condition its waiter sleeps on.
type Slot = Arc<(Mutex<Option<Outcome>>, Condvar)>;

/// A grid search running on its own thread. Clones share it: the result does
/// not depend on who waits for it.
#[derive(Clone, Debug)]
struct Search {
    grid: Vec<Candidate>,
    requests: u32,
    result: Slot,
    /// The process that started it: in a process forked since, the worker
    /// running it does not exist and its outcome never comes.
    pid: u32,
}

/// Delivers a search's outcome when dropped, so that the waiter wakes up
/// however the search ends (a panic included).
struct Deliver {
    slot: Slot,
    outcome: Option<Outcome>,
}

impl Drop for Deliver {
    fn drop(&mut self) {
        let outcome = self
            .outcome
            .take()
            .unwrap_or_else(|| Err("the search ended without a result".into()));
        let (lock, cv) = &*self.slot;
        let mut r = lock.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(outcome);
        }
        cv.notify_all();
    }
}

/// The text of a caught panic.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs `f`, turning a panic into an error naming what panicked.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(format!("{what} panicked: {}", panic_text(&*p))))
}

/// One grid search, as the worker runs it.
struct Job {
    snapshot: Core,
    grid: Vec<Candidate>,
    window: Window,
    /// Where the emptied window goes for reuse.
    spare: Spare,
    cfg: TunerConfig,
    /// Delivers the outcome however the job ends: run, panicking, or
    /// dropped unrun (a worker that died with jobs queued).
    deliver: Deliver,
}

impl Job {
    /// Runs the search and delivers its outcome; `cancel` stops it between
    /// replayed requests. The outcome is delivered before the replay copy is
    /// dropped, so a waiter does not wait for the drop.
    fn run(self, cancel: &AtomicBool) {
        let Job {
            mut snapshot,
            grid,
            mut window,
            spare,
            cfg,
            mut deliver,
        } = self;
        // Engines (when-ready adoption) share their core with this thread:
        // it hands the core back often (below). In deterministic mode a
        // request waits for the outcome, so yielding would only delay its
        // own waiter (under load, by a scheduler time slice per yield: a
        // 7,000-request replay took 10.8 s instead of 0.4 s).
        let polite = cfg.adoption == AlphaAdoption::WhenReady;
        // Woken by the request that submitted the job, this thread may have
        // taken that request's core (a thread that slept long runs first):
        // give it back before any work.
        if polite {
            std::thread::yield_now();
        }
        deliver.outcome = Some(guarded("the grid search", || {
            snapshot.prepare_for_replay(polite);
            grid_search(&snapshot, &grid, &window, &cfg, cancel)
        }));
        // The window's buffers go back, emptied (O(1): no element to drop),
        // before the outcome is delivered, so that the window opened by the
        // request that adopts it finds them.
        window.clear();
        let mut slot = spare.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(window);
        }
        drop(slot);
        drop(deliver);
    }
}

/// The tuner's search thread, spawned by the first search and kept: jobs
/// come through a channel. Shared by the clones of a cache (`Arc`); when
/// the last one goes, the search in progress is cancelled and the worker
/// ends (its channel closes). Never joined: dropping a cache never waits.
struct Worker {
    /// The channel to the running worker and the process that spawned it;
    /// `None` before the first search, or after a send found the worker
    /// gone. In a process forked since, the worker is not there (the
    /// channel would take jobs that never run): a new one is spawned.
    jobs: Mutex<Option<(u32, Sender<Box<Job>>)>>,
    /// Set when the last owner goes: the search stops at its next replayed
    /// request, and the worker then ends.
    cancel: Arc<AtomicBool>,
    /// Workers spawned (1 for a cache whose worker never died).
    spawned: std::sync::atomic::AtomicU32,
    /// Worker threads running (0 or 1 but while a replaced one ends).
    live: Arc<std::sync::atomic::AtomicU32>,
    /// Test builds: refuse to spawn, as a system out of threads would.
    #[cfg(test)]
    refuse_spawn: AtomicBool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("spawned", &self.spawned.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Worker {
    fn new() -> Self {
        Worker {
            jobs: Mutex::new(None),
            cancel: Arc::new(AtomicBool::new(false)),
            spawned: std::sync::atomic::AtomicU32::new(0),
            live: Arc::default(),
            #[cfg(test)]
            refuse_spawn: AtomicBool::new(false),
        }
    }

    /// Hands `job` to the worker, spawning one if there is none (the first
    /// search) or the last one is gone; gives the job back if no thread can
    /// be had. O(1) on the request path but for that spawn.
    fn submit(&self, job: Box<Job>) -> Result<(), Box<Job>> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let job = match jobs.as_ref() {
            Some((pid, tx)) if *pid == std::process::id() => match tx.send(job) {
                Ok(()) => return Ok(()),
                // The worker is gone (its receiver dropped): a new one.
                Err(mpsc::SendError(job)) => job,
            },
            // None yet, or spawned by the process this one was forked from.
            _ => job,
        };
        *jobs = None;
        #[cfg(test)]
        if self.refuse_spawn.load(Ordering::Relaxed) {
            return Err(job);
        }
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::clone(&self.cancel);
        let live = Live::new(Arc::clone(&self.live));
        let spawned = std::thread::Builder::new()
            .name("marconi-alpha".into())
            .spawn(move || {
                let _live = live;
                work(&rx, &cancel);
            });
        if spawned.is_err() {
            return Err(job);
        }
        self.spawned.fetch_add(1, Ordering::Relaxed);
        // The receiver lives in the new thread's closure: this cannot fail
        // but by the thread having died already, which gives the job back.
        let sent = tx.send(job).map_err(|mpsc::SendError(job)| job);
        if sent.is_ok() {
            *jobs = Some((std::process::id(), tx));
        }
        sent
    }

    /// Test builds: the running worker ends and the next search finds its
    /// channel closed, as after a worker that died.
    #[cfg(test)]
    fn kill_for_test(&self) {
        let (dead, rx) = mpsc::channel();
        drop(rx);
        *self.jobs.lock().unwrap_or_else(|e| e.into_inner()) = Some((std::process::id(), dead));
    }

    /// Test builds: the worker looks spawned by another process, as in a
    /// child forked after it was spawned.
    #[cfg(test)]
    fn fork_for_test(&self) {
        if let Some((pid, _)) = &mut *self.jobs.lock().unwrap_or_else(|e| e.into_inner()) {
            *pid = pid.wrapping_add(1);
        }
    }
}

/// Counts a worker thread as running from its spawn until it ends (or
/// until its closure is dropped unrun, where the spawn failed).
struct Live(Arc<std::sync::atomic::AtomicU32>);

impl Live {
    fn new(count: Arc<std::sync::atomic::AtomicU32>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Live(count)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The worker's loop: runs jobs until every sender is gone.
fn work(jobs: &Receiver<Box<Job>>, cancel: &AtomicBool) {
    while let Ok(job) = jobs.recv() {
        // A job catches its own panics (and delivers); this keeps the
        // worker alive past anything else.
        let _ = catch_unwind(AssertUnwindSafe(|| job.run(cancel)));
    }
}

impl Search {
    /// Starts the search over `grid` on `window`, from `snapshot`: the
    /// [`window_snapshot`] taken when the window opened. Hands it to
    /// `worker`; where no worker thread can be had, a deterministic search
    /// runs here and now (same result), and a when-ready one fails at once
    /// (α kept for this round) rather than make the request wait.
    fn start(
        snapshot: Core,
        grid: Vec<Candidate>,
        (window, spare): (Window, Spare),
        cfg: TunerConfig,
        worker: &Worker,
    ) -> Search {
        let result: Slot = Arc::new((Mutex::new(None), Condvar::new()));
        let requests = u32::try_from(window.len()).unwrap_or(u32::MAX);
        let adoption = cfg.adoption;
        let job = Box::new(Job {
            snapshot,
            grid: grid.clone(),
            window,
            spare,
            cfg,
            deliver: Deliver {
                slot: Arc::clone(&result),
                outcome: None,
            },
        });
        if let Err(mut job) = worker.submit(job) {
            match adoption {
                AlphaAdoption::Deterministic => job.run(&AtomicBool::new(false)),
                AlphaAdoption::WhenReady => {
                    job.deliver.outcome = Some(Err("no thread for the search could be \
                        started; this round is skipped (no request waits for tuning)"
                        .into()));
                }
            }
        }
        Search {
            grid,
            requests,
            result,
            pid: std::process::id(),
        }
    }

    /// The objective per grid value, or why the search failed, waiting for
    /// the search if needed. Every search delivers an outcome (see
    /// [`Deliver`]), so this returns.
    fn wait(&self) -> Outcome {
        let (lock, cv) = &*self.result;
        let mut r = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(outcome) = &*r {
                return outcome.clone();
            }
            if let Some(e) = self.orphaned() {
                return Err(e);
            }
            // Woken by the outcome; every 100 ms it also looks whether the
            // process was forked (its search would never end here).
            r = cv
                .wait_timeout(r, std::time::Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Why the outcome can never come, if it cannot: the search runs in
    /// the process this one was forked from.
    fn orphaned(&self) -> Option<String> {
        (self.pid != std::process::id()).then(|| {
            "the search ran in the process this one was forked from; alpha kept, \
             the next window searches here"
                .to_owned()
        })
    }

    /// The outcome if the search has ended; `None` while it runs. Never
    /// waits: the lock is held only to store the outcome, and a poll that
    /// finds it taken says "not yet".
    fn try_outcome(&self) -> Option<Outcome> {
        let (lock, _) = &*self.result;
        match lock.try_lock() {
            Ok(r) => r.clone(),
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().clone(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

/// The copy of the cache a window's replays start from, taken on the request
/// that opens the window. Leaves out what
/// [`Core::prepare_for_replay`] rebuilds or drops on the search thread anyway
/// (the eviction index, leases, the log, ids waiting for the engine, the
/// engine's page and slot ids), so the request pays for one reference per
/// chunk of 16 nodes (`tree::Nodes`: copy-on-write chunks,
/// whose edge tokens and page lists are shared buffers too): a few µs at a
/// million cached tokens and 1.8 k nodes.
fn window_snapshot(core: &mut Core) -> Core {
    let index = std::mem::take(&mut core.index);
    let leases = std::mem::take(&mut core.leases);
    let log = std::mem::replace(&mut core.log, DecisionLog::new(false));
    let freed = std::mem::take(&mut core.freed);
    let page_owner = std::mem::take(&mut core.page_owner);
    let slot_owner = std::mem::take(&mut core.slot_owner);
    let snapshot = core.clone();
    core.index = index;
    core.leases = leases;
    core.log = log;
    core.freed = freed;
    core.page_owner = page_owner;
    core.slot_owner = slot_owner;
    snapshot
}

/// The tuner: watches requests, and at the end of each window replays it
/// for every α of the grid.
#[derive(Clone, Debug)]
pub(crate) struct Tuner {
    cfg: TunerConfig,
    phase: Phase,
    requests: u64,
    window_len: usize,
    snapshot: Option<Core>,
    window: Window,
    /// The last window's buffers, back from the search thread.
    spare: Spare,
    round: u32,
    /// The search thread, shared with the clones of the cache.
    worker: Arc<Worker>,
}

impl Tuner {
    pub(crate) fn new(cfg: TunerConfig) -> Self {
        Tuner {
            cfg,
            phase: Phase::Warmup,
            requests: 0,
            window_len: 0,
            snapshot: None,
            window: Window::default(),
            spare: Spare::default(),
            round: 0,
            worker: Arc::new(Worker::new()),
        }
    }

    /// Whether requests are being recorded for a window.
    pub(crate) fn recording(&self) -> bool {
        matches!(self.phase, Phase::Recording)
    }

    /// The search in progress, for tests.
    #[cfg(test)]
    fn search_for_test(&self) -> Option<&Search> {
        match &self.phase {
            Phase::Searching(_, search) => Some(search),
            _ => None,
        }
    }

    /// Test builds: the search in progress and the worker look started by
    /// another process, as in a child forked after they were.
    #[cfg(test)]
    pub(crate) fn fork_for_test(&mut self) {
        if let Phase::Searching(_, search) = &mut self.phase {
            search.pid = search.pid.wrapping_add(1);
        }
        self.worker.fork_for_test();
    }

    /// Opens a window: the snapshot its replays start from, and the last
    /// window's buffers if the search thread has handed them back.
    fn open_window(&mut self, core: &mut Core) {
        self.snapshot = Some(window_snapshot(core));
        if let Ok(mut spare) = self.spare.try_lock() {
            if let Some(w) = spare.take() {
                self.window = w;
            }
        }
        self.window.clear();
    }

    /// Called once per finished request (lease released), with the
    /// sequence it admitted when the caller has it at hand (`full`; else
    /// the one the lease kept, `out.admitted`) and the application
    /// checkpoint hints its lookup was given (the window's replays pass
    /// them to the same hinted lookup).
    pub(crate) fn after_request(
        &mut self,
        core: &mut Core,
        out: LeaseInfoOut,
        full: Option<&[u32]>,
        hints: &[u32],
    ) {
        self.requests += 1;
        match &mut self.phase {
            Phase::Warmup => {
                if core.stats.evictions > 0 {
                    let factor = u64::from(self.cfg.bootstrap_factor);
                    self.window_len = usize::try_from(
                        self.requests
                            .saturating_mul(factor)
                            .max(u64::from(self.cfg.min_window))
                            .min(match self.cfg.max_window {
                                0 => u64::MAX,
                                m => u64::from(m.max(self.cfg.min_window)),
                            }),
                    )
                    .unwrap_or(usize::MAX);
                    self.open_window(core);
                    self.phase = Phase::Recording;
                }
            }
            Phase::Recording => {
                if let Some(full) = full.or(out.admitted.as_deref()).filter(|f| !f.is_empty()) {
                    self.window.push(out.ns, out.input_len, full, hints);
                }
                if self.window.len() >= self.window_len {
                    let search = self.start_search(core);
                    self.phase = Phase::Searching(u64::from(self.cfg.apply_after), search);
                    self.maybe_adopt(core);
                }
            }
            Phase::Searching(left, _) => {
                *left = left.saturating_sub(1);
                self.maybe_adopt(core);
            }
            Phase::Waiting(left) => {
                if *left <= 1 {
                    self.open_window(core);
                    self.phase = Phase::Recording;
                } else {
                    *left -= 1;
                }
            }
            Phase::Done => {}
        }
    }

    /// The candidates of this round: [`alphas`](Self::round_alphas) under
    /// the rules in force, first (α = 0 first: the reference a candidate
    /// must beat); with `tune_rules`, the same α values under FLOP-aware
    /// eviction with the other `protect_branch_states`, and plain LRU.
    fn round_grid(&self, core: &Core) -> Vec<Candidate> {
        let alphas = self.round_alphas(core.alpha);
        let now = Rules::of(core);
        let mut rules = vec![now];
        if self.cfg.tune_rules {
            for protect in [true, false] {
                rules.push(Rules {
                    lru: false,
                    protect_branch_states: protect,
                });
            }
            rules.push(Rules {
                lru: true,
                protect_branch_states: now.protect_branch_states,
            });
        }
        let mut grid: Vec<Candidate> = Vec::new();
        for r in rules {
            if grid.iter().any(|c| c.rules == r) {
                continue;
            }
            // LRU ignores α: one replay.
            let alphas = if r.lru { &[0.0][..] } else { &alphas[..] };
            grid.extend(alphas.iter().map(|&alpha| Candidate { alpha, rules: r }));
        }
        grid
    }

    /// The α values for this round: the whole grid on the bootstrap window; then
    /// α = 0, the current α and its neighbours.
    fn round_alphas(&self, current: f64) -> Vec<f64> {
        let mut full = self.cfg.grid.clone();
        full.push(0.0);
        full.sort_by(f64::total_cmp);
        full.dedup();
        if self.round == 0 || self.cfg.retune_neighbours == 0 {
            return full;
        }
        let k = self.cfg.retune_neighbours as usize;
        let at = full.partition_point(|&a| a < current).min(full.len() - 1);
        let mut g: Vec<f64> = full[at.saturating_sub(k)..(at + k + 1).min(full.len())].to_vec();
        g.push(0.0);
        g.push(current);
        g.sort_by(f64::total_cmp);
        g.dedup();
        g
    }

    fn start_search(&mut self, core: &Core) -> Search {
        let snapshot = self.snapshot.take().expect("recording has a snapshot");
        let grid = self.round_grid(core);
        let window = std::mem::take(&mut self.window);
        let spare = Arc::clone(&self.spare);
        Search::start(
            snapshot,
            grid,
            (window, spare),
            self.cfg.clone(),
            &self.worker,
        )
    }

    /// Adopts the search's result: once its delay has run out
    /// (deterministic), or as soon as it is ready (when-ready).
    fn maybe_adopt(&mut self, core: &mut Core) {
        let Phase::Searching(left, search) = &self.phase else {
            return;
        };
        let outcome = match self.cfg.adoption {
            AlphaAdoption::Deterministic if *left == 0 => search.wait(),
            AlphaAdoption::Deterministic => return,
            AlphaAdoption::WhenReady => match search.try_outcome() {
                Some(outcome) => outcome,
                None => match search.orphaned() {
                    Some(e) => Err(e),
                    None => return,
                },
            },
        };
        let requests = search.requests;
        let results = match outcome {
            Ok(r) => r,
            Err(reason) => {
                // A bug in a replay: serving goes on with the α in force.
                let alpha = core.alpha;
                tracing::warn!(
                    target: "marconi::tuner",
                    "alpha tuning failed, keeping alpha {alpha}: {reason}"
                );
                core.log.push(|| Decision::AlphaKept {
                    requests,
                    alpha,
                    reason,
                });
                self.next_window(core);
                return;
            }
        };
        let grid = search.grid.clone();
        let mut best = best_candidate(&results, self.cfg.min_gain);
        let halves: Vec<[f64; 2]> = results.iter().map(|r| [r[1], r[2]]).collect();
        let results: Vec<f64> = results.iter().map(|r| r[0]).collect();
        let at_zero = results[0];
        let mut best_obj = results[best];
        // Retuning moves away from the candidate in force only when the
        // move is supported (`supported_move`): a gain that one burst of
        // requests makes, and that the other half of the window does not
        // repeat, is noise, except on the way back to α = 0 (the paper's
        // one-shot tuning and `tune_rules` take the best candidate as it
        // is).
        if self.cfg.retune && !self.cfg.tune_rules {
            let now = Rules::of(core);
            if let Some(cur) = grid
                .iter()
                .position(|c| c.alpha == core.alpha && c.rules == now)
            {
                if best != cur && !supported_move(best, cur, &halves) {
                    best = cur;
                    best_obj = results[cur];
                }
            }
        }
        let old = core.alpha;
        let new = grid[best].alpha;
        // α changed: the utility ordering changes, but the index keys (time,
        // efficiency) do not, so nothing needs rebuilding.
        core.alpha = new;
        let rules_changed = Rules::of(core) != grid[best].rules;
        // Other rules change which nodes are candidates: the index is
        // re-derived.
        grid[best].rules.apply(core);
        self.round += 1;
        core.stats.tuning_rounds = self.round;
        let round = self.round;
        core.log.push(|| Decision::Alpha {
            round,
            requests,
            old,
            new,
            objective_at_zero: at_zero,
            objective_at_new: best_obj,
        });
        if rules_changed {
            let r = grid[best].rules;
            core.log.push(|| Decision::Rules {
                round,
                lru: r.lru,
                protect_branch_states: r.protect_branch_states,
            });
        }
        self.next_window(core);
    }

    /// After a round (adopted or failed): the next window, a wait, or done.
    fn next_window(&mut self, core: &mut Core) {
        let wait = (self.window_len as u64)
            .saturating_mul(u64::from(self.cfg.retune_every.saturating_sub(1)));
        self.phase = match (self.cfg.retune, wait) {
            (false, _) => Phase::Done,
            (true, 0) => {
                self.open_window(core);
                Phase::Recording
            }
            (true, w) => Phase::Waiting(w),
        };
    }
}

/// The candidate with the best objective among `results` (one `[total,
/// first half, second half]` per candidate, candidate 0 being α = 0 under
/// the rules in force; the first wins ties), or 0 when it does not beat
/// candidate 0 by `min_gain` relative to candidate 0's score on the
/// window. (Replays start from the window's snapshot with its statistics
/// zeroed (`Core::prepare_for_replay`), so a total is the window's score
/// and equals the sum of the halves.)
fn best_candidate(results: &[[f64; 3]], min_gain: f64) -> usize {
    let mut best = 0usize;
    for (i, r) in results.iter().enumerate() {
        if r[0] > results[best][0] {
            best = i;
        }
    }
    // Every replay starts from the same snapshot: the difference of the
    // totals is the difference of the window scores.
    let (zero, top) = (results[0], results[best]);
    if best != 0 && top[0] - zero[0] < (zero[1] + zero[2]) * min_gain {
        return 0;
    }
    best
}

/// Whether the tuner may move from candidate `cur` (in force) to `best`
/// (the best total on the window), given what each candidate's replay
/// added on each half of the window (`halves`, candidate 0 being α = 0
/// under the rules in force).
///
/// Away from α = 0 the move must gain on both halves
/// ([`gains_on_both_halves`]): windows of a few dozen requests at small
/// capacities hold a handful of hits, and one of them can make a large α
/// look best. Back to α = 0 the better total is enough: α = 0 (recency
/// only) is the reference every α must beat, and a large α adopted on a
/// lucky window can keep the cache full of FLOP-efficient entries nobody
/// asks for again, a window whose few hits all come in one half under
/// α = 0 and none under the α in force (ShareGPT, seed 25, 5 % of the
/// working set: 5.2 % token hit rate where α = 0 throughout gets 11.6 %,
/// 9.5 % with this rule;
/// `marconi-sim battery --seeds 20,21,22 --sharegpt-seeds 23,24,25`).
fn supported_move(best: usize, cur: usize, halves: &[[f64; 2]]) -> bool {
    best == 0 || gains_on_both_halves(halves[best], halves[cur])
}

/// Whether a candidate whose replay added `best` to the objective on each
/// half of the window did strictly better than the one in force (`now`) on
/// both halves.
fn gains_on_both_halves(best: [f64; 2], now: [f64; 2]) -> bool {
    best[0] > now[0] && best[1] > now[1]
}

/// Replays `window` from `snapshot` once per α, in parallel threads; the
/// result is in grid order and does not depend on the thread count. A
/// replay that panics fails the search (the first failure in grid order is
/// reported); a share whose thread cannot be spawned is replayed here.
fn grid_search(
    snapshot: &Core,
    grid: &[Candidate],
    window: &Window,
    cfg: &TunerConfig,
    cancel: &AtomicBool,
) -> Outcome {
    let threads = match cfg.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n as usize,
    }
    .clamp(1, grid.len());
    let replay_all = |cands: &[Candidate]| -> Outcome {
        cands
            .iter()
            .map(|&c| {
                guarded(&format!("the replay at alpha {}", c.alpha), || {
                    let polite = cfg.adoption == AlphaAdoption::WhenReady;
                    replay(snapshot, c, window, cfg.objective, polite, cancel)
                })
            })
            .collect()
    };
    if threads == 1 {
        return replay_all(grid);
    }
    let chunk = grid.len().div_ceil(threads);
    let parts: Vec<Outcome> = std::thread::scope(|s| {
        let running: Vec<_> = grid
            .chunks(chunk)
            .map(|alphas| {
                std::thread::Builder::new()
                    .name("marconi-alpha-replay".into())
                    .spawn_scoped(s, move || replay_all(alphas))
                    .map_err(|_| alphas)
            })
            .collect();
        // Every thread is joined before the scope ends, so none can make
        // the scope itself panic.
        running
            .into_iter()
            .map(|part| match part {
                Ok(h) => h.join().unwrap_or_else(|p| {
                    Err(format!("a replay thread panicked: {}", panic_text(&*p)))
                }),
                Err(alphas) => replay_all(alphas),
            })
            .collect()
    });
    let mut results = Vec::with_capacity(grid.len());
    for part in parts {
        results.extend(part?);
    }
    Ok(results)
}

/// The objective of `window` replayed from `snapshot` under `cand`; fails
/// once `cancel` is set (checked between replayed requests).
fn replay(
    snapshot: &Core,
    cand: Candidate,
    window: &Window,
    objective: TuningObjective,
    polite: bool,
    cancel: &AtomicBool,
) -> Result<[f64; 3], String> {
    let alpha = cand.alpha;
    #[cfg(test)]
    if alpha.to_bits() == tests::FAULT_ALPHA.to_bits() {
        panic!("injected fault: replay at alpha {alpha}");
    }
    #[cfg(test)]
    if alpha.to_bits() == tests::GATED_ALPHA.to_bits() {
        tests::gate_pass();
    }
    #[cfg(test)]
    if alpha.to_bits() == tests::UNTIL_CANCELLED_ALPHA.to_bits() {
        tests::wait_for_cancel(cancel);
    }
    let score = |c: &Core| match objective {
        TuningObjective::FlopsSaved => c.stats.flops_saved,
        TuningObjective::TokenHits => c.stats.hit_tokens as f64,
    };
    let mut c = snapshot.clone();
    c.alpha = alpha;
    cand.rules.apply(&mut c);
    let (start, half) = (score(&c), window.len() / 2);
    let mut at_half = start;
    for (i, (ns, input, full, hints)) in window.iter().enumerate() {
        if i == half {
            at_half = score(&c);
        }
        if cancel.load(Ordering::Relaxed) {
            return Err("cancelled: the cache was dropped".into());
        }
        // Recorded requests were valid when they ran; a replay cannot fail.
        // With their hints, as the cache ran them (none: `serve` itself).
        let _ = c.serve_hinted(ns, input, full, hints);
        // Hands the core back to a runnable thread after each replayed
        // request (microseconds of work): where the search shares a core
        // with the engine's thread, that thread waits for one replayed
        // request, not for a scheduler time slice (4 ms measured). Free
        // when nothing else is runnable; no effect on the result. Only
        // `polite` (when-ready adoption): see `Job::run`.
        if polite {
            std::thread::yield_now();
        }
    }
    let end = score(&c);
    Ok([end, at_half - start, end - at_half])
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    use crate::{
        AlphaAdoption, AlphaMode, CacheConfig, Decision, ModelSpec, PrefixCache, TunerConfig,
    };

    /// A grid value whose replay panics (test builds only): stands for any
    /// bug or resource failure inside the grid search.
    pub(super) const FAULT_ALPHA: f64 = 123.25;

    /// A grid value whose replay waits at [`GATE`] until the test opens it
    /// (test builds only): a search as slow as the test wants, with no
    /// timing involved.
    pub(super) const GATED_ALPHA: f64 = 77.5;

    /// A grid value whose replay waits until its search is cancelled (test
    /// builds only; it gives up with a panic after a minute).
    pub(super) const UNTIL_CANCELLED_ALPHA: f64 = 91.125;

    pub(super) fn wait_for_cancel(cancel: &AtomicBool) {
        let start = Instant::now();
        while !cancel.load(Ordering::Relaxed) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the search was never cancelled"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether the gate is open, and how many replays have reached it.
    static GATE: (Mutex<(bool, u32)>, Condvar) = (Mutex::new((false, 0)), Condvar::new());

    /// Called by the replay at [`GATED_ALPHA`]: waits until the gate opens.
    /// A test that never opens it (a request waiting for the search, the
    /// bug this gate exposes) would hang; after a minute the replay panics
    /// instead, which fails the search and so the test. The test passes
    /// without ever relying on that delay.
    pub(super) fn gate_pass() {
        let (lock, cv) = &GATE;
        let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
        g.1 += 1;
        cv.notify_all();
        while !g.0 {
            let (next, wait) = cv
                .wait_timeout(g, Duration::from_secs(60))
                .unwrap_or_else(|e| e.into_inner());
            g = next;
            if wait.timed_out() && !g.0 {
                panic!("the gate was never opened: a request waited for the search");
            }
        }
    }

    fn set_gate(open: bool) {
        let (lock, cv) = &GATE;
        let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
        *g = (open, if open { g.1 } else { 0 });
        cv.notify_all();
    }

    /// Waits until a replay has reached the gate.
    fn wait_until_gated() {
        let (lock, cv) = &GATE;
        let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
        while g.1 == 0 {
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    const KV: u64 = 65_536;
    const STATE: u64 = 26_787_840;

    fn serve_through_a_failing_search(threads: u32, apply_after: u32) {
        let cfg = CacheConfig {
            alpha: AlphaMode::Auto(TunerConfig {
                grid: vec![0.5, FAULT_ALPHA],
                min_window: 2,
                bootstrap_factor: 1,
                retune_every: 1,
                apply_after,
                threads,
                ..TunerConfig::default()
            }),
            decision_log: true,
            ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 2 * STATE + 300 * KV)
        };
        let mut c = PrefixCache::new(cfg).unwrap();
        let mut kept = 0;
        for i in 0..30u32 {
            let input: Vec<u32> = (i * 1000..i * 1000 + 100).collect();
            c.serve(0, &input, &[]).unwrap();
            c.check_invariants();
            for d in c.drain_log() {
                match d {
                    Decision::AlphaKept { alpha, reason, .. } => {
                        assert_eq!(alpha, 0.0);
                        assert!(reason.contains("injected fault"), "{reason}");
                        kept += 1;
                    }
                    Decision::Alpha { .. } => panic!("adopted a failed search: {d}"),
                    _ => {}
                }
            }
        }
        assert!(kept >= 2, "{kept} failed rounds");
        assert_eq!(c.alpha(), 0.0);
        assert_eq!(c.stats().tuning_rounds, 0);
        // The cache still serves, lookups included.
        let l = c.lookup(0, &(29_000..29_100).collect::<Vec<_>>()).unwrap();
        c.release(l.lease).unwrap();
    }

    /// `min_gain` is a margin on the window's own score.
    #[test]
    fn min_gain_is_relative_to_the_window_score() {
        use super::best_candidate as best;
        // 1000 scored before the window, 10 on it at α = 0.
        let zero = [1010.0, 5.0, 5.0];
        // +50 % on the window: adopted with a 10 % margin (the total since
        // the cache started gains only 0.5 %).
        assert_eq!(best(&[zero, [1015.0, 7.5, 7.5]], 0.1), 1);
        // +5 % on the window: below the margin.
        assert_eq!(best(&[zero, [1010.5, 5.0, 5.5]], 0.1), 0);
        // No margin: the best total wins, the first one on a tie.
        assert_eq!(best(&[zero, [1010.5, 5.0, 5.5]], 0.0), 1);
        assert_eq!(
            best(&[zero, [1012.0, 6.0, 6.0], [1012.0, 7.0, 5.0]], 0.0),
            1
        );
        assert_eq!(best(&[zero, [1010.0, 4.0, 6.0]], 0.0), 0);
    }

    /// A retuning round returns to α = 0 on a better total even when the
    /// gain sits in one half (the stuck-at-a-large-α case: α = 0 made the
    /// window's only hits, in its first half; the α in force made none);
    /// a move away from α = 0, or between two non-zero α, still needs
    /// both halves.
    #[test]
    fn a_move_back_to_alpha_zero_needs_only_the_better_total() {
        use super::supported_move as ok;
        // Candidates: α = 0, then two others; the one in force is 2.
        let halves = [[5.0, 0.0], [0.0, 0.0], [0.0, 0.0]];
        assert!(ok(0, 2, &halves));
        // The same one-sided gain does not move α away from 0 or to a
        // third value.
        let halves = [[0.0, 0.0], [5.0, 0.0], [0.0, 0.0]];
        assert!(!ok(1, 0, &halves));
        assert!(!ok(1, 2, &halves));
        assert!(ok(1, 2, &[[0.0, 0.0], [5.0, 1.0], [4.0, 0.5]]));
    }

    /// A retuning round moves only on a gain on both halves of its window.
    #[test]
    fn a_move_needs_a_gain_on_both_halves_of_the_window() {
        use super::gains_on_both_halves as both;
        assert!(both([10.0, 10.0], [9.0, 9.0]));
        // The whole-window gain of one burst, that the other half lost.
        assert!(!both([30.0, 5.0], [10.0, 10.0]));
        assert!(!both([5.0, 30.0], [10.0, 10.0]));
        // A tie on one half is no evidence: the α in force stays.
        assert!(!both([10.0, 12.0], [10.0, 10.0]));
    }

    /// An engine that tracks KV pages: the window's replays (which carry no
    /// page ids) still serve, so the search scores α on real hits. (Replays
    /// from a snapshot that kept its page ids were refused, every one, and
    /// every α scored 0.)
    #[test]
    fn replays_of_a_page_tracking_cache_score_hits() {
        let cfg = CacheConfig {
            alpha: AlphaMode::Auto(TunerConfig {
                grid: vec![0.5, 1.0],
                min_window: 8,
                bootstrap_factor: 1,
                retune: false,
                apply_after: 0,
                threads: 1,
                ..TunerConfig::default()
            }),
            decision_log: true,
            ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 3 * STATE + 900 * KV)
        };
        let mut c = PrefixCache::new(cfg).unwrap();
        let mut next_page = 0u32;
        let mut history: Vec<Vec<u32>> = (0..4u32).map(|s| vec![s * 100_000]).collect();
        let mut objective = None;
        for i in 0..120u32 {
            let conv = &mut history[(i % 4) as usize];
            conv.extend(i * 1000..i * 1000 + 40);
            let l = c.lookup(0, conv).unwrap();
            conv.extend(i * 1000 + 500..i * 1000 + 520);
            let states = c.states_to_save(&l, conv.len());
            let pages: Vec<u32> = (0..conv.len())
                .map(|_| {
                    next_page += 1;
                    next_page
                })
                .collect();
            c.admit(l.lease, conv, &states, &pages).unwrap();
            c.release(l.lease).unwrap();
            c.check_invariants();
            if conv.len() > 300 {
                conv.truncate(1);
            }
            for d in c.drain_log() {
                match d {
                    Decision::Alpha {
                        objective_at_zero, ..
                    } => objective = objective.or(Some(objective_at_zero)),
                    Decision::AlphaKept { reason, .. } => panic!("search failed: {reason}"),
                    _ => {}
                }
            }
        }
        let objective = objective.expect("a tuning round within 120 requests");
        assert!(objective > 0.0, "the replays saved no FLOPs: {objective}");
    }

    #[test]
    fn a_panicking_grid_search_keeps_alpha_and_the_cache_serving() {
        for threads in [1, 2] {
            for apply_after in [0, 3] {
                serve_through_a_failing_search(threads, apply_after);
            }
        }
    }

    /// A request of 100 distinct tokens: every one evicts once the cache is full.
    fn one_off(i: u32) -> Vec<u32> {
        (i * 1000..i * 1000 + 100).collect()
    }

    fn serve_while_the_search_is_blocked(threads: u32) {
        set_gate(false);
        let cfg = CacheConfig {
            alpha: AlphaMode::Auto(TunerConfig {
                grid: vec![0.5, GATED_ALPHA],
                min_window: 2,
                bootstrap_factor: 1,
                retune: false,
                // 0 would search synchronously in deterministic mode; when
                // ready, it must not make any request wait.
                apply_after: 0,
                adoption: AlphaAdoption::WhenReady,
                threads,
                ..TunerConfig::default()
            }),
            decision_log: true,
            ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 2 * STATE + 300 * KV)
        };
        let mut c = PrefixCache::new(cfg).unwrap();
        let mut served = 0u32;
        let mut serve = |c: &mut PrefixCache| {
            c.serve(0, &one_off(served), &[]).unwrap();
            c.check_invariants();
            // The request just served is cached whole: a follow-up hits it.
            let mut next = one_off(served);
            next.push(7);
            let l = c.lookup(0, &next).unwrap();
            assert_eq!(l.hit_tokens, 100, "request {served}");
            c.release(l.lease).unwrap();
            served += 1;
            c.drain_log()
                .into_iter()
                .filter(|d| matches!(d, Decision::Alpha { .. } | Decision::AlphaKept { .. }))
                .collect::<Vec<_>>()
        };
        // The first eviction comes within a few requests, and the window
        // (as long as the requests before it, at least 2) right after it.
        for _ in 0..20 {
            let rounds = serve(&mut c);
            assert!(rounds.is_empty(), "adopted a blocked search: {rounds:?}");
        }
        // The search is now stuck at the gate; the cache keeps serving with
        // α = 0, lookups included, and adopts nothing.
        wait_until_gated();
        for _ in 0..200 {
            let rounds = serve(&mut c);
            assert!(rounds.is_empty(), "adopted a blocked search: {rounds:?}");
        }
        assert_eq!(c.alpha(), 0.0);
        assert_eq!(c.stats().tuning_rounds, 0);
        // Released, the search ends and a later request adopts its result.
        set_gate(true);
        let adopted = loop {
            let rounds = serve(&mut c);
            if let Some(d) = rounds.first() {
                break d.clone();
            }
            std::thread::yield_now();
        };
        assert!(
            matches!(adopted, Decision::Alpha { round: 1, .. }),
            "{adopted}"
        );
        assert_eq!(c.stats().tuning_rounds, 1);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "the gate gives up after 60 s of real time; Miri runs the search far slower"
    )]
    fn when_ready_adoption_serves_while_the_search_is_blocked_then_adopts() {
        for threads in [1, 2] {
            serve_while_the_search_is_blocked(threads);
        }
    }

    /// A cache that re-tunes on every window of 2+ requests, one search
    /// thread, over `grid`.
    fn retuning(adoption: AlphaAdoption, grid: Vec<f64>, retune: bool) -> PrefixCache {
        PrefixCache::new(CacheConfig {
            alpha: AlphaMode::Auto(TunerConfig {
                grid,
                min_window: 2,
                bootstrap_factor: 1,
                retune,
                retune_every: 1,
                apply_after: 2,
                adoption,
                threads: 1,
                ..TunerConfig::default()
            }),
            decision_log: true,
            ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 2 * STATE + 300 * KV)
        })
        .unwrap()
    }

    /// Serves one-off requests from `*next` until `rounds` tuning rounds
    /// were adopted (a bounded number of requests).
    fn serve_until_rounds(c: &mut PrefixCache, next: &mut u32, rounds: u32) {
        let start = *next;
        while c.stats().tuning_rounds < rounds {
            assert!(
                *next - start < 1_000_000,
                "no round after a million requests"
            );
            c.serve(0, &one_off(*next), &[]).unwrap();
            *next += 1;
            std::thread::yield_now();
        }
    }

    fn spawned(c: &PrefixCache) -> u32 {
        c.tuner().unwrap().worker.spawned.load(Ordering::Relaxed)
    }

    /// Every round of a cache runs on the one worker its first search
    /// spawned: no request after that pays for a thread.
    #[test]
    fn one_worker_serves_every_round() {
        for adoption in [AlphaAdoption::Deterministic, AlphaAdoption::WhenReady] {
            let mut c = retuning(adoption, vec![0.5, 2.0], true);
            assert_eq!(spawned(&c), 0, "spawned before any search");
            let mut next = 0;
            serve_until_rounds(&mut c, &mut next, 4);
            assert_eq!(spawned(&c), 1, "{adoption:?}");
            c.check_invariants();
        }
    }

    /// A worker that died (its channel closed) is replaced by the next
    /// search, and tuning goes on.
    #[test]
    fn a_dead_worker_is_replaced_at_the_next_search() {
        for adoption in [AlphaAdoption::Deterministic, AlphaAdoption::WhenReady] {
            let mut c = retuning(adoption, vec![0.5, 2.0], true);
            let mut next = 0;
            serve_until_rounds(&mut c, &mut next, 1);
            c.tuner().unwrap().worker.kill_for_test();
            serve_until_rounds(&mut c, &mut next, 3);
            assert_eq!(spawned(&c), 2, "{adoption:?}");
        }
    }

    /// Where no thread can be spawned, a deterministic search replays on
    /// the request that starts it (and is adopted as usual), and a
    /// when-ready round is skipped with α kept: no request waits.
    #[test]
    fn without_a_thread_deterministic_replays_inline_and_when_ready_keeps_alpha() {
        let mut c = retuning(AlphaAdoption::Deterministic, vec![0.5, 2.0], true);
        c.tuner()
            .unwrap()
            .worker
            .refuse_spawn
            .store(true, Ordering::Relaxed);
        let mut next = 0;
        serve_until_rounds(&mut c, &mut next, 2);
        assert_eq!(spawned(&c), 0);
        assert!(c
            .drain_log()
            .iter()
            .all(|d| !matches!(d, Decision::AlphaKept { .. })));

        let mut c = retuning(AlphaAdoption::WhenReady, vec![0.5, 2.0], true);
        c.tuner()
            .unwrap()
            .worker
            .refuse_spawn
            .store(true, Ordering::Relaxed);
        let mut kept = 0;
        for i in 0..60 {
            c.serve(0, &one_off(i), &[]).unwrap();
            for d in c.drain_log() {
                match d {
                    Decision::AlphaKept { reason, alpha, .. } => {
                        assert!(reason.contains("no thread"), "{reason}");
                        assert_eq!(alpha, 0.0);
                        kept += 1;
                    }
                    Decision::Alpha { .. } => panic!("adopted without a search: {d}"),
                    _ => {}
                }
            }
        }
        assert!(kept >= 2, "{kept} skipped rounds");
        assert_eq!(spawned(&c), 0);
        assert_eq!(c.stats().tuning_rounds, 0);
    }

    /// Dropping the cache while its search runs returns at once (nothing
    /// joins the worker), cancels the search at its next replayed request,
    /// and the worker ends.
    #[test]
    fn dropping_the_cache_mid_search_cancels_the_search_and_ends_the_worker() {
        let mut c = retuning(AlphaAdoption::WhenReady, vec![UNTIL_CANCELLED_ALPHA], false);
        let mut i = 0;
        let search = loop {
            c.serve(0, &one_off(i), &[]).unwrap();
            i += 1;
            if let Some(s) = c.tuner().unwrap().search_for_test() {
                break s.clone();
            }
            assert!(i < 1000, "no search started");
        };
        let live = Arc::clone(&c.tuner().unwrap().worker.live);
        assert_eq!(live.load(Ordering::Relaxed), 1);
        // The replay at UNTIL_CANCELLED_ALPHA runs until the drop cancels it.
        drop(c);
        let outcome = search.wait();
        assert!(
            outcome.as_ref().is_err_and(|e| e.contains("cancelled")),
            "{outcome:?}"
        );
        let start = Instant::now();
        while live.load(Ordering::Relaxed) != 0 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the worker outlived its cache"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// In a process forked while a search ran (its worker stayed in the
    /// parent), no request waits for that search: deterministic and
    /// when-ready alike keep α, and the next search spawns a worker here.
    #[test]
    fn after_a_fork_no_request_waits_for_the_parent_search() {
        for adoption in [AlphaAdoption::Deterministic, AlphaAdoption::WhenReady] {
            // The parent's search never ends on its own (it runs until the
            // cache is dropped).
            let mut c = retuning(adoption, vec![UNTIL_CANCELLED_ALPHA], true);
            let mut i = 0;
            while c.tuner().unwrap().search_for_test().is_none() {
                c.serve(0, &one_off(i), &[]).unwrap();
                i += 1;
                assert!(i < 1000, "no search started");
            }
            c.tuner_mut().unwrap().fork_for_test();
            // Served until the parent's search is given up and the next
            // one started (not until that one's adoption: it would wait
            // for a search that ends only with the cache).
            let mut kept = None;
            while kept.is_none() || spawned(&c) < 2 {
                c.serve(0, &one_off(i), &[]).unwrap();
                i += 1;
                assert!(i < 10_000, "{adoption:?}: kept {kept:?}");
                for d in c.drain_log() {
                    if let Decision::AlphaKept { reason, .. } = d {
                        kept.get_or_insert(reason);
                    }
                }
            }
            let reason = kept.expect("kept");
            assert!(reason.contains("forked"), "{reason}");
            // The next search runs on a worker spawned here.
            assert_eq!(spawned(&c), 2, "{adoption:?}");
        }
    }
}
