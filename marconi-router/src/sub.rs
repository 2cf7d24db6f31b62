//! The index fed over ZeroMQ (`docs/events.md` §5): one SUB socket per
//! engine on its PUB endpoint, batches applied in sequence order, gaps
//! detected by sequence number and repaired through the engine's ROUTER
//! replay socket (a DEALER here, so that every reply of a replay arrives).
//!
//! A gap that replay cannot repair (no replay endpoint, the batches are no
//! longer buffered, no answer within the timeout) drops everything the
//! index knew of that engine and goes on from the batch at hand: the index
//! then under-reports that engine until its cache turns over, and never
//! reports blocks the engine may no longer hold. Every such event is
//! counted in [`FeedStats`].
//!
//! The subscriber is driven by the caller ([`Subscriber::poll`]): no
//! thread of its own, the index read between polls.

use std::time::{Duration, Instant};

use crate::index::{EngineId, Index, IndexError};
use crate::wire::{decode_batch, Groups};

/// vLLM's end-of-replay sequence number (`-1` as 8 signed big-endian bytes).
pub const END_SEQ: u64 = u64::MAX;

/// Where one engine publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineEndpoint {
    /// A name for reports.
    pub name: String,
    /// The PUB endpoint to connect to (`tcp://127.0.0.1:5557`).
    pub events: String,
    /// The ROUTER replay endpoint, if the engine has one.
    pub replay: Option<String>,
    /// The topic to subscribe to (a prefix; empty: every topic).
    pub topic: Vec<u8>,
}

/// Per-engine counters of the feed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FeedStats {
    /// Batches applied (live or replayed).
    pub batches: u64,
    /// Batches that arrived through replay and were applied.
    pub replayed: u64,
    /// Gaps seen on the live stream (including the one a late join makes).
    pub gaps: u64,
    /// Gaps replay could not close (the engine was dropped from the index).
    pub unrepaired: u64,
    /// Batches seen twice (ignored by sequence number).
    pub duplicates: u64,
    /// Messages or payloads that could not be decoded (skipped).
    pub malformed: u64,
    /// Events the index refused (out-of-order stream; skipped).
    pub refused: u64,
    /// Events of other groups or unknown types (skipped by the decoder).
    pub skipped: u64,
    /// The next sequence number expected.
    pub next_seq: u64,
}

/// Why the subscriber could not be built or polled.
#[derive(Debug, thiserror::Error)]
pub enum SubError {
    /// A ZeroMQ call failed.
    #[error("zeromq: {what}: {err}")]
    Zmq {
        /// What was being done.
        what: String,
        /// The error.
        err: zmq::Error,
    },
    /// The index refused (too many engines, block size 0).
    #[error(transparent)]
    Index(#[from] IndexError),
}

fn zerr(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> SubError {
    let what = what.into();
    move |err| SubError::Zmq { what, err }
}

struct Conn {
    id: EngineId,
    endpoint: EngineEndpoint,
    sub: zmq::Socket,
    replay: Option<zmq::Socket>,
    groups: Groups,
    stats: FeedStats,
    /// Live batches to drop on arrival (fault injection for tests).
    drop_next: u32,
}

/// An [`Index`] fed by engines' event streams over ZeroMQ.
pub struct Subscriber {
    ctx: zmq::Context,
    conns: Vec<Conn>,
    index: Index,
    replay_timeout: Duration,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("index", &self.index)
            .field(
                "feeds",
                &self.conns.iter().map(|c| &c.stats).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Subscriber {
    /// Connects to every engine (connections complete in the background);
    /// the index expects `block_size`-token blocks. A replay that takes
    /// longer than `replay_timeout` counts as unrepaired.
    pub fn new(
        block_size: u32,
        engines: &[EngineEndpoint],
        replay_timeout: Duration,
    ) -> Result<Self, SubError> {
        let mut sub = Subscriber {
            ctx: zmq::Context::new(),
            conns: Vec::with_capacity(engines.len()),
            index: Index::new(block_size)?,
            replay_timeout,
        };
        for ep in engines {
            sub.add_engine(ep)?;
        }
        Ok(sub)
    }

    /// Connects to one more engine (its id is the next index); its first
    /// batch with a sequence number above 0 is repaired from 0 by replay.
    pub fn add_engine(&mut self, ep: &EngineEndpoint) -> Result<EngineId, SubError> {
        let id = self.index.add_engine(ep.name.clone())?;
        let sub = self.ctx.socket(zmq::SUB).map_err(zerr("SUB socket"))?;
        sub.set_linger(0).map_err(zerr("linger"))?;
        sub.set_rcvhwm(0).map_err(zerr("receive high-water mark"))?;
        sub.set_subscribe(&ep.topic).map_err(zerr("subscribe"))?;
        sub.connect(&ep.events)
            .map_err(zerr(format!("connect {}", ep.events)))?;
        self.conns.push(Conn {
            id,
            endpoint: ep.clone(),
            sub,
            replay: None,
            groups: Groups::default(),
            stats: FeedStats::default(),
            drop_next: 0,
        });
        Ok(id)
    }

    /// Forgets what engine `e` holds (its stream is still read).
    pub fn clear_engine(&mut self, e: EngineId) -> Result<(), IndexError> {
        self.index.clear_engine(e)
    }

    /// The index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Engine `i`'s id in the index (`i` in the order given to `new`).
    pub fn engine(&self, i: usize) -> Result<EngineId, IndexError> {
        self.index.engine(i)
    }

    /// Engine `e`'s feed counters.
    pub fn feed_stats(&self, e: EngineId) -> &FeedStats {
        &self.conns[e.index()].stats
    }

    /// Drops the next `n` live batches of engine `e` on arrival, as a lossy
    /// network would (fault injection: the gap that follows is repaired by
    /// replay like any other).
    pub fn drop_next_batches(&mut self, e: EngineId, n: u32) {
        self.conns[e.index()].drop_next = n;
    }

    /// Waits up to `timeout` for batches, then applies every batch that
    /// arrived (repairing gaps on the way); returns the batches applied.
    pub fn poll(&mut self, timeout: Duration) -> Result<u64, SubError> {
        let before: u64 = self.conns.iter().map(|c| c.stats.batches).sum();
        let ready: Vec<bool> = {
            let mut items: Vec<zmq::PollItem<'_>> = self
                .conns
                .iter()
                .map(|c| c.sub.as_poll_item(zmq::POLLIN))
                .collect();
            let ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
            zmq::poll(&mut items, ms).map_err(zerr("poll"))?;
            items.iter().map(zmq::PollItem::is_readable).collect()
        };
        for (i, r) in ready.into_iter().enumerate() {
            if r {
                self.drain(i)?;
            }
        }
        Ok(self.conns.iter().map(|c| c.stats.batches).sum::<u64>() - before)
    }

    /// Polls until `done(self)` holds or `deadline` passes; true when it held.
    pub fn poll_until(
        &mut self,
        deadline: Duration,
        mut done: impl FnMut(&Subscriber) -> bool,
    ) -> Result<bool, SubError> {
        let end = Instant::now() + deadline;
        while !done(self) {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            self.poll(left.min(Duration::from_millis(50)))?;
        }
        Ok(true)
    }

    /// Every message waiting on engine `i`'s SUB socket.
    fn drain(&mut self, i: usize) -> Result<(), SubError> {
        loop {
            let msg = match self.conns[i].sub.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(zmq::Error::EAGAIN) => return Ok(()),
                Err(e) => return Err(zerr("receive")(e)),
            };
            let c = &mut self.conns[i];
            let (seq, payload) = match msg.as_slice() {
                [_topic, seq, payload] if seq.len() == 8 => (
                    u64::from_be_bytes(seq[..].try_into().expect("8 bytes")),
                    payload,
                ),
                _ => {
                    c.stats.malformed += 1;
                    continue;
                }
            };
            if c.drop_next > 0 {
                c.drop_next -= 1;
                continue;
            }
            if seq < c.stats.next_seq {
                c.stats.duplicates += 1;
                continue;
            }
            if seq > c.stats.next_seq {
                c.stats.gaps += 1;
                self.repair(i, seq)?;
            }
            let c = &mut self.conns[i];
            if seq < c.stats.next_seq {
                // The replay brought it already.
                c.stats.duplicates += 1;
                continue;
            }
            if seq > c.stats.next_seq {
                // Not repaired: forget the engine, go on from here.
                c.stats.unrepaired += 1;
                self.index.clear_engine(c.id)?;
                c.stats.next_seq = seq;
            }
            let payload = payload.clone();
            self.apply(i, seq, &payload, false)?;
        }
    }

    /// Applies the batch `seq` of engine `i` (the next expected).
    fn apply(
        &mut self,
        i: usize,
        seq: u64,
        payload: &[u8],
        replayed: bool,
    ) -> Result<(), SubError> {
        let c = &mut self.conns[i];
        debug_assert_eq!(seq, c.stats.next_seq);
        c.stats.next_seq = seq.saturating_add(1);
        match decode_batch(payload, &mut c.groups) {
            Ok(batch) => {
                c.stats.batches += 1;
                c.stats.replayed += u64::from(replayed);
                c.stats.skipped += u64::from(batch.skipped);
                for ev in &batch.events {
                    if self.index.apply(c.id, ev).is_err() {
                        c.stats.refused += 1;
                    }
                }
            }
            Err(_) => c.stats.malformed += 1,
        }
        Ok(())
    }

    /// Asks engine `i`'s replay socket for the batches from the next
    /// expected one, applying those before `upto` in order.
    fn repair(&mut self, i: usize, upto: u64) -> Result<(), SubError> {
        let Some(ep) = self.conns[i].endpoint.replay.clone() else {
            return Ok(());
        };
        if self.conns[i].replay.is_none() {
            let s = self
                .ctx
                .socket(zmq::DEALER)
                .map_err(zerr("DEALER socket"))?;
            s.set_linger(0).map_err(zerr("linger"))?;
            s.connect(&ep).map_err(zerr(format!("connect {ep}")))?;
            self.conns[i].replay = Some(s);
        }
        let start = self.conns[i].stats.next_seq;
        let sock = self.conns[i].replay.as_ref().expect("just set");
        sock.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
            .map_err(zerr("replay request"))?;
        let end = Instant::now() + self.replay_timeout;
        let mut finished = false;
        while !finished {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let sock = self.conns[i].replay.as_ref().expect("set above");
            let mut items = [sock.as_poll_item(zmq::POLLIN)];
            let ms = i64::try_from(left.as_millis().max(1)).unwrap_or(i64::MAX);
            zmq::poll(&mut items, ms).map_err(zerr("poll replay"))?;
            if !items[0].is_readable() {
                continue;
            }
            let msg = sock.recv_multipart(0).map_err(zerr("replay receive"))?;
            // DEALER: [empty delimiter, (topic,) seq, payload].
            let (seq, payload) = match msg.as_slice() {
                [d, _, seq, payload] | [d, seq, payload] if d.is_empty() && seq.len() == 8 => (
                    u64::from_be_bytes(seq[..].try_into().expect("8 bytes")),
                    payload,
                ),
                _ => {
                    self.conns[i].stats.malformed += 1;
                    continue;
                }
            };
            if seq == END_SEQ {
                finished = true;
                continue;
            }
            let next = self.conns[i].stats.next_seq;
            if seq < next {
                continue;
            }
            if seq > next {
                // The batches before `seq` are no longer buffered.
                continue;
            }
            if seq < upto {
                let payload = payload.clone();
                self.apply(i, seq, &payload, true)?;
            }
        }
        if !finished {
            // Late replies must not be read as the answer to a later request.
            self.conns[i].replay = None;
        }
        Ok(())
    }
}
