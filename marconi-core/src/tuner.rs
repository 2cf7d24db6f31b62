//! Online α tuning (paper §4.2 "Managing the balance"), extended to keep
//! re-tuning on later windows.
//!
//! The grid search runs on background threads, as in the paper ("Marconi
//! asynchronously launches a grid search"), so that the request which closes
//! a window does not stall the engine for the whole replay. Its result is
//! adopted at a fixed point, `apply_after` requests after the window closed
//! (waiting for the search there if it is not done), so replays stay
//! deterministic: the same trace gives the same α at the same request
//! whatever the machine's speed or thread count.

use std::sync::{Arc, Condvar, Mutex};

use crate::cache::{Core, LeaseInfoOut};
use crate::config::{TunerConfig, TuningObjective};
use crate::log::Decision;

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

#[derive(Clone, Debug)]
struct Recorded {
    ns: u64,
    input_len: u32,
    full: Vec<u32>,
}

/// A grid search running on its own thread. Clones share it: the result does
/// not depend on who waits for it.
#[derive(Clone, Debug)]
struct Search {
    grid: Vec<f64>,
    requests: u32,
    result: Arc<(Mutex<Option<Vec<f64>>>, Condvar)>,
}

impl Search {
    fn start(snapshot: Core, grid: Vec<f64>, window: Vec<Recorded>, cfg: TunerConfig) -> Search {
        let result = Arc::new((Mutex::new(None), Condvar::new()));
        let out = Arc::clone(&result);
        let g = grid.clone();
        let requests = window.len() as u32;
        let job = move || {
            let r = grid_search(&snapshot, &g, &window, &cfg);
            let (lock, cv) = &*out;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            cv.notify_all();
        };
        if std::thread::Builder::new()
            .name("marconi-alpha".into())
            .spawn(job.clone())
            .is_err()
        {
            // No thread to be had: search here and now, same result.
            job();
        }
        Search {
            grid,
            requests,
            result,
        }
    }

    /// The objective per grid value, waiting for the search if needed.
    fn wait(&self) -> Vec<f64> {
        let (lock, cv) = &*self.result;
        let mut r = lock.lock().unwrap_or_else(|e| e.into_inner());
        while r.is_none() {
            r = cv.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        r.clone().expect("set")
    }
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
    window: Vec<Recorded>,
    round: u32,
}

impl Tuner {
    pub(crate) fn new(cfg: TunerConfig) -> Self {
        Tuner {
            cfg,
            phase: Phase::Warmup,
            requests: 0,
            window_len: 0,
            snapshot: None,
            window: Vec::new(),
            round: 0,
        }
    }

    /// Whether requests are being recorded for a window.
    pub(crate) fn recording(&self) -> bool {
        matches!(self.phase, Phase::Recording)
    }

    /// Called once per finished request (lease released).
    pub(crate) fn after_request(&mut self, core: &mut Core, out: LeaseInfoOut) {
        self.requests += 1;
        match &mut self.phase {
            Phase::Warmup => {
                if core.stats.evictions > 0 {
                    let factor = u64::from(self.cfg.bootstrap_factor);
                    self.window_len =
                        (self.requests * factor).max(u64::from(self.cfg.min_window)) as usize;
                    self.snapshot = Some(core.clone_for_replay());
                    self.phase = Phase::Recording;
                }
            }
            Phase::Recording => {
                if let Some(full) = out.admitted.filter(|f| !f.is_empty()) {
                    self.window.push(Recorded {
                        ns: out.ns,
                        input_len: out.input_len,
                        full,
                    });
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
                    self.snapshot = Some(core.clone_for_replay());
                    self.phase = Phase::Recording;
                } else {
                    *left -= 1;
                }
            }
            Phase::Done => {}
        }
    }

    /// The grid for this round: the whole grid on the bootstrap window; then
    /// α = 0, the current α and its neighbours.
    fn round_grid(&self, current: f64) -> Vec<f64> {
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
        let grid = self.round_grid(core.alpha);
        let window = std::mem::take(&mut self.window);
        Search::start(snapshot, grid, window, self.cfg.clone())
    }

    /// Adopts the search's result once its delay has run out.
    fn maybe_adopt(&mut self, core: &mut Core) {
        let Phase::Searching(0, search) = &self.phase else {
            return;
        };
        let results = search.wait();
        let grid = search.grid.clone();
        let requests = search.requests;
        let at_zero = results[0];
        // Best objective; the smallest α wins ties (grid is ascending, 0 first).
        let (mut best, mut best_obj) = (0usize, at_zero);
        for (i, &r) in results.iter().enumerate() {
            if r > best_obj {
                best = i;
                best_obj = r;
            }
        }
        // Never adopt an α that does not beat plain LRU on the window.
        if best != 0 && best_obj < at_zero * (1.0 + self.cfg.min_gain) {
            best = 0;
            best_obj = at_zero;
        }
        let old = core.alpha;
        let new = grid[best];
        // α changed: the utility ordering changes, but the index keys (time,
        // efficiency) do not, so nothing needs rebuilding.
        core.alpha = new;
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
        let wait = self.window_len as u64 * u64::from(self.cfg.retune_every.saturating_sub(1));
        self.phase = match (self.cfg.retune, wait) {
            (false, _) => Phase::Done,
            (true, 0) => {
                self.snapshot = Some(core.clone_for_replay());
                Phase::Recording
            }
            (true, w) => Phase::Waiting(w),
        };
    }
}

/// Replays `window` from `snapshot` once per α, in parallel threads; the
/// result is in grid order and does not depend on the thread count.
fn grid_search(snapshot: &Core, grid: &[f64], window: &[Recorded], cfg: &TunerConfig) -> Vec<f64> {
    let threads = match cfg.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n as usize,
    }
    .clamp(1, grid.len());
    let mut results = vec![0.0; grid.len()];
    if threads == 1 {
        for (r, &a) in results.iter_mut().zip(grid) {
            *r = replay(snapshot, a, window, cfg.objective);
        }
        return results;
    }
    std::thread::scope(|s| {
        let chunk = grid.len().div_ceil(threads);
        for (rs, alphas) in results.chunks_mut(chunk).zip(grid.chunks(chunk)) {
            s.spawn(move || {
                for (r, &a) in rs.iter_mut().zip(alphas) {
                    *r = replay(snapshot, a, window, cfg.objective);
                }
            });
        }
    });
    results
}

fn replay(snapshot: &Core, alpha: f64, window: &[Recorded], objective: TuningObjective) -> f64 {
    let mut c = snapshot.clone();
    c.alpha = alpha;
    for r in window {
        // Recorded requests were valid when they ran; a replay cannot fail.
        let _ = c.serve(r.ns, &r.full[..r.input_len as usize], &r.full);
    }
    match objective {
        TuningObjective::FlopsSaved => c.stats.flops_saved,
        TuningObjective::TokenHits => c.stats.hit_tokens as f64,
    }
}
