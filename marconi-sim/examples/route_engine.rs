//! A stand-in engine process for the router's loopback test
//! (`tests/route_zmq.rs`): a marconi cache (16 MB-scale capacity, so it
//! evicts) serving a seeded synthetic workload through
//! [`marconi_sim::route_feed::EngineFeed`] (real page and slot ids), and
//! publishing the resulting events as `KVEventBatch` payloads
//! (docs/events.md §3, map layout) with vLLM's ZMQ framing (§5: PUB
//! `[topic, seq, payload]`, a ROUTER replaying from a sequence number).
//! The encoder and publisher here are a test fixture written from the
//! document; marconi-events is the library's own.
//! Commands on stdin: `run N` (serve N requests, one batch each, then print
//! `published S`), `state` (print `blocks H...` and `states H...`: what the
//! cache owns, by the ids it took and has not freed, and `evictions E`);
//! end of input exits.
//!
//! `route_engine EVENTS_ENDPOINT REPLAY_ENDPOINT|- SEED`

use std::io::{self, BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use marconi_core::{AlphaMode, CacheConfig, ModelSpec, PrefixCache};
use marconi_router::hash::{ChainHasher, DEFAULT_SEED};
use marconi_router::IndexEvent;
use marconi_sim::route_feed::EngineFeed;

const PAGE: u32 = 4;

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

fn key(b: &mut Vec<u8>, s: &str) -> io::Result<()> {
    rmp::encode::write_str(b, s).map_err(io::Error::other)
}

/// One batch of `events` (docs/events.md §3): KV blocks as group 0, states
/// as group 1 (`kv_cache_spec_kind` "mamba", `state_position` the block end).
fn payload(ts: f64, events: &[IndexEvent]) -> io::Result<Vec<u8>> {
    use rmp::encode::{
        write_array_len as arr, write_map_len as map, write_nil as nil, write_uint as uint,
    };
    let e = io::Error::other;
    let mut b = Vec::new();
    arr(&mut b, 3).map_err(e)?;
    rmp::encode::write_f64(&mut b, ts).map_err(e)?;
    arr(&mut b, events.len() as u32).map_err(e)?;
    for ev in events {
        let (stored, hashes, group): (bool, Vec<u64>, u64) = match ev {
            IndexEvent::BlocksStored { block_hashes, .. } => (true, block_hashes.clone(), 0),
            IndexEvent::BlocksRemoved { block_hashes } => (false, block_hashes.clone(), 0),
            IndexEvent::StateStored { block_hash } => (true, vec![*block_hash], 1),
            IndexEvent::StateRemoved { block_hash } => (false, vec![*block_hash], 1),
            IndexEvent::AllCleared => {
                map(&mut b, 1).map_err(e)?;
                key(&mut b, "type")?;
                key(&mut b, "AllBlocksCleared")?;
                continue;
            }
        };
        map(&mut b, if stored { 9 } else { 4 }).map_err(e)?;
        key(&mut b, "type")?;
        key(
            &mut b,
            if stored {
                "BlockStored"
            } else {
                "BlockRemoved"
            },
        )?;
        key(&mut b, "block_hashes")?;
        arr(&mut b, hashes.len() as u32).map_err(e)?;
        for &h in &hashes {
            uint(&mut b, h).map_err(e)?;
        }
        if stored {
            // The index does not read tokens or parents; sent empty here.
            key(&mut b, "parent_block_hash")?;
            nil(&mut b)?;
            key(&mut b, "token_ids")?;
            arr(&mut b, 0).map_err(e)?;
            key(&mut b, "block_size")?;
            uint(&mut b, u64::from(PAGE)).map_err(e)?;
            key(&mut b, "lora_id")?;
            nil(&mut b)?;
        }
        key(&mut b, "medium")?;
        key(&mut b, "GPU")?;
        key(&mut b, "group_idx")?;
        uint(&mut b, group).map_err(e)?;
        if stored {
            key(&mut b, "kv_cache_spec_kind")?;
            key(
                &mut b,
                if group == 0 {
                    "full_attention"
                } else {
                    "mamba"
                },
            )?;
            // No `state_position`: the feed knows the state's block, not
            // its position (a block end; the router treats it as such).
        }
    }
    uint(&mut b, 0).map_err(e)?;
    Ok(b)
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 3 {
        return Err("usage: route_engine EVENTS_ENDPOINT REPLAY_ENDPOINT|- SEED".into());
    }
    let seed: u64 = args[2].parse().map_err(|e| format!("seed: {e}"))?;
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).map_err(|e| e.to_string())?;
    publisher
        .bind(&args[0])
        .map_err(|e| format!("bind {}: {e}", args[0]))?;
    let buffer: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let replay = if args[1] == "-" {
        None
    } else {
        let router = ctx.socket(zmq::ROUTER).map_err(|e| e.to_string())?;
        router
            .bind(&args[1])
            .map_err(|e| format!("bind {}: {e}", args[1]))?;
        router.set_rcvtimeo(20).map_err(|e| e.to_string())?;
        let (buf, st) = (buffer.clone(), stop.clone());
        Some(std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let Ok(msg) = router.recv_multipart(0) else {
                    continue;
                };
                let [id, empty, start] = msg.as_slice() else {
                    continue;
                };
                let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
                    continue;
                };
                if !empty.is_empty() {
                    continue;
                }
                let start = u64::from_be_bytes(start);
                let batches = buf.lock().expect("no panic while held").clone();
                for (seq, p) in batches.iter().enumerate().skip(start as usize) {
                    let s = (seq as u64).to_be_bytes();
                    let _ = router.send_multipart([&id[..], b"", b"", &s, p], 0);
                }
                let _ = router.send_multipart([&id[..], b"", b"", &[0xff; 8], b""], 0);
            }
        }))
    };
    let model = ModelSpec::preset("paper-7b").ok_or("preset")?;
    let capacity = 6 * model.state_bytes() + 3_000 * model.kv_bytes_per_token();
    let mut cfg = CacheConfig::marconi(model, capacity);
    cfg.page_size = PAGE;
    cfg.alpha = AlphaMode::Fixed(1.0);
    let mut cache = PrefixCache::new(cfg).map_err(|e| e.to_string())?;
    let mut feed = EngineFeed::new(PAGE);
    let hasher = ChainHasher::new(DEFAULT_SEED, PAGE);
    let mut g = Mix(seed);
    let prompts: Vec<Vec<u32>> = (0..3).map(|_| g.tokens(u64::from(PAGE) * 6)).collect();
    let mut sessions: Vec<Vec<u32>> = Vec::new();
    let mut published = 0u64;
    let mut hashes = Vec::new();
    let out = io::stdout();
    for line in io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["run", n] => {
                let n: u64 = n.parse().map_err(|e| format!("run: {e}"))?;
                for _ in 0..n {
                    let mut seq = if !sessions.is_empty() && g.next() % 3 != 0 {
                        let i = (g.next() % sessions.len() as u64) as usize;
                        sessions.swap_remove(i)
                    } else {
                        prompts[(g.next() % 3) as usize].clone()
                    };
                    let extra = 5 + g.next() % 40;
                    seq.extend(g.tokens(extra));
                    let input_len = seq.len();
                    let output = 1 + g.next() % 20;
                    seq.extend(g.tokens(output));
                    hashes.clear();
                    hasher.wire_hashes(&seq, 0, &mut hashes);
                    feed.serve(&mut cache, input_len, &seq, &hashes)
                        .map_err(|e| e.to_string())?;
                    let events: Vec<IndexEvent> = feed.drain().collect();
                    let p = payload(published as f64, &events).map_err(|e| e.to_string())?;
                    publisher
                        .send_multipart([&b""[..], &published.to_be_bytes(), &p], 0)
                        .map_err(|e| e.to_string())?;
                    buffer.lock().expect("no panic while held").push(p);
                    published += 1;
                    sessions.push(seq);
                    if sessions.len() > 12 {
                        sessions.remove(0);
                    }
                }
                writeln!(out.lock(), "published {published}").map_err(|e| e.to_string())?;
            }
            ["state"] => {
                let (blocks, states) = feed.held();
                let join = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ");
                let mut o = out.lock();
                writeln!(o, "blocks {}", join(&blocks)).map_err(|e| e.to_string())?;
                writeln!(o, "states {}", join(&states)).map_err(|e| e.to_string())?;
                writeln!(o, "evictions {}", cache.stats().evictions).map_err(|e| e.to_string())?;
            }
            _ => return Err(format!("unknown command {line:?}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = replay {
        t.join().map_err(|_| "replay thread panicked")?;
    }
    Ok(())
}
