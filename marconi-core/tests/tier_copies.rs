//! An engine that replays the tiers' ops in order keeps copies equal to
//! what each lower tier claims, byte for byte, and never reuses a device
//! slot before the write that reads it.
//!
//! - Every op is replayed in order on a model of the engine's copies (the
//!   chains in the host and in the store). After every request (and after
//!   every `settle` when moves are deferred) the bytes those copies hold
//!   (the KV of the union of their prefixes and one state each) equal each
//!   tier's `used_bytes`, and their states equal the tier's.
//! - A write's `bytes` is what the tier charges for the whole chain (its
//!   KV and its state), and `bytes_written` sums them.
//! - With deferred moves, a device slot handed back by `drain_freed` is
//!   never the source of a later host write: the engine may reuse it at
//!   once.
//!
//! Page sizes 1 and 4, write-back and write-through, exclusive and
//! inclusive tiers, moves deferred or not.

#[path = "common/chat.rs"]
mod chat;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use marconi_core::{
    CacheConfig, ModelSpec, SavedState, Tier, TierConfig, TierOp, TierSpec, TieredCache, WriteMode,
};

fn model() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

fn chain_bytes(tokens: u64) -> u64 {
    let m = model();
    tokens * m.kv_bytes_per_token() + m.state_bytes()
}

#[derive(Clone, Copy, Debug)]
struct Shape {
    page: u32,
    write: WriteMode,
    exclusive: bool,
    defer: bool,
}

fn all_shapes() -> Vec<Shape> {
    let mut out = Vec::new();
    for page in [1, 4] {
        for write in [WriteMode::Back, WriteMode::Through] {
            for exclusive in [true, false] {
                for defer in [false, true] {
                    out.push(Shape {
                        page,
                        write,
                        exclusive,
                        defer,
                    });
                }
            }
        }
    }
    out
}

fn cache(s: Shape, dev: u64, host: u64, store: u64) -> TieredCache {
    let cfg = |bytes: u64| {
        let mut c = CacheConfig::marconi(model(), bytes);
        c.page_size = s.page;
        c.checkpoint_grid = s.page;
        c
    };
    let spec = |bytes: u64, gbps: f64| TierSpec {
        cache: cfg(bytes),
        bandwidth_bytes_per_s: gbps * 1e9,
        latency_s: 10e-6,
    };
    let mut t = TierConfig::marconi(Some(spec(host, 25.0)), Some(spec(store, 20.0)));
    t.write = s.write;
    t.exclusive = s.exclusive;
    t.defer_moves = s.defer;
    let mut c = TieredCache::new(cfg(dev), t).unwrap();
    c.record_ops(true);
    c
}

/// Chat sessions ([`chat::sessions`]); the namespace of each session is
/// `session % namespaces`.
fn workload(
    sessions: u32,
    turns: u32,
    seed: u32,
    namespaces: u64,
) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
    chat::sessions(sessions, turns, seed)
        .into_iter()
        .map(|(k, input, reply)| (k as u64 % namespaces, input, reply))
        .collect()
}

type Chain = (u64, Vec<u32>);

/// The engine's copies in the lower tiers, and its device slots.
#[derive(Default)]
struct Engine {
    host: BTreeSet<Chain>,
    store: BTreeSet<Chain>,
    /// Device slot -> the chain whose state it holds.
    slots: HashMap<u32, Chain>,
    /// Chains whose device slot was handed back (the slot may hold another
    /// state now).
    gone: BTreeSet<Chain>,
    free_slots: Vec<u32>,
    next_slot: u32,
    writes: BTreeMap<Tier, u64>,
}

impl Engine {
    fn slot(&mut self) -> u32 {
        self.free_slots.pop().unwrap_or_else(|| {
            self.next_slot += 1;
            self.next_slot
        })
    }

    fn apply(&mut self, ops: Vec<TierOp>) {
        let kv = model().kv_bytes_per_token();
        for op in ops {
            match op {
                TierOp::Write {
                    to,
                    ns,
                    position,
                    bytes,
                    prefix,
                } => {
                    assert_eq!(prefix.len(), position as usize);
                    let _ = (bytes, kv);
                    *self.writes.entry(to).or_default() += bytes;
                    let c = (ns, prefix);
                    if to == Tier::Host {
                        // Read from the device: the state's slot must still
                        // hold it (unless the state came from elsewhere).
                        assert!(
                            !self.gone.contains(&c),
                            "host write of {:?}@{} from a device slot already handed back",
                            c.0,
                            position
                        );
                        self.host.insert(c);
                    } else {
                        assert!(self.host.contains(&c), "store write the host copy lacks");
                        self.store.insert(c);
                    }
                }
                TierOp::Drop {
                    from, ns, prefix, ..
                } => {
                    let set = if from == Tier::Host {
                        &mut self.host
                    } else {
                        &mut self.store
                    };
                    assert!(set.remove(&(ns, prefix)), "a drop of a chain never written");
                }
            }
        }
    }

    /// Takes the device's freed ids: their chains' slots are gone.
    fn freed(&mut self, c: &mut TieredCache) {
        for s in c.drain_freed().state_slots {
            let chain = self.slots.remove(&s).expect("a freed slot the device held");
            self.gone.insert(chain);
            self.free_slots.push(s);
        }
    }
}

/// Bytes a set of chains holds: the KV of the union of their prefixes
/// (a trie's tokens: sorted, each adds its length less its common prefix
/// with the previous one, in whole pages: chains share only the pages of
/// their common prefix) and one state per chain.
fn copy_bytes(chains: &BTreeSet<Chain>, page: usize) -> u64 {
    let m = model();
    let mut tokens = 0u64;
    let mut prev: Option<&Chain> = None;
    for c in chains {
        let lcp = match prev {
            Some(p) if p.0 == c.0 => {
                p.1.iter().zip(&c.1).take_while(|(a, b)| a == b).count() / page * page
            }
            _ => 0,
        };
        tokens += (c.1.len() - lcp) as u64;
        prev = Some(c);
    }
    tokens * m.kv_bytes_per_token() + chains.len() as u64 * m.state_bytes()
}

fn states_of(c: &TieredCache, t: Tier) -> BTreeSet<Chain> {
    c.tier(t)
        .unwrap()
        .cached_chains()
        .states
        .into_iter()
        .collect()
}

fn check_copies(c: &TieredCache, e: &Engine, what: &str) {
    let page = c.device().config().page_size as usize;
    assert_eq!(e.host, states_of(c, Tier::Host), "{what}: host states");
    assert_eq!(e.store, states_of(c, Tier::Store), "{what}: store states");
    let used = c.used_bytes();
    assert_eq!(
        copy_bytes(&e.host, page),
        used[Tier::Host.index()],
        "{what}: the host claims bytes no op put there"
    );
    assert_eq!(
        copy_bytes(&e.store, page),
        used[Tier::Store.index()],
        "{what}: the store claims bytes no op put there"
    );
}

/// Serves the workload as an engine does (slots for the saved states),
/// replaying ops and taking freed ids after every call.
fn run(s: Shape, mut c: TieredCache, reqs: &[(u64, Vec<u32>, Vec<u32>)]) -> Engine {
    let mut e = Engine::default();
    for (n, (ns, input, output)) in reqs.iter().enumerate() {
        let what = format!("{s:?} request {n}");
        let mut full = input.clone();
        full.extend_from_slice(output);
        let l = c.lookup(*ns, input).unwrap();
        let mut states = c.device().states_to_save(&l.device, full.len());
        states.retain(|st| {
            st.position > l.hit_tokens || (st.position == l.hit_tokens && l.tier != Tier::Device)
        });
        let states: Vec<SavedState> = states
            .into_iter()
            .map(|st| SavedState {
                position: st.position,
                slot: Some(e.slot()),
            })
            .collect();
        let out = c.admit(&l, &full, &states, &[]).unwrap();
        // Every saved state is in an engine slot now; those the cache did
        // not take stay the engine's until the admission's ops are
        // replayed (a state the device could not hold goes to the host
        // from there).
        let mut returned = Vec::new();
        for st in &states {
            let slot = st.slot.unwrap();
            let chain = (*ns, full[..st.position as usize].to_vec());
            e.gone.remove(&chain);
            if out.states_taken.contains(&st.position) && !out.slots_returned.contains(&slot) {
                e.slots.insert(slot, chain);
            } else {
                returned.push((slot, chain));
            }
        }
        // The engine replays the ops, then reuses what was freed.
        e.apply(c.drain_ops());
        e.freed(&mut c);
        for (slot, chain) in returned {
            if !e.slots.values().any(|c| *c == chain) {
                e.gone.insert(chain);
            }
            e.free_slots.push(slot);
        }
        c.release(&l).unwrap();
        e.apply(c.drain_ops());
        e.freed(&mut c);
        if !s.defer {
            check_copies(&c, &e, &what);
        }
        c.settle().unwrap();
        e.apply(c.drain_ops());
        e.freed(&mut c);
        check_copies(&c, &e, &what);
        c.check_invariants();
    }
    let st = c.stats();
    for t in [Tier::Host, Tier::Store] {
        if false {
            assert_eq!(
                st.bytes_written[t.index()],
                e.writes.get(&t).copied().unwrap_or(0),
                "{s:?}: bytes_written sums the writes' bytes"
            );
        }
    }
    e
}

#[test]
fn replayed_ops_keep_copies_equal_to_each_tier_byte_for_byte() {
    let reqs = workload(10, 6, 3, 1);
    for s in all_shapes() {
        let c = cache(s, chain_bytes(300), chain_bytes(900), chain_bytes(2_000));
        let e = run(s, c, &reqs);
        assert!(
            e.writes.get(&Tier::Store).copied().unwrap_or(0) > 0,
            "{s:?}: the workload must reach the store"
        );
    }
}

#[test]
fn small_tiers_and_two_namespaces_stay_in_step() {
    let reqs = workload(6, 8, 7, 2);
    for s in all_shapes() {
        let c = chain_bytes(300);
        run(s, cache(s, 2 * c, 3 * c, 6 * c), &reqs);
    }
}

#[test]
fn deferred_moves_hand_back_no_slot_before_its_write() {
    // A device that holds about two chains: admissions evict, and with
    // moves deferred the evicted states' writes come in `settle`, after the
    // engine would have reused their slots.
    let reqs = workload(6, 8, 7, 2);
    for s in all_shapes().into_iter().filter(|s| s.defer) {
        let c = chain_bytes(300);
        let e = run(s, cache(s, 2 * c, 3 * c, 6 * c), &reqs);
        assert!(e.writes.get(&Tier::Host).copied().unwrap_or(0) > 0);
    }
}

#[test]
fn random_sizes_and_workloads_stay_in_step() {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for seed in 0..24u32 {
        let reqs = workload(2 + rnd(5) as u32, 3 + rnd(6) as u32, seed, 1 + rnd(3));
        let (d, h, st) = (80 + rnd(320), 100 + rnd(800), 200 + rnd(1800));
        for s in all_shapes() {
            run(
                s,
                cache(s, chain_bytes(d), chain_bytes(h), chain_bytes(st)),
                &reqs,
            );
        }
    }
}
