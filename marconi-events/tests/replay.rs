//! A replay with evictions: the event stream, encoded and decoded, rebuilds
//! exactly the cache's content (computed independently from the tree), in
//! process and through the ZeroMQ publisher with gaps repaired by replay.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use marconi_core::{CacheConfig, CacheEvent, ModelSpec, PrefixCache};
use marconi_events::{
    decode_batch, external, BlockHasher, Encoder, EncoderConfig, Mirror, Publisher,
    PublisherConfig, END_SEQ, GROUP_KV, GROUP_STATE,
};

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Multi-turn sessions over a few shared system prompts, in two namespaces:
/// prefixes shared, extended and forked, under a budget that forces both
/// kinds of eviction (leaves, and states of inner nodes).
fn requests(seed: u64, n: usize) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
    let mut rng = Lcg(seed);
    let systems: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..40).map(|i| 1000 * (s + 1) + i).collect())
        .collect();
    let mut sessions: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut out = Vec::new();
    for _ in 0..n {
        let pick = rng.below(10);
        let (ns, mut ctx) = if sessions.is_empty() || pick < 3 {
            let ns = rng.below(4) / 3; // mostly namespace 0
            (ns, systems[rng.below(3) as usize].clone())
        } else {
            let i = rng.below(sessions.len() as u64) as usize;
            sessions[i].clone()
        };
        let user = 5 + rng.below(40) as usize;
        ctx.extend((0..user).map(|_| rng.below(50_000) as u32));
        let output: Vec<u32> = (0..(1 + rng.below(30)))
            .map(|_| rng.below(50_000) as u32)
            .collect();
        let mut full = ctx.clone();
        full.extend_from_slice(&output);
        sessions.push((ns, full));
        if sessions.len() > 12 {
            sessions.remove(rng.below(12) as usize);
        }
        out.push((ns, ctx, output));
    }
    out
}

fn cache(page: u32, capacity_tokens: u64) -> PrefixCache {
    let model = ModelSpec::preset("paper-7b").unwrap();
    let probe = PrefixCache::new(CacheConfig::marconi(model.clone(), 1 << 40)).unwrap();
    let kv = probe.token_bytes();
    let state = model.state_bytes();
    let mut cfg = CacheConfig::marconi(model, capacity_tokens * kv + 6 * state);
    cfg.page_size = page;
    cfg.events = true;
    PrefixCache::new(cfg).unwrap()
}

/// The set the stream must rebuild, from the tree (not from the events).
fn expected(cache: &PrefixCache, hasher: &BlockHasher) -> HashSet<(u32, u64)> {
    let bs = cache.config().page_size as usize;
    let chains = cache.cached_chains();
    let mut set = HashSet::new();
    for (ns, tokens) in &chains.kv {
        assert_eq!(tokens.len() % bs, 0, "cached chains end on page boundaries");
        for d in hasher.chain(tokens, bs, *ns) {
            set.insert((GROUP_KV, external(&d)));
        }
    }
    for (ns, tokens) in &chains.states {
        assert_eq!(tokens.len() % bs, 0, "states sit on page boundaries");
        let d = *hasher
            .chain(tokens, bs, *ns)
            .last()
            .expect("a state covers tokens");
        assert!(
            set.contains(&(GROUP_KV, external(&d))),
            "a state's KV is cached"
        );
        set.insert((GROUP_STATE, external(&d)));
    }
    set
}

#[test]
fn stream_rebuilds_the_cached_set_after_evictions() {
    for page in [1u32, 4, 16] {
        let mut c = cache(page, 600);
        let mut enc = Encoder::new(EncoderConfig::new(page)).unwrap();
        // An encoder that starts at request 150, its memo of block digests
        // cold: it must hash its way to the same wire events.
        let mut late = Encoder::new(EncoderConfig::new(page)).unwrap();
        let mut view = Mirror::default();
        let (mut removed_kv, mut removed_states) = (0, 0);
        for (i, (ns, input, output)) in requests(7 + u64::from(page), 300).iter().enumerate() {
            c.serve(*ns, input, output).unwrap();
            let events = c.drain_events();
            if i >= 150 {
                assert_eq!(
                    late.translate(&events),
                    enc.translate(&events),
                    "page {page}, request {i}"
                );
            }
            removed_kv += events
                .iter()
                .filter(|e| matches!(e, CacheEvent::KvRemoved { .. }))
                .count();
            removed_states += events
                .iter()
                .filter(|e| matches!(e, CacheEvent::StateRemoved { .. }))
                .count();
            let batch = decode_batch(&enc.encode(i as f64, &events)).unwrap();
            view.apply(&batch.events);
            assert_eq!(
                view.set,
                expected(&c, enc.hasher()),
                "page {page}, after request {i}"
            );
            assert_eq!(view.unknown_removals, 0);
            // The memo holds the digests of the cached blocks, no more.
            let blocks = view.set.iter().filter(|(g, _)| *g == GROUP_KV).count();
            assert_eq!(
                enc.remembered_blocks(),
                blocks,
                "page {page}, after request {i}"
            );
        }
        assert!(
            removed_kv > 20 && removed_states > 20,
            "page {page}: {removed_kv} KV and {removed_states} state removals"
        );
        // A snapshot rebuilds the same set from nothing.
        let mut fresh = Mirror::default();
        fresh.set.insert((GROUP_KV, 12345));
        fresh.apply_wire(&enc.snapshot(&c.cached_chains()));
        assert_eq!(fresh.set, view.set);
    }
}

#[test]
fn events_are_off_by_default_and_start_with_all_cleared() {
    let model = ModelSpec::preset("paper-7b").unwrap();
    let mut off = PrefixCache::new(CacheConfig::marconi(model.clone(), 1 << 40)).unwrap();
    off.serve(0, &[1, 2, 3], &[4]).unwrap();
    assert!(off.drain_events().is_empty());
    let mut cfg = CacheConfig::marconi(model, 1 << 40);
    cfg.events = true;
    let mut on = PrefixCache::new(cfg).unwrap();
    assert_eq!(on.drain_events(), vec![CacheEvent::AllCleared]);
    assert!(on.drain_events().is_empty());
}

#[test]
fn decisions_do_not_depend_on_events() {
    let reqs = requests(3, 200);
    let mut a = cache(4, 500);
    let mut cfg = a.config().clone();
    cfg.events = false;
    let mut b = PrefixCache::new(cfg).unwrap();
    for (ns, input, output) in &reqs {
        assert_eq!(
            a.serve(*ns, input, output).unwrap(),
            b.serve(*ns, input, output).unwrap()
        );
        a.drain_events();
    }
    assert_eq!(a.stats(), b.stats());
    assert_eq!(a.cached_chains(), b.cached_chains());
}

// ---- over ZeroMQ ----------------------------------------------------------

struct Sub {
    sub: zmq::Socket,
    replay: zmq::Socket,
    topic: Vec<u8>,
    next: u64,
    view: Mirror,
    gaps: u64,
}

impl Sub {
    fn new(ctx: &zmq::Context, p: &Publisher, topic: &[u8]) -> Self {
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(topic).unwrap();
        sub.connect(p.endpoint()).unwrap();
        let replay = ctx.socket(zmq::DEALER).unwrap();
        replay.connect(p.replay_endpoint().unwrap()).unwrap();
        Sub {
            sub,
            replay,
            topic: topic.to_vec(),
            next: 0,
            view: Mirror::default(),
            gaps: 0,
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        if seq < self.next {
            return; // already applied (replayed twice)
        }
        assert_eq!(seq, self.next, "applied in order");
        self.view.apply(&decode_batch(payload).unwrap().events);
        self.next = seq + 1;
    }

    /// Asks for everything from `self.next` and applies it.
    fn repair(&mut self) {
        self.gaps += 1;
        self.replay
            .send_multipart([&b""[..], &self.next.to_be_bytes()], 0)
            .unwrap();
        loop {
            assert!(
                self.replay.poll(zmq::POLLIN, 5000).unwrap() > 0,
                "replay answers"
            );
            let f = self.replay.recv_multipart(0).unwrap();
            // DEALER: ["", topic, seq, payload]
            assert_eq!(f.len(), 4);
            if f[3].is_empty() {
                // vLLM 0.33's end marker: ["", "", END_SEQ, ""], the topic
                // frame empty whatever the topic.
                assert_eq!(f[2], END_SEQ);
                assert!(f[1].is_empty(), "end marker topic {:?}", f[1]);
                return;
            }
            assert_eq!(f[1], self.topic);
            let seq = u64::from_be_bytes(f[2].as_slice().try_into().unwrap());
            assert!(seq <= self.next, "the buffer still holds {}", self.next);
            self.apply(seq, &f[3]);
        }
    }

    /// Receives until batch `last` is applied; `drop_every` simulates losses.
    fn run_until(&mut self, last: u64, drop_every: u64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.next <= last {
            assert!(Instant::now() < deadline, "stream stalled at {}", self.next);
            if self.sub.poll(zmq::POLLIN, 200).unwrap() == 0 {
                // Nothing live (the tail was lost): ask for it.
                self.repair();
                continue;
            }
            let f = self.sub.recv_multipart(0).unwrap();
            assert_eq!(f.len(), 3);
            assert_eq!(f[0], self.topic);
            let seq = u64::from_be_bytes(f[1].as_slice().try_into().unwrap());
            if drop_every > 0 && seq % drop_every == 3 {
                continue; // lost
            }
            if seq > self.next {
                self.repair();
            }
            self.apply(seq, &f[2]);
        }
    }
}

#[test]
fn zmq_subscriber_rebuilds_the_set_with_gaps_repaired_by_replay() {
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:*", Some("tcp://127.0.0.1:*"));
    cfg.topic = b"kv@engine-0".to_vec();
    let p = Publisher::new(cfg).unwrap();
    let ctx = zmq::Context::new();
    let mut s = Sub::new(&ctx, &p, b"kv@engine-0");
    // A subscriber on another topic receives nothing.
    let other = ctx.socket(zmq::SUB).unwrap();
    other.set_subscribe(b"kv@engine-1").unwrap();
    other.connect(p.endpoint()).unwrap();

    let mut c = cache(4, 600);
    let mut enc = Encoder::new(EncoderConfig::new(4)).unwrap();
    let mut last = 0;
    // Published at once, before the subscriber's connection is up: the
    // first batches are lost on the PUB side and come back by replay.
    for (i, (ns, input, output)) in requests(11, 250).iter().enumerate() {
        c.serve(*ns, input, output).unwrap();
        last = p.publish(enc.encode(i as f64, &c.drain_events())).unwrap();
    }
    s.run_until(last, 10);
    assert_eq!(s.view.set, expected(&c, enc.hasher()));
    assert!(s.gaps > 0);
    assert!(p.stats().replays > 0);
    assert_eq!(other.poll(zmq::POLLIN, 100).unwrap(), 0);
}

#[test]
fn replay_buffer_is_bounded_and_a_too_old_start_shows() {
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:*", Some("tcp://127.0.0.1:*"));
    cfg.buffer_steps = 5;
    cfg.replay_topic = false; // vLLM before #45177: [seq, payload]
    let p = Publisher::new(cfg).unwrap();
    let mut enc = Encoder::new(EncoderConfig::new(1)).unwrap();
    for i in 0..12 {
        p.publish(enc.encode(f64::from(i), &[])).unwrap();
    }
    let ctx = zmq::Context::new();
    let req = ctx.socket(zmq::DEALER).unwrap();
    req.connect(p.replay_endpoint().unwrap()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let seqs = loop {
        assert!(Instant::now() < deadline);
        req.send_multipart([&b""[..], &0u64.to_be_bytes()], 0)
            .unwrap();
        let mut seqs = Vec::new();
        loop {
            assert!(req.poll(zmq::POLLIN, 5000).unwrap() > 0);
            let f = req.recv_multipart(0).unwrap();
            assert_eq!(f.len(), 3, "['', seq, payload] without the topic");
            if f[2].is_empty() {
                assert_eq!(f[1], END_SEQ);
                break;
            }
            seqs.push(u64::from_be_bytes(f[1].as_slice().try_into().unwrap()));
            decode_batch(&f[2]).unwrap();
        }
        // The publisher thread may not have buffered all 12 yet.
        if seqs.last() == Some(&11) {
            break seqs;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(seqs, vec![7, 8, 9, 10, 11]);
    // A malformed request is ignored; the socket still serves the next one.
    req.send_multipart([&b""[..], &b"bad"[..]], 0).unwrap();
    req.send_multipart([&b""[..], &10u64.to_be_bytes()], 0)
        .unwrap();
    let mut got = Vec::new();
    loop {
        assert!(req.poll(zmq::POLLIN, 5000).unwrap() > 0);
        let f = req.recv_multipart(0).unwrap();
        if f[2].is_empty() {
            break;
        }
        got.push(u64::from_be_bytes(f[1].as_slice().try_into().unwrap()));
    }
    assert_eq!(got, vec![10, 11]);
}

#[test]
fn bad_configurations_are_errors() {
    assert!(Publisher::new(PublisherConfig::new("tcp://127.0.0.1:*", None)).is_ok());
    let mut c = PublisherConfig::new("tcp://127.0.0.1:*", None);
    c.buffer_steps = 0;
    assert!(Publisher::new(c).is_err());
    assert!(Publisher::new(PublisherConfig::new("nonsense://x", None)).is_err());
    assert!(Encoder::new(EncoderConfig::new(0)).is_err());
}

#[test]
fn enabling_events_on_a_warm_cache_replays_its_content() {
    let mut c = cache(4, 600);
    let mut cfg = c.config().clone();
    cfg.events = false;
    let mut warm = PrefixCache::new(cfg).unwrap();
    let reqs = requests(5, 120);
    for (ns, input, output) in &reqs[..80] {
        warm.serve(*ns, input, output).unwrap();
        c.serve(*ns, input, output).unwrap();
    }
    warm.enable_events();
    let mut enc = Encoder::new(EncoderConfig::new(4)).unwrap();
    let mut view = Mirror::default();
    view.set.insert((GROUP_KV, 99)); // stale knowledge, dropped by AllCleared
    view.apply_wire(&enc.translate(&warm.drain_events()));
    assert_eq!(view.set, expected(&warm, enc.hasher()));
    for (ns, input, output) in &reqs[80..] {
        warm.serve(*ns, input, output).unwrap();
        view.apply_wire(&enc.translate(&warm.drain_events()));
        assert_eq!(view.set, expected(&warm, enc.hasher()));
        assert_eq!(view.unknown_removals, 0);
    }
    // Events on from the start or enabled later: the same content.
    for (ns, input, output) in &reqs[80..] {
        c.serve(*ns, input, output).unwrap();
    }
    assert_eq!(c.cached_chains(), warm.cached_chains());
}
