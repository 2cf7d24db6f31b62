//! The index at scale: 16 engines × 100 k blocks each (16-token blocks,
//! real `sha256_cbor` chain hashes). Prints p50 / p99 / max of single
//! operations timed one by one (events applied, queries answered), then
//! criterion's means.
//!
//! `cargo bench -p marconi-router --bench index` (`-- --quick` shortens
//! the criterion part's sampling). Every fourth churn round goes through
//! the wire instead: each event encoded as a one-event msgpack batch, then
//! timed from `decode_batch` to applied. `MARCONI_BENCH_BLOCKS` changes the
//! blocks per engine.
//!
//! Workload: 256 shared system prompts of 32 blocks; each engine holds
//! conversations (a system prompt + 100–400 blocks of their own) up to its
//! block budget, with a state at each conversation's end and, for half of
//! them, at the end of the system prompt. Events: the steady churn of an
//! engine at capacity, each `BlockStored` carrying one 16-block prefill
//! chunk, each `BlockRemoved` one block (as vLLM emits them), plus the
//! state events. Queries: a cached conversation extended by 200 tokens
//! (a next turn), or a fresh conversation on a known system prompt.

use std::hint::black_box;
use std::time::Instant;

use criterion::Criterion;
use marconi_router::hash::{ChainHasher, DEFAULT_SEED};
use marconi_router::wire::{decode_batch, Groups};
use marconi_router::{BlockHash, EngineId, Index, IndexEvent, Overlap};

const BS: u32 = 16;
const ENGINES: usize = 16;
const PROMPTS: u64 = 256;
const PROMPT_BLOCKS: usize = 32;

/// SplitMix64: a deterministic generator (no randomness crates needed).
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A conversation: which system prompt, its own seed and length in blocks.
#[derive(Clone, Copy)]
struct Conv {
    prompt: u64,
    seed: u64,
    blocks: usize,
    prompt_state: bool,
}

impl Conv {
    fn tokens(&self, extra: usize) -> Vec<u32> {
        let mut t = Vec::with_capacity((PROMPT_BLOCKS + self.blocks) * BS as usize + extra);
        let mut g = Mix(self.prompt.wrapping_mul(0x1234_5678_9abc_def1));
        t.extend((0..PROMPT_BLOCKS * BS as usize).map(|_| (g.next() % 100_000) as u32));
        let mut g = Mix(self.seed);
        t.extend((0..self.blocks * BS as usize + extra).map(|_| (g.next() % 100_000) as u32));
        t
    }
}

struct Engine {
    id: EngineId,
    convs: Vec<(Conv, Vec<BlockHash>)>,
    blocks: usize,
}

fn new_conv(g: &mut Mix) -> Conv {
    Conv {
        prompt: g.below(PROMPTS),
        seed: g.next(),
        blocks: 100 + g.below(301) as usize,
        prompt_state: g.below(2) == 0,
    }
}

/// The events that cache `c` on an engine: 16-block `BlockStored` chunks,
/// then its states.
fn store_events(c: &Conv, hashes: &[BlockHash]) -> Vec<IndexEvent> {
    let mut ev: Vec<IndexEvent> = hashes
        .chunks(16)
        .map(|ch| IndexEvent::BlocksStored {
            block_hashes: ch.to_vec(),
            block_size: BS,
        })
        .collect();
    if c.prompt_state {
        ev.push(IndexEvent::StateStored {
            block_hash: hashes[PROMPT_BLOCKS - 1],
        });
    }
    ev.push(IndexEvent::StateStored {
        block_hash: *hashes.last().expect("a conversation has blocks"),
    });
    ev
}

/// The events that evict `c`'s own blocks (the system prompt stays): its
/// final state, then its blocks one by one from the leaf.
fn evict_events(hashes: &[BlockHash]) -> Vec<IndexEvent> {
    let mut ev = vec![IndexEvent::StateRemoved {
        block_hash: *hashes.last().expect("a conversation has blocks"),
    }];
    ev.extend(
        hashes[PROMPT_BLOCKS..]
            .iter()
            .rev()
            .map(|&h| IndexEvent::BlocksRemoved {
                block_hashes: vec![h],
            }),
    );
    ev
}

fn key(b: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(b, s).expect("vec");
}

/// `ev` as a one-event `KVEventBatch` (docs/events.md §3, map layout, with
/// `block_size` token ids per block as engines send them).
fn payload(ev: &IndexEvent, g: &mut Mix) -> Vec<u8> {
    use rmp::encode::{
        write_array_len as arr, write_map_len as map, write_nil as nil, write_uint as uint,
    };
    let mut b = Vec::with_capacity(256);
    arr(&mut b, 3).expect("vec");
    rmp::encode::write_f64(&mut b, 1.0).expect("vec");
    arr(&mut b, 1).expect("vec");
    let (stored, hashes, group): (bool, Vec<u64>, u64) = match ev {
        IndexEvent::BlocksStored { block_hashes, .. } => (true, block_hashes.clone(), 0),
        IndexEvent::BlocksRemoved { block_hashes } => (false, block_hashes.clone(), 0),
        IndexEvent::StateStored { block_hash } => (true, vec![*block_hash], 1),
        IndexEvent::StateRemoved { block_hash } => (false, vec![*block_hash], 1),
        IndexEvent::AllCleared => unreachable!("not in the churn"),
    };
    map(&mut b, if stored { 10 + group as u32 } else { 4 }).expect("vec");
    key(&mut b, "type");
    key(
        &mut b,
        if stored {
            "BlockStored"
        } else {
            "BlockRemoved"
        },
    );
    key(&mut b, "block_hashes");
    arr(&mut b, hashes.len() as u32).expect("vec");
    for &h in &hashes {
        uint(&mut b, h).expect("vec");
    }
    if stored {
        key(&mut b, "parent_block_hash");
        uint(&mut b, g.next()).expect("vec");
        key(&mut b, "token_ids");
        let n = hashes.len() as u32 * BS;
        arr(&mut b, n).expect("vec");
        for _ in 0..n {
            uint(&mut b, g.below(100_000)).expect("vec");
        }
        key(&mut b, "block_size");
        uint(&mut b, u64::from(BS)).expect("vec");
        key(&mut b, "lora_id");
        nil(&mut b).expect("vec");
    }
    key(&mut b, "medium");
    key(&mut b, "GPU");
    if stored {
        key(&mut b, "lora_name");
        nil(&mut b).expect("vec");
    }
    key(&mut b, "group_idx");
    uint(&mut b, group).expect("vec");
    if stored {
        key(&mut b, "kv_cache_spec_kind");
        key(
            &mut b,
            if group == 0 {
                "full_attention"
            } else {
                "mamba"
            },
        );
        if group == 1 {
            key(&mut b, "state_position");
            uint(&mut b, 16).expect("vec");
        }
    }
    uint(&mut b, 0).expect("vec");
    b
}

fn percentiles(name: &str, mut ns: Vec<u64>) {
    ns.sort_unstable();
    let q = |p: f64| ns[((p * ns.len() as f64).ceil() as usize).clamp(1, ns.len()) - 1];
    let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64;
    println!(
        "{name:<44} n={:>8}  p50={:>9.3} µs  p99={:>9.3} µs  max={:>9.3} µs  mean={:>9.3} µs",
        ns.len(),
        q(0.50) as f64 / 1e3,
        q(0.99) as f64 / 1e3,
        *ns.last().expect("samples") as f64 / 1e3,
        mean / 1e3,
    );
}

fn main() {
    let per_engine: usize = std::env::var("MARCONI_BENCH_BLOCKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let hasher = ChainHasher::new(DEFAULT_SEED, BS);
    let mut g = Mix(42);
    let mut index = Index::new(BS).expect("block size > 0");
    let t = Instant::now();
    let mut engines: Vec<Engine> = (0..ENGINES)
        .map(|i| Engine {
            id: index.add_engine(format!("engine-{i}")).expect("16 engines"),
            convs: Vec::new(),
            blocks: 0,
        })
        .collect();
    let mut hashes = Vec::new();
    for e in &mut engines {
        while e.blocks < per_engine {
            let c = new_conv(&mut g);
            hashes.clear();
            hasher.wire_hashes(&c.tokens(0), 0, &mut hashes);
            for ev in store_events(&c, &hashes) {
                index.apply(e.id, &ev).expect("consistent events");
            }
            e.blocks += c.blocks;
            e.convs.push((c, hashes.clone()));
        }
    }
    let held: u64 = engines.iter().map(|e| index.stats(e.id).blocks).sum();
    println!(
        "index: {ENGINES} engines, {} blocks held ({} per engine on average), {} distinct, built in {:.1} s",
        held,
        held / ENGINES as u64,
        index.distinct_blocks(),
        t.elapsed().as_secs_f64()
    );

    // Events: steady churn at capacity, each event timed alone.
    let rounds = 400;
    let mut apply_ns = Vec::new();
    let mut stored_ns = Vec::new();
    let mut removed_ns = Vec::new();
    let mut wire_ns = Vec::new();
    let mut wire_bytes = 0usize;
    let mut groups = Groups::default();
    for r in 0..rounds {
        let e = &mut engines[r % ENGINES];
        let victim = g.below(e.convs.len() as u64) as usize;
        let (_, old) = e.convs.swap_remove(victim);
        let c = new_conv(&mut g);
        hashes.clear();
        hasher.wire_hashes(&c.tokens(0), 0, &mut hashes);
        let mut events = evict_events(&old);
        events.extend(store_events(&c, &hashes));
        e.convs.push((c, hashes.clone()));
        let payloads: Vec<Vec<u8>> = if r % 4 == 0 {
            events.iter().map(|ev| payload(ev, &mut g)).collect()
        } else {
            Vec::new()
        };
        for (k, ev) in events.iter().enumerate() {
            if let Some(p) = payloads.get(k) {
                // Every fourth round goes through the wire: decode, then apply.
                wire_bytes += p.len();
                let t = Instant::now();
                let batch = decode_batch(black_box(p), &mut groups).expect("valid payload");
                for ev in &batch.events {
                    index.apply(e.id, ev).expect("consistent events");
                }
                wire_ns.push(t.elapsed().as_nanos() as u64);
                continue;
            }
            let t = Instant::now();
            let r = index.apply(e.id, black_box(ev));
            let dt = t.elapsed().as_nanos() as u64;
            r.expect("consistent events");
            apply_ns.push(dt);
            match ev {
                IndexEvent::BlocksStored { .. } => stored_ns.push(dt),
                IndexEvent::BlocksRemoved { .. } => removed_ns.push(dt),
                _ => {}
            }
        }
    }
    percentiles("event applied (all kinds)", apply_ns);
    percentiles("  BlockStored (16 blocks)", stored_ns);
    percentiles("  BlockRemoved (1 block)", removed_ns);
    let n_wire = wire_ns.len();
    percentiles("event decoded from msgpack + applied", wire_ns);
    println!(
        "  (payloads of one event, {} bytes on average)",
        wire_bytes / n_wire.max(1)
    );

    // Queries: next turns of cached conversations and new conversations.
    let mut probe_ns = Vec::new();
    let mut full_ns = Vec::new();
    let mut hash_ns = Vec::new();
    let mut out: Vec<Overlap> = Vec::new();
    let mut qh = Vec::new();
    let mut resumable_short = 0u64;
    let mut query_tokens = 0usize;
    let queries = 2000;
    for q in 0..queries {
        let tokens = if q % 4 == 3 {
            new_conv(&mut g).tokens(200)
        } else {
            let e = &engines[g.below(ENGINES as u64) as usize];
            let (c, _) = &e.convs[g.below(e.convs.len() as u64) as usize];
            c.tokens(200)
        };
        query_tokens += tokens.len();
        let t = Instant::now();
        qh.clear();
        hasher.wire_hashes(black_box(&tokens), 0, &mut qh);
        let th = t.elapsed().as_nanos() as u64;
        let t2 = Instant::now();
        index.overlap_hashes(black_box(&qh), tokens.len(), &mut out);
        let tp = t2.elapsed().as_nanos() as u64;
        hash_ns.push(th);
        probe_ns.push(tp);
        full_ns.push(th + tp);
        resumable_short += out
            .iter()
            .filter(|o| o.resumable_tokens < o.kv_matched_tokens)
            .count() as u64;
    }
    percentiles("query: index walk (hashes given)", probe_ns);
    percentiles("query: sha256_cbor chain hashing", hash_ns);
    percentiles("query: total (hash + walk)", full_ns);
    println!(
        "queries: {queries}, {} tokens on average; engine answers whose resumable < kv match: {resumable_short}",
        query_tokens / queries
    );

    // Criterion's means for the same operations.
    let mut cr = Criterion::default().configure_from_args();
    let e0 = engines[0].id;
    let (c0, h0) = engines[0].convs[0].clone();
    let t0 = c0.tokens(200);
    let mut qh0 = Vec::new();
    hasher.wire_hashes(&t0, 0, &mut qh0);
    cr.bench_function("overlap_hashes (next turn, 16 engines)", |b| {
        b.iter(|| index.overlap_hashes(black_box(&qh0), t0.len(), &mut out))
    });
    cr.bench_function("remove + store one block", |b| {
        let h = vec![h0[h0.len() - 1]];
        b.iter(|| {
            index.remove_blocks(e0, black_box(&h)).expect("engine");
            index.store_blocks(e0, BS, black_box(&h)).expect("engine");
        })
    });
    cr.final_summary();
}
