//! The subscriber against a publisher written here from docs/events.md §5
//! alone (PUB `[topic, seq, payload]`, ROUTER replay answering
//! `[id, "", topic, seq, payload]` ... then the end marker), on loopback:
//! a late join and a mid-stream loss are repaired by replay, a replay
//! older than the buffer is not (the engine is forgotten), a topic filters.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use marconi_router::sub::{EngineEndpoint, Subscriber};

fn port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn key(b: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(b, s).expect("vec");
}

/// `[ts, [BlockStored(hashes) (group 0), state on the last (group 1)], 0]`,
/// or a removal of `hashes` when `remove`.
fn payload(hashes: &[u64], remove: bool) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 3).expect("vec");
    rmp::encode::write_f64(&mut b, 1.0).expect("vec");
    rmp::encode::write_array_len(&mut b, if remove { 1 } else { 2 }).expect("vec");
    let n = if remove { 4 } else { 5 };
    rmp::encode::write_map_len(&mut b, n).expect("vec");
    key(&mut b, "type");
    key(
        &mut b,
        if remove {
            "BlockRemoved"
        } else {
            "BlockStored"
        },
    );
    key(&mut b, "block_hashes");
    rmp::encode::write_array_len(&mut b, hashes.len() as u32).expect("vec");
    for &h in hashes {
        rmp::encode::write_uint(&mut b, h).expect("vec");
    }
    if !remove {
        key(&mut b, "block_size");
        rmp::encode::write_uint(&mut b, 4).expect("vec");
    }
    key(&mut b, "medium");
    key(&mut b, "GPU");
    key(&mut b, "group_idx");
    rmp::encode::write_uint(&mut b, 0).expect("vec");
    if !remove {
        rmp::encode::write_map_len(&mut b, 5).expect("vec");
        key(&mut b, "type");
        key(&mut b, "BlockStored");
        key(&mut b, "block_hashes");
        rmp::encode::write_array_len(&mut b, 1).expect("vec");
        rmp::encode::write_uint(&mut b, *hashes.last().expect("one")).expect("vec");
        key(&mut b, "block_size");
        rmp::encode::write_uint(&mut b, 4).expect("vec");
        key(&mut b, "group_idx");
        rmp::encode::write_uint(&mut b, 1).expect("vec");
        key(&mut b, "kv_cache_spec_kind");
        key(&mut b, "mamba");
    }
    rmp::encode::write_uint(&mut b, 0).expect("vec");
    b
}

/// Batches kept for replay: (seq, payload).
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A publisher with vLLM's framing; replay keeps the last `keep` batches.
struct Publisher {
    ctx: zmq::Context,
    events: String,
    replay: String,
    topic: Vec<u8>,
    buffer: Buffer,
    keep: usize,
    pub_sock: zmq::Socket,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    next: u64,
}

impl Publisher {
    fn new(topic: &[u8], keep: usize) -> Publisher {
        let ctx = zmq::Context::new();
        let events = format!("tcp://127.0.0.1:{}", port());
        let replay = format!("tcp://127.0.0.1:{}", port());
        let pub_sock = ctx.socket(zmq::PUB).expect("PUB");
        pub_sock.bind(&events).expect("bind PUB");
        let router = ctx.socket(zmq::ROUTER).expect("ROUTER");
        router.bind(&replay).expect("bind ROUTER");
        router.set_rcvtimeo(20).expect("timeout");
        let buffer: Buffer = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (buf, st, t) = (buffer.clone(), stop.clone(), topic.to_vec());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let Ok(msg) = router.recv_multipart(0) else {
                    continue;
                };
                let [id, empty, start] = msg.as_slice() else {
                    continue;
                };
                assert!(empty.is_empty());
                let start = u64::from_be_bytes(start[..].try_into().expect("8 bytes"));
                for (seq, p) in buf.lock().expect("buffer").iter() {
                    if *seq >= start {
                        let s = seq.to_be_bytes();
                        router
                            .send_multipart([&id[..], b"", &t, &s, p], 0)
                            .expect("reply");
                    }
                }
                router
                    .send_multipart([&id[..], b"", &t, &[0xff; 8], b""], 0)
                    .expect("end");
            }
        });
        Publisher {
            ctx,
            events,
            replay,
            topic: topic.to_vec(),
            buffer,
            keep,
            pub_sock,
            stop,
            thread: Some(thread),
            next: 0,
        }
    }

    fn publish(&mut self, p: Vec<u8>) {
        let seq = self.next;
        self.next += 1;
        self.pub_sock
            .send_multipart([&self.topic[..], &seq.to_be_bytes(), &p], 0)
            .expect("publish");
        let mut b = self.buffer.lock().expect("buffer");
        b.push((seq, p));
        if b.len() > self.keep {
            b.remove(0);
        }
    }

    fn endpoint(&self, name: &str, replay: bool) -> EngineEndpoint {
        EngineEndpoint {
            name: name.into(),
            events: self.events.clone(),
            replay: replay.then(|| self.replay.clone()),
            topic: self.topic.clone(),
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("replay thread");
        }
        let _ = &self.ctx;
    }
}

/// The engine side's truth: blocks 1..=n stored as chains of 3, some removed.
struct Truth {
    blocks: BTreeSet<u64>,
    states: BTreeSet<u64>,
}

fn step(p: &mut Publisher, t: &mut Truth, i: u64) {
    if i % 5 == 4 {
        // Remove the previous chain's last block (its state goes with it).
        let h = 3 * (i - 1) + 3;
        if t.blocks.remove(&h) {
            t.states.remove(&h);
            p.publish(payload(&[h], true));
            return;
        }
    }
    let hs = [3 * i + 1, 3 * i + 2, 3 * i + 3];
    t.blocks.extend(hs);
    t.states.insert(hs[2]);
    p.publish(payload(&hs, false));
}

fn synced(sub: &mut Subscriber, next: &[u64]) -> bool {
    sub.poll_until(Duration::from_secs(20), |s| {
        next.iter()
            .enumerate()
            .all(|(i, &n)| s.feed_stats(s.engine(i).unwrap()).next_seq == n)
    })
    .expect("poll")
}

#[test]
fn gaps_are_repaired_by_replay_or_the_engine_is_forgotten() {
    let mut a = Publisher::new(b"kv@a", 1000);
    let mut b = Publisher::new(b"", 4);
    let (mut ta, mut tb) = (
        Truth {
            blocks: BTreeSet::new(),
            states: BTreeSet::new(),
        },
        Truth {
            blocks: BTreeSet::new(),
            states: BTreeSet::new(),
        },
    );
    // A publishes 20 batches before anyone listens.
    for i in 0..20 {
        step(&mut a, &mut ta, i);
    }
    let eps = [a.endpoint("a", true), b.endpoint("b", true)];
    let mut sub = Subscriber::new(4, &eps, Duration::from_secs(5)).expect("subscriber");
    let (ea, eb) = (sub.engine(0).unwrap(), sub.engine(1).unwrap());
    sub.poll_until(Duration::from_millis(400), |_| false)
        .unwrap();
    // B's first 10 batches are lost on arrival; its replay keeps only 4.
    sub.drop_next_batches(eb, 10);
    sub.drop_next_batches(ea, 3);
    for i in 20..60 {
        step(&mut a, &mut ta, i);
        step(&mut b, &mut tb, i);
    }
    assert!(synced(&mut sub, &[a.next, b.next]), "{sub:?}");
    let sa = sub.feed_stats(ea).clone();
    assert_eq!(sa.unrepaired, 0, "{sa:?}");
    assert!(sa.gaps >= 1 && sa.replayed >= 20, "{sa:?}");
    assert_eq!((sa.malformed, sa.refused, sa.skipped), (0, 0, 0));
    assert_eq!(
        sub.index().engine_blocks(ea),
        ta.blocks.iter().copied().collect::<Vec<_>>()
    );
    assert_eq!(
        sub.index().engine_states(ea),
        ta.states.iter().copied().collect::<Vec<_>>()
    );
    // B: the loss is older than its buffer. Forgotten, then rebuilt from
    // what followed: a subset of the truth, never more.
    let sb = sub.feed_stats(eb).clone();
    assert!(sb.unrepaired >= 1, "{sb:?}");
    let held = sub.index().engine_blocks(eb);
    assert!(!held.is_empty() && held.len() < tb.blocks.len());
    assert!(held.iter().all(|h| tb.blocks.contains(h)));
    // Later batches keep flowing.
    for i in 60..70 {
        step(&mut a, &mut ta, i);
    }
    assert!(synced(&mut sub, &[a.next, b.next]));
    assert_eq!(sub.index().stats(ea).blocks as usize, ta.blocks.len());
}

/// An engine that cannot be added leaves nothing behind (no index slot,
/// no socket): the next one takes the next slot and is fed; a removed
/// engine's slot is taken again.
#[test]
fn a_refused_engine_keeps_nothing_and_a_removed_one_frees_its_slot() {
    let mut p = Publisher::new(b"", 100);
    let mut sub = Subscriber::new(4, &[], Duration::from_secs(1)).expect("subscriber");
    let mut bad = p.endpoint("bad", true);
    for (events, replay) in [
        ("garbage", None),
        ("tcp://127.0.0.1", None),
        ("tcp://127.0.0.1:99999", None),
        (p.events.as_str(), Some("garbage")),
    ] {
        bad.events = events.to_string();
        bad.replay = replay.map(str::to_string);
        assert!(sub.add_engine(&bad).is_err(), "{events} {replay:?}");
        assert_eq!(sub.index().engines(), 0, "{events} {replay:?} took a slot");
    }
    let e = sub.add_engine(&p.endpoint("good", true)).expect("good");
    assert_eq!(e.index(), 0);
    let mut t = Truth {
        blocks: BTreeSet::new(),
        states: BTreeSet::new(),
    };
    // The SUB joins in the background: what is published before is lost
    // to it, and repaired from the next batch's gap.
    sub.poll_until(Duration::from_millis(300), |_| false)
        .expect("poll");
    for i in 0..5 {
        step(&mut p, &mut t, i);
    }
    let mut i = 5;
    while !sub
        .poll_until(Duration::from_millis(500), |s| {
            s.feed_stats(e).next_seq == p.next
        })
        .expect("poll")
    {
        assert!(i < 40, "{sub:?}");
        step(&mut p, &mut t, i);
        i += 1;
    }
    assert_eq!(sub.feed_stats(e).batches, p.next);
    assert_eq!(
        sub.index().engine_blocks(e),
        t.blocks.iter().copied().collect::<Vec<_>>()
    );
    sub.remove_engine(e).expect("remove");
    assert_eq!(sub.index().live_engines(), 0);
    assert_eq!(sub.index().distinct_blocks(), 0);
    assert_eq!(sub.feed_stats(e).batches, 0);
    assert!(sub.remove_engine(e).is_err());
    let again = sub.add_engine(&p.endpoint("again", false)).expect("again");
    assert_eq!(again, e, "the freed slot is taken again");
}
