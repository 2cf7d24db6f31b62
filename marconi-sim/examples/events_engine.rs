//! An engine process for the router's loopback test (`tests/route_zmq.rs`)
//! that publishes with the library's own event stream: a marconi cache with
//! `CacheConfig::events` on, serving a seeded synthetic workload (shared
//! system prompts, multi-turn sessions, evictions); its `drain_events` go
//! through `marconi-events`' encoder and ZeroMQ publisher (vLLM's framing)
//! to `marconi-router`'s subscriber, so the producer and the consumer,
//! written apart from docs/events.md, are checked against each other.
//! `route_engine` is the same engine with a fixture publisher written from
//! the document. Commands on stdin:
//!
//! - `run N`: serve N more requests, publishing one batch per request, then
//!   print `published S` (the batches published so far);
//! - `state`: print `blocks H...` and `states H...`, the wire hashes of
//!   every cached block and state, computed from the cache's own content
//!   (`PrefixCache::cached_chains`) with `marconi_router::hash`, and
//!   `evictions E`;
//! - end of input: exit (the replay socket serves until then).
//!
//! `events_engine EVENTS_ENDPOINT REPLAY_ENDPOINT|- SEED [PAGE_SIZE]`

use std::collections::BTreeSet;
use std::io::{self, BufRead, Write};

use marconi_core::{CacheConfig, ModelSpec, PrefixCache};
use marconi_events::{Encoder, EncoderConfig, Publisher, PublisherConfig};
use marconi_router::hash::{ChainHasher, DEFAULT_SEED};

/// SplitMix64.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn tokens(&mut self, n: u64) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 50_000) as u32).collect()
    }
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        return Err(
            "usage: events_engine EVENTS_ENDPOINT REPLAY_ENDPOINT|- SEED [PAGE_SIZE]".into(),
        );
    }
    let replay = (args[1] != "-").then_some(args[1].as_str());
    let seed: u64 = args[2].parse().map_err(|e| format!("seed: {e}"))?;
    let page: u32 = match args.get(3) {
        Some(s) => s.parse().map_err(|e| format!("page size: {e}"))?,
        None => 4,
    };
    let model = ModelSpec::preset("paper-7b").ok_or("preset")?;
    // Room for a few sessions: evictions start within the first runs.
    let kv_token = model.kv_bytes_per_token();
    let state = model.state_bytes();
    let mut cfg = CacheConfig::marconi(model, 6 * state + 3_000 * kv_token);
    cfg.page_size = page;
    cfg.alpha = marconi_core::AlphaMode::Fixed(1.0);
    cfg.events = true;
    let mut cache = PrefixCache::new(cfg).map_err(|e| e.to_string())?;
    let mut enc = Encoder::new(EncoderConfig::new(page)).map_err(|e| e.to_string())?;
    // vLLM's rule: a PUB endpoint with a host is connected, one with `*` is
    // bound. The router connects to `tcp://127.0.0.1:P`, so bind `tcp://*:P`.
    let bind = args[0].replacen("127.0.0.1", "*", 1);
    let publisher =
        Publisher::new(PublisherConfig::new(&bind, replay)).map_err(|e| e.to_string())?;
    let mut g = Mix(seed);
    let prompts: Vec<Vec<u32>> = (0..3).map(|_| g.tokens(u64::from(page) * 6)).collect();
    let mut sessions: Vec<Vec<u32>> = Vec::new();
    let mut published = 0u64;
    let out = io::stdout();
    for line in io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("run"), Some(n)) => {
                let n: u64 = n.parse().map_err(|e| format!("run: {e}"))?;
                for _ in 0..n {
                    // A next turn of a session, or a new one on a shared prompt.
                    let mut input = if !sessions.is_empty() && g.next() % 3 != 0 {
                        let i = (g.next() % sessions.len() as u64) as usize;
                        sessions.swap_remove(i)
                    } else {
                        prompts[(g.next() % 3) as usize].clone()
                    };
                    let len = 5 + g.next() % 40;
                    input.extend(g.tokens(len));
                    let out_len = 1 + g.next() % 20;
                    let output = g.tokens(out_len);
                    cache.serve(0, &input, &output).map_err(|e| e.to_string())?;
                    input.extend(output);
                    sessions.push(input);
                    if sessions.len() > 12 {
                        sessions.remove(0);
                    }
                    let payload = enc.encode(published as f64, &cache.drain_events());
                    publisher.publish(payload).map_err(|e| e.to_string())?;
                    published += 1;
                }
                writeln!(out.lock(), "published {published}").map_err(|e| e.to_string())?;
            }
            (Some("state"), None) => {
                let h = ChainHasher::new(DEFAULT_SEED, page);
                let chains = cache.cached_chains();
                let mut blocks = BTreeSet::new();
                for (ns, tokens) in &chains.kv {
                    let mut v = Vec::new();
                    h.wire_hashes(tokens, *ns, &mut v);
                    blocks.extend(v);
                }
                let mut states = BTreeSet::new();
                for (ns, tokens) in &chains.states {
                    let mut v = Vec::new();
                    h.wire_hashes(tokens, *ns, &mut v);
                    if tokens.len() % page as usize != 0 {
                        return Err(format!("a state at {} is not on a page", tokens.len()));
                    }
                    states.extend(v.last());
                }
                let join =
                    |s: &BTreeSet<u64>| s.iter().map(u64::to_string).collect::<Vec<_>>().join(" ");
                let mut o = out.lock();
                writeln!(o, "blocks {}", join(&blocks)).map_err(|e| e.to_string())?;
                writeln!(o, "states {}", join(&states)).map_err(|e| e.to_string())?;
                writeln!(o, "evictions {}", cache.stats().evictions).map_err(|e| e.to_string())?;
            }
            _ => return Err(format!("unknown command {line:?}")),
        }
    }
    Ok(())
}
