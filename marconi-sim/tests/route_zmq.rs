//! The router's index fed over loopback ZeroMQ by three engine processes
//! (`examples/route_engine.rs`: a marconi cache whose page and slot ids
//! become events, published with vLLM's framing by a fixture written from
//! docs/events.md; `examples/events_engine.rs`: core's own event stream
//! through marconi-events' encoder and publisher), checked against what
//! each engine's cache owns:
//!
//! - engine 0 publishes before the router subscribes: the late join is a
//!   gap from sequence 0, repaired by replay;
//! - engine 1 loses batches mid-stream (dropped on arrival): repaired by
//!   replay;
//! - engine 2 has no replay socket and loses batches: the gap cannot be
//!   repaired, the index forgets what it knew of the engine and never
//!   claims a block the engine does not hold.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use marconi_router::sub::{EngineEndpoint, Subscriber};

const PAGE: u32 = 4;

fn engine_binary(name: &str) -> PathBuf {
    // target/<profile>/deps/<this test> -> target/<profile>/examples/engine
    let exe = std::env::current_exe().expect("test path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("profile dir");
    let bin = dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} missing: `cargo test` builds the examples",
        bin.display()
    );
    bin
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

struct Engine {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    endpoint: EngineEndpoint,
}

impl Engine {
    fn spawn(binary: &str, name: &str, seed: u64, replay: bool) -> Engine {
        let events = format!("tcp://127.0.0.1:{}", free_port());
        let replay = replay.then(|| format!("tcp://127.0.0.1:{}", free_port()));
        let mut child = Command::new(engine_binary(binary))
            .args([
                events.as_str(),
                replay.as_deref().unwrap_or("-"),
                &seed.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the engine");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        Engine {
            child,
            stdin,
            stdout,
            endpoint: EngineEndpoint {
                name: name.into(),
                events,
                replay,
                topic: Vec::new(),
            },
        }
    }

    fn line(&mut self) -> String {
        let mut s = String::new();
        self.stdout.read_line(&mut s).expect("engine output");
        assert!(!s.is_empty(), "{} exited", self.endpoint.name);
        s.trim_end().to_string()
    }

    fn send(&mut self, cmd: &str) {
        let i = self.stdin.as_mut().expect("open");
        writeln!(i, "{cmd}").expect("engine input");
        i.flush().expect("flush");
    }

    /// Serves `n` requests; returns the batches published so far.
    fn run(&mut self, n: u32) -> u64 {
        self.send(&format!("run {n}"));
        let l = self.line();
        l.strip_prefix("published ")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("unexpected {l:?}"))
    }

    /// The engine's cached blocks and states (sorted wire hashes) and its
    /// eviction count.
    fn state(&mut self) -> (Vec<u64>, Vec<u64>, u64) {
        self.send("state");
        let mut parse = |what: &str| -> Vec<u64> {
            let l = self.line();
            let rest = l
                .strip_prefix(what)
                .unwrap_or_else(|| panic!("expected {what}, got {l:?}"));
            rest.split_whitespace()
                .map(|w| w.parse().expect("a hash"))
                .collect()
        };
        let blocks = parse("blocks");
        let states = parse("states");
        let ev = parse("evictions");
        (blocks, states, ev[0])
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

#[test]
fn three_engines_over_loopback_with_gaps() {
    three_engines("route_engine");
}

/// The same with the library's own producer: core's event stream through
/// marconi-events' encoder and publisher (`examples/events_engine.rs`).
#[test]
fn three_engines_publishing_with_marconi_events() {
    three_engines("events_engine");
}

fn three_engines(binary: &str) {
    let mut engines = [
        Engine::spawn(binary, "late-join", 1, true),
        Engine::spawn(binary, "lossy", 2, true),
        Engine::spawn(binary, "no-replay", 3, false),
    ];
    // Engine 0 serves before anyone listens.
    let early = engines[0].run(40);
    assert_eq!(early, 40);
    let eps: Vec<EngineEndpoint> = engines.iter().map(|e| e.endpoint.clone()).collect();
    let mut sub = Subscriber::new(PAGE, &eps, Duration::from_secs(5)).expect("subscriber");
    let ids: Vec<_> = (0..3).map(|i| sub.engine(i).expect("engine")).collect();
    // Let the SUB connections settle (ZeroMQ's slow joiner) before engine 2
    // publishes: its stream has no replay to fall back on.
    sub.poll_until(Duration::from_millis(500), |_| false)
        .expect("poll");
    sub.drop_next_batches(ids[1], 5);
    sub.drop_next_batches(ids[2], 5);
    let mut published = [0u64; 3];
    for round in 0..3 {
        for (i, e) in engines.iter_mut().enumerate() {
            published[i] = e.run(if round == 1 { 30 } else { 20 });
        }
        // A first batch may still race the subscription on engines 1-2;
        // only engine 2's count matters (see below).
        let done = sub
            .poll_until(Duration::from_secs(20), |s| {
                (0..3).all(|i| s.feed_stats(s.engine(i).unwrap()).next_seq == published[i])
            })
            .expect("poll");
        assert!(done, "round {round}: {sub:?}");
    }
    // Engines 0 and 1: the index equals the engine's cache, gaps repaired.
    for i in 0..2 {
        let (blocks, states, evictions) = engines[i].state();
        let st = sub.feed_stats(ids[i]).clone();
        assert!(evictions > 0, "engine {i} evicted nothing");
        assert!(st.gaps >= 1 && st.replayed >= 5, "engine {i}: {st:?}");
        assert_eq!(st.unrepaired, 0, "engine {i}: {st:?}");
        assert_eq!((st.malformed, st.refused), (0, 0), "engine {i}: {st:?}");
        assert_eq!(sub.index().engine_blocks(ids[i]), blocks, "engine {i}");
        assert_eq!(sub.index().engine_states(ids[i]), states, "engine {i}");
        assert!(!states.is_empty());
    }
    assert!(sub.feed_stats(ids[0]).replayed >= early);
    // Engine 2: the loss could not be repaired; the index forgot the engine
    // and holds only what it saw since, all of it still cached.
    let (blocks, states, _) = engines[2].state();
    let st = sub.feed_stats(ids[2]).clone();
    assert!(st.unrepaired >= 1, "{st:?}");
    let held = sub.index().engine_blocks(ids[2]);
    assert!(held.iter().all(|h| blocks.binary_search(h).is_ok()));
    assert!(sub
        .index()
        .engine_states(ids[2])
        .iter()
        .all(|h| states.binary_search(h).is_ok()));
    assert!(held.len() < blocks.len() || st.unrepaired > 0);
}
