//! Per-request decision time with α tuning on, at about a million cached
//! tokens: p50, p99 and max of one whole request cycle (lookup, admission of
//! the planned and final states, release) through `PrefixCache::serve_full`,
//! one request at a time, for each adoption mode.
//!
//! `cargo bench -p marconi-core --bench decision_latency` (under a
//! minute; `-- --requests N` measures N requests, `-- --gap-us G` idles G µs
//! between requests, unmeasured, as an engine does while it prefills and
//! decodes: back to back, the search thread rarely finishes a search before
//! the run ends; `-- --gap-spin` spends the gap busy instead of asleep, and
//! `-- --gap-touch-kib N` busy writing N KiB, so that what the gap costs the
//! next request (cold caches) can be told from the cache's own work). Goal
//! (the latency goals):
//! p99 < 20 µs and max < 1 ms on one core: `taskset -c 0 cargo bench -p
//! marconi-core --bench decision_latency -- --gap-us 200` runs the engine's
//! thread and the search thread on one core. Ends with a table of every
//! mode: wall time, and wall time less the time the thread waited for a CPU
//! (another process, or the search thread on the same core).
//!
//! The workload is generated here (core does not depend on the simulator):
//! agentic sessions that share a few long system prompts and grow turn by
//! turn, many of them in flight, so the tree branches as a real cache does
//! and evictions never stop once it is full. The tuner re-tunes on every
//! window (as long as the requests before the first eviction), so the
//! measured phase holds several rounds: window snapshots, searches and
//! adoptions. A run with tuning off (fixed α) is the baseline: what it shows
//! in the tail is the machine (and evictions), not the tuner.

use std::fs::File;
use std::io::{Read, Seek};
use std::time::{Duration, Instant};

use marconi_core::{AlphaAdoption, AlphaMode, CacheConfig, ModelSpec, PrefixCache, TunerConfig};

mod common;
use common::Workload;

fn config(adoption: Option<AlphaAdoption>, capacity_tokens: u64) -> CacheConfig {
    let model = ModelSpec::preset("paper-7b").expect("preset");
    let kv = model.kv_bytes_per_token();
    CacheConfig {
        alpha: match adoption {
            Some(adoption) => AlphaMode::Auto(TunerConfig {
                bootstrap_factor: 1,
                retune_every: 1,
                threads: 1,
                adoption,
                ..TunerConfig::default()
            }),
            None => AlphaMode::Fixed(0.0),
        },
        ..CacheConfig::marconi(model, capacity_tokens * kv)
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn us(ns: u64) -> String {
    format!("{:.1} µs", ns as f64 / 1000.0)
}

/// Serves `warm` requests unmeasured, then measures the rest one by one.
/// The time this thread has spent runnable but waiting for a CPU (Linux
/// schedstat), so that a slow request can be told apart from a thread the
/// machine did not run: on a shared machine that, not the cache, makes most
/// of the tail. Zero where schedstat cannot be read.
struct RunDelay {
    file: Option<File>,
    stat: Option<File>,
    buf: String,
}

/// What the kernel counted for this thread at one point.
#[derive(Clone, Copy, Default)]
struct Sched {
    /// Nanoseconds runnable but waiting for a CPU.
    wait_ns: u64,
    /// Times the thread was put on a CPU: more than zero during a request
    /// means it left the CPU (preempted or blocked) in the middle of it.
    slices: u64,
    /// Minor page faults.
    faults: u64,
}

impl RunDelay {
    fn new() -> Self {
        RunDelay {
            file: File::open("/proc/thread-self/schedstat").ok(),
            stat: File::open("/proc/thread-self/stat").ok(),
            buf: String::new(),
        }
    }

    fn read(&mut self) -> Sched {
        let mut s = Sched::default();
        if let Some(f) = &mut self.file {
            self.buf.clear();
            if f.rewind().is_ok() && f.read_to_string(&mut self.buf).is_ok() {
                let mut w = self.buf.split_whitespace().skip(1);
                s.wait_ns = w.next().and_then(|w| w.parse().ok()).unwrap_or(0);
                s.slices = w.next().and_then(|w| w.parse().ok()).unwrap_or(0);
            }
        }
        if let Some(f) = &mut self.stat {
            self.buf.clear();
            if f.rewind().is_ok() && f.read_to_string(&mut self.buf).is_ok() {
                // Fields after the command's closing parenthesis: minflt is
                // the 10th field of the line, the 8th after it.
                if let Some(rest) = self.buf.rsplit_once(')').map(|r| r.1) {
                    s.faults = rest
                        .split_whitespace()
                        .nth(7)
                        .and_then(|w| w.parse().ok())
                        .unwrap_or(0);
                }
            }
        }
        s
    }
}

/// What one measured run is given.
struct Setup {
    warm: usize,
    measured: usize,
    capacity: u64,
    /// Idle time between requests (the engine's prefill and decode), not
    /// measured: gives the search thread time to finish, as in an engine.
    gap: Duration,
    gap_kind: Gap,
    /// KiB written in each gap under [`Gap::Touch`].
    touch_kib: usize,
}

/// How the gap between two requests is spent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gap {
    /// Asleep (the default): the core idles, as an engine's thread does
    /// while the GPU runs; its caches may go to other work meanwhile.
    Sleep,
    /// Busy on the core without touching memory or entering the kernel
    /// (`--gap-spin`): the caches stay warm. On one core the search thread
    /// then runs only when the scheduler preempts this one: for tuning off,
    /// or with two cores.
    Spin,
    /// Busy writing a buffer of `--gap-touch-kib` KiB (`--gap-touch-kib N`),
    /// handing the core to any other runnable thread (the search) after
    /// each pass: other work of the engine's thread evicting the cache's
    /// lines.
    Touch,
}

/// Spends `gap` as `kind` says (`buf`: the memory `Touch` writes).
fn idle(gap: Duration, kind: Gap, buf: &mut [u64]) {
    if gap.is_zero() {
        return;
    }
    match kind {
        Gap::Sleep => std::thread::sleep(gap),
        Gap::Spin | Gap::Touch => {
            let t = Instant::now();
            let mut round = 0u64;
            while t.elapsed() < gap {
                if kind == Gap::Touch {
                    // One 64-byte line in eight words: every line written.
                    for (i, w) in buf.iter_mut().enumerate().step_by(8) {
                        *w = w.wrapping_add(i as u64 ^ round);
                    }
                    round += 1;
                    std::thread::yield_now();
                }
                std::hint::spin_loop();
            }
            std::hint::black_box(&buf);
        }
    }
}

fn run(name: &str, adoption: Option<AlphaAdoption>, setup: &Setup) {
    let &Setup {
        warm,
        measured,
        capacity,
        gap,
        gap_kind,
        touch_kib,
    } = setup;
    let mut other_work = vec![0u64; touch_kib * 1024 / 8];
    let mut c = PrefixCache::new(config(adoption, capacity)).expect("config");
    let mut w = Workload::new();
    let mut full = Vec::new();
    for _ in 0..warm {
        let input_len = w.next(&mut full);
        c.serve_full(0, input_len, &full).expect("serve");
    }
    let cached = c.stats().kv_bytes / c.token_bytes();
    let nodes = c.stats().nodes;
    // What the request that opens a tuning window pays: a plain clone of the
    // cache's core (median of 21, the copy dropped outside the timing).
    // Measured with tuning off, where the cache is its core alone: with
    // tuning on, a clone of the cache would also copy the tuner's window.
    let mut clones: Vec<u64> = (0..21)
        .map(|_| {
            let t = Instant::now();
            let copy = c.clone();
            let ns = t.elapsed().as_nanos() as u64;
            drop(copy);
            ns
        })
        .collect();
    clones.sort_unstable();
    let clone_ns = clones[10];
    let start = c.stats();
    let mut times = Vec::with_capacity(measured);
    // Wall time less the time spent waiting for a CPU.
    let mut on_cpu = Vec::with_capacity(measured);
    let mut delay = RunDelay::new();
    // (ns, request, evictions during it, tuning round adopted during it, ns
    // waiting for a CPU, times it left the CPU, minor page faults)
    let mut slowest: Vec<(u64, usize, u64, bool, u64, u64, u64)> = Vec::new();
    // Largest time less CPU wait of the requests that adopted a tuning
    // round (and, with re-tuning, cloned the cache for the next window),
    // and of the others.
    let (mut adopting_max, mut other_max) = (0u64, 0u64);
    for i in 0..measured {
        let input_len = w.next(&mut full);
        idle(gap, gap_kind, &mut other_work);
        let before = c.stats();
        let sched = delay.read();
        let t = Instant::now();
        c.serve_full(0, input_len, &full).expect("serve");
        let ns = t.elapsed().as_nanos() as u64;
        let after_sched = delay.read();
        let waited = after_sched.wait_ns.saturating_sub(sched.wait_ns);
        let switches = after_sched.slices.saturating_sub(sched.slices);
        let faults = after_sched.faults.saturating_sub(sched.faults);
        times.push(ns);
        let ran = ns.saturating_sub(waited);
        on_cpu.push(ran);
        let after = c.stats();
        let adopted = after.tuning_rounds > before.tuning_rounds;
        if adopted {
            adopting_max = adopting_max.max(ran);
        } else {
            other_max = other_max.max(ran);
        }
        // Ranked by time less CPU wait: the cache's own stalls first.
        if slowest.len() < 5 || ran > slowest[4].0.saturating_sub(slowest[4].4) {
            slowest.push((
                ns,
                warm + i,
                after.evictions - before.evictions,
                adopted,
                waited,
                switches,
                faults,
            ));
            slowest.sort_by_key(|s| std::cmp::Reverse(s.0.saturating_sub(s.4)));
            slowest.truncate(5);
        }
    }
    let end = c.stats();
    let total: u64 = times.iter().sum();
    times.sort_unstable();
    on_cpu.sort_unstable();
    println!(
        "{name:<14} requests {:>6}  p50 {:>9}  p99 {:>9}  p99.9 {:>9}  max {:>10}  mean {:>9}  \
         over 1 ms {}",
        times.len(),
        us(percentile(&times, 0.5)),
        us(percentile(&times, 0.99)),
        us(percentile(&times, 0.999)),
        us(*times.last().expect("measured")),
        us(total / times.len() as u64),
        times.len() - times.partition_point(|&t| t <= 1_000_000),
    );
    println!(
        "{:<14} less CPU wait:   p50 {:>9}  p99 {:>9}  p99.9 {:>9}  max {:>10}                  \
         over 1 ms {}",
        "",
        us(percentile(&on_cpu, 0.5)),
        us(percentile(&on_cpu, 0.99)),
        us(percentile(&on_cpu, 0.999)),
        us(*on_cpu.last().expect("measured")),
        on_cpu.len() - on_cpu.partition_point(|&t| t <= 1_000_000),
    );
    println!(
        "{:<14} cached tokens at start {cached}, at end {}; tuning rounds {}; evictions {}; \
         final alpha {}{}",
        "",
        end.kv_bytes / c.token_bytes(),
        end.tuning_rounds - start.tuning_rounds,
        end.evictions - start.evictions,
        end.alpha,
        match adoption {
            None => format!(
                "; clone of the whole cache at {nodes} nodes: median {} (a window \
                 snapshot copies less: not the index)",
                us(clone_ns)
            ),
            Some(_) => String::new(),
        },
    );
    println!(
        "{:<14} max less CPU wait: requests that adopted a round {}, the others {}",
        "",
        us(adopting_max),
        us(other_max),
    );
    // For the summary table the parent process prints.
    println!(
        "TABLE|{name}|{}|{}|{}|{}|{}|{}|{}|{}",
        us(percentile(&times, 0.5)),
        us(percentile(&times, 0.99)),
        us(*times.last().expect("measured")),
        us(percentile(&on_cpu, 0.5)),
        us(percentile(&on_cpu, 0.99)),
        us(*on_cpu.last().expect("measured")),
        end.tuning_rounds - start.tuning_rounds,
        end.kv_bytes / c.token_bytes(),
    );
    for (ns, i, ev, adopted, waited, switches, faults) in slowest {
        println!(
            "{:<14} slow: request {i:>6} {:>10}  waiting for a CPU {:>10}  off the CPU {switches} \
             times  page faults {faults:>3}  evictions {ev:>3}{}",
            "",
            us(ns),
            us(waited),
            if adopted {
                "  adopted a tuning round"
            } else {
                ""
            }
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: u64| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(default)
    };
    // The cache fills (KV and states share the budget) within the warm-up;
    // the measured phase runs at about a million cached tokens.
    let setup = Setup {
        warm: 4000,
        measured: arg("--requests", 20_000) as usize,
        capacity: 1_600_000,
        gap: Duration::from_micros(arg("--gap-us", 0)),
        gap_kind: if args.iter().any(|a| a == "--gap-touch-kib") {
            Gap::Touch
        } else if args.iter().any(|a| a == "--gap-spin") {
            Gap::Spin
        } else {
            Gap::Sleep
        },
        touch_kib: arg("--gap-touch-kib", 0) as usize,
    };
    // Linux counts only the CPUs this process may run on (`taskset`).
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    if !args.iter().any(|a| a == "--mode") {
        println!(
            "decision latency: {} requests measured after {} warm-up, paper-7b, budget {} tokens \
         of KV (states included), 1 search thread, {} µs between requests ({}), {cpus} CPU(s) \
         available to this process{}",
            setup.measured,
            setup.warm,
            setup.capacity,
            setup.gap.as_micros(),
            match setup.gap_kind {
                Gap::Sleep => "asleep".to_owned(),
                Gap::Spin => "spinning".to_owned(),
                Gap::Touch => format!("writing {} KiB", setup.touch_kib),
            },
            if cpus == 1 {
                " (the search thread shares the engine's core)"
            } else {
                " (one core: `taskset -c 0 cargo bench ...`)"
            }
        );
    }
    let modes = [
        ("tuning off", None),
        ("when-ready", Some(AlphaAdoption::WhenReady)),
        ("deterministic", Some(AlphaAdoption::Deterministic)),
    ];
    // Each mode in a process of its own: a search still running when a run
    // ends (its cache dropped) would otherwise load the next run.
    if let Some(mode) = arg("--mode", u64::MAX)
        .try_into()
        .ok()
        .and_then(|m: usize| modes.get(m))
    {
        run(mode.0, mode.1, &setup);
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    let mut rows = Vec::new();
    for m in 0..modes.len() {
        let out = std::process::Command::new(&exe)
            .args(&args[1..])
            .args(["--mode", &m.to_string()])
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run a mode");
        assert!(out.status.success(), "mode {m}: {}", out.status);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            match line.strip_prefix("TABLE|") {
                Some(row) => rows.push(row.split('|').map(str::to_owned).collect::<Vec<_>>()),
                None => println!("{line}"),
            }
        }
    }
    // Wall time, and wall time less the time the thread waited for a CPU
    // (the machine's other load, or the search thread on a shared core).
    println!();
    println!(
        "| mode | p50 | p99 | max | p50 less CPU wait | p99 less CPU wait | max less CPU wait \
         | tuning rounds | cached tokens |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in rows {
        println!("| {} |", r.join(" | "));
    }
}
