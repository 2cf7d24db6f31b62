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
//! A repair never holds up the other engines: the replay request is sent,
//! the engine's live batches are held back while its replies arrive (on the
//! same [`Subscriber::poll`] as every stream), and the held batches are
//! applied once the replay ends or times out. An engine whose replay fails
//! in any way (refused, silent, cut short) is forgotten as above; nothing
//! an engine sends ends the subscriber.
//!
//! The subscriber is driven by the caller ([`Subscriber::poll`]): no
//! thread of its own. The index sits behind a lock taken for one batch at
//! a time, so another thread may query it ([`Subscriber::shared_index`])
//! while this one polls.

use std::collections::VecDeque;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::index::{EngineId, Index, IndexError};
use crate::wire::{decode_batch, Groups};

/// vLLM's end-of-replay sequence number (`-1` as 8 signed big-endian bytes).
pub const END_SEQ: u64 = u64::MAX;

/// Live batches of one engine held back while its replay runs; past this
/// the replay is given up (the engine is forgotten) and they are applied.
const MAX_HELD: usize = 65_536;

/// Live messages read from one engine per poll.
const DRAIN_BUDGET: usize = 1024;
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
    /// An endpoint that ZeroMQ cannot connect to.
    #[error("invalid ZMQ endpoint `{endpoint}`: {why}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
}

/// Checks an endpoint as NVIDIA Dynamo's indexer does before it connects
/// (`tcp://host:port` with a port that fits 16 bits, `ipc://` or
/// `inproc://`; anything else, `"garbage"` included, is refused), so that a
/// registration fails before anything is kept.
pub fn check_endpoint(endpoint: &str) -> Result<(), SubError> {
    let bad = |why: &str| {
        Err(SubError::Endpoint {
            endpoint: endpoint.to_string(),
            why: why.to_string(),
        })
    };
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return bad("missing scheme");
    };
    match scheme {
        "tcp" => {
            let Some((host, port)) = rest.rsplit_once(':') else {
                return bad("missing TCP port");
            };
            if host.is_empty() {
                return bad("missing TCP host");
            }
            if let Err(e) = port.parse::<u16>() {
                return bad(&format!("invalid TCP port: {e}"));
            }
            Ok(())
        }
        "ipc" | "inproc" if !rest.is_empty() => Ok(()),
        "ipc" | "inproc" => bad("missing path"),
        other => bad(&format!("unsupported scheme `{other}`")),
    }
}

fn zerr(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> SubError {
    let what = what.into();
    move |err| SubError::Zmq { what, err }
}

struct Conn {
    id: EngineId,
    endpoint: EngineEndpoint,
    sub: zmq::Socket,
    /// The DEALER on the replay endpoint (none: gaps are not repaired).
    replay: Option<zmq::Socket>,
    /// The replay under way, if any.
    repair: Option<Repair>,
    groups: Groups,
    stats: FeedStats,
    /// Live batches to drop on arrival (fault injection for tests).
    drop_next: u32,
}

/// A replay request sent and not yet answered in full.
struct Repair {
    deadline: Instant,
    /// Live batches that arrived since (the first one made the gap).
    held: VecDeque<(u64, Vec<u8>)>,
}

/// Counters of an engine no longer subscribed.
const NO_STATS: FeedStats = FeedStats {
    batches: 0,
    replayed: 0,
    gaps: 0,
    unrepaired: 0,
    duplicates: 0,
    malformed: 0,
    refused: 0,
    skipped: 0,
    next_seq: 0,
};

/// An [`Index`] fed by engines' event streams over ZeroMQ.
pub struct Subscriber {
    ctx: zmq::Context,
    /// By engine slot; `None` for a removed engine.
    conns: Vec<Option<Conn>>,
    index: Arc<RwLock<Index>>,
    replay_timeout: Duration,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("index", &*self.index())
            .field(
                "feeds",
                &self
                    .conns
                    .iter()
                    .flatten()
                    .map(|c| &c.stats)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn socket(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    endpoint: &str,
) -> Result<zmq::Socket, SubError> {
    let s = ctx.socket(kind).map_err(zerr("socket"))?;
    s.set_linger(0).map_err(zerr("linger"))?;
    if kind == zmq::SUB {
        s.set_rcvhwm(0).map_err(zerr("receive high-water mark"))?;
    }
    s.connect(endpoint)
        .map_err(zerr(format!("connect {endpoint}")))?;
    Ok(s)
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
            index: Arc::new(RwLock::new(Index::new(block_size)?)),
            replay_timeout,
        };
        for ep in engines {
            sub.add_engine(ep)?;
        }
        Ok(sub)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Index> {
        // A panic elsewhere while holding the lock leaves a consistent
        // index (every method completes or changes nothing): go on.
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Connects to one more engine, in the lowest free slot of the index;
    /// its first batch with a sequence number above 0 is repaired from 0 by
    /// replay. Both endpoints are checked ([`check_endpoint`]) and
    /// connected before the engine takes a slot: when this fails, nothing
    /// is kept.
    pub fn add_engine(&mut self, ep: &EngineEndpoint) -> Result<EngineId, SubError> {
        check_endpoint(&ep.events)?;
        if let Some(r) = &ep.replay {
            check_endpoint(r)?;
        }
        let sub = socket(&self.ctx, zmq::SUB, &ep.events)?;
        sub.set_subscribe(&ep.topic).map_err(zerr("subscribe"))?;
        let replay = match &ep.replay {
            Some(r) => Some(socket(&self.ctx, zmq::DEALER, r)?),
            None => None,
        };
        let id = self.write().add_engine(ep.name.clone())?;
        let conn = Conn {
            id,
            endpoint: ep.clone(),
            sub,
            replay,
            repair: None,
            groups: Groups::default(),
            stats: FeedStats::default(),
            drop_next: 0,
        };
        if self.conns.len() <= id.index() {
            self.conns.resize_with(id.index() + 1, || None);
        }
        self.conns[id.index()] = Some(conn);
        Ok(id)
    }

    /// Disconnects engine `e` and frees its slot: what it held leaves the
    /// index, and the next [`Subscriber::add_engine`] may take the slot.
    pub fn remove_engine(&mut self, e: EngineId) -> Result<(), IndexError> {
        match self.conns.get_mut(e.index()) {
            Some(c @ Some(_)) => {
                *c = None;
                self.write().remove_engine(e)
            }
            _ => Err(IndexError::UnknownEngine(e.index())),
        }
    }

    /// Forgets what engine `e` holds (its stream is still read).
    pub fn clear_engine(&mut self, e: EngineId) -> Result<(), IndexError> {
        self.write().clear_engine(e)
    }

    /// The index, read-locked (drop the guard before polling again).
    pub fn index(&self) -> RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The index, for another thread to query while this one polls: each
    /// batch is applied under its write lock, so a reader sees whole
    /// batches.
    pub fn shared_index(&self) -> Arc<RwLock<Index>> {
        Arc::clone(&self.index)
    }

    /// Engine `i`'s id in the index (`i` in the order given to `new`).
    pub fn engine(&self, i: usize) -> Result<EngineId, IndexError> {
        self.index().engine(i)
    }

    /// Engine `e`'s feed counters (all zero for an engine not subscribed).
    pub fn feed_stats(&self, e: EngineId) -> &FeedStats {
        match self.conns.get(e.index()) {
            Some(Some(c)) => &c.stats,
            _ => &NO_STATS,
        }
    }

    /// Drops the next `n` live batches of engine `e` on arrival, as a lossy
    /// network would (fault injection: the gap that follows is repaired by
    /// replay like any other).
    pub fn drop_next_batches(&mut self, e: EngineId, n: u32) {
        if let Some(Some(c)) = self.conns.get_mut(e.index()) {
            c.drop_next = n;
        }
    }

    /// Waits up to `timeout` for batches or replay replies, then applies
    /// every batch that arrived (a gap starts a replay; a replay that ended
    /// or timed out releases its engine's held batches); returns the
    /// batches applied. Errs only when ZeroMQ's poll itself fails.
    pub fn poll(&mut self, timeout: Duration) -> Result<u64, SubError> {
        let before = self.total_batches();
        let now = Instant::now();
        let wait = self
            .conns
            .iter()
            .flatten()
            .filter_map(|c| c.repair.as_ref())
            .map(|r| r.deadline.saturating_duration_since(now))
            .fold(timeout, Duration::min);
        // (slot, is the replay socket) per poll item.
        let mut which: Vec<(usize, bool)> = Vec::new();
        let ready: Vec<(usize, bool)> = {
            let mut items: Vec<zmq::PollItem<'_>> = Vec::new();
            for (i, c) in self.conns.iter().enumerate() {
                let Some(c) = c else { continue };
                items.push(c.sub.as_poll_item(zmq::POLLIN));
                which.push((i, false));
                if let (Some(_), Some(r)) = (&c.repair, &c.replay) {
                    items.push(r.as_poll_item(zmq::POLLIN));
                    which.push((i, true));
                }
            }
            let ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
            match zmq::poll(&mut items, ms) {
                Ok(_) => {}
                Err(zmq::Error::EINTR) => return Ok(0),
                Err(e) => return Err(zerr("poll")(e)),
            }
            items
                .iter()
                .zip(&which)
                .filter(|(it, _)| it.is_readable())
                .map(|(_, w)| *w)
                .collect()
        };
        for (i, is_replay) in ready {
            if is_replay {
                self.read_replay(i);
            } else {
                self.drain(i);
            }
        }
        let now = Instant::now();
        for i in 0..self.conns.len() {
            let late = matches!(&self.conns[i], Some(c) if c.repair.as_ref().is_some_and(|r| r.deadline <= now));
            if late {
                self.finish_repair(i, true);
            }
        }
        Ok(self.total_batches() - before)
    }

    fn total_batches(&self) -> u64 {
        self.conns.iter().flatten().map(|c| c.stats.batches).sum()
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

    fn conn(&mut self, i: usize) -> &mut Conn {
        self.conns[i]
            .as_mut()
            .expect("a polled engine is subscribed")
    }

    /// The messages waiting on engine `i`'s SUB socket, at most
    /// [`DRAIN_BUDGET`] (the rest at the next poll, after the other
    /// engines': one fast publisher does not starve the others).
    fn drain(&mut self, i: usize) {
        for _ in 0..DRAIN_BUDGET {
            let c = self.conn(i);
            let msg = match c.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                // EAGAIN: drained. Anything else: the socket is unusable
                // for now; try again at the next poll.
                Err(_) => return,
            };
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
            if let Some(r) = &mut c.repair {
                if r.held.back().is_some_and(|(last, _)| seq <= *last) || seq < c.stats.next_seq {
                    c.stats.duplicates += 1;
                    continue;
                }
                r.held.push_back((seq, payload.clone()));
                if r.held.len() >= MAX_HELD {
                    self.finish_repair(i, true);
                }
                continue;
            }
            if seq < c.stats.next_seq {
                c.stats.duplicates += 1;
                continue;
            }
            if seq > c.stats.next_seq {
                c.stats.gaps += 1;
                let mut held = VecDeque::new();
                held.push_back((seq, payload.clone()));
                if !self.start_repair(i, held) {
                    self.release_held(i, VecDeque::from([(seq, payload.clone())]));
                }
                continue;
            }
            let payload = payload.clone();
            self.apply(i, seq, &payload, false);
        }
    }

    /// Asks engine `i`'s replay socket for the batches from the next
    /// expected one; false when it has none or the request cannot be sent.
    fn start_repair(&mut self, i: usize, held: VecDeque<(u64, Vec<u8>)>) -> bool {
        let timeout = self.replay_timeout;
        let c = self.conn(i);
        let Some(sock) = &c.replay else {
            return false;
        };
        let start = c.stats.next_seq;
        if sock
            .send_multipart([&b""[..], &start.to_be_bytes()[..]], zmq::DONTWAIT)
            .is_err()
        {
            return false;
        }
        c.repair = Some(Repair {
            deadline: Instant::now() + timeout,
            held,
        });
        true
    }

    /// Every reply waiting on engine `i`'s replay socket.
    fn read_replay(&mut self, i: usize) {
        loop {
            let c = self.conn(i);
            if c.repair.is_none() {
                return;
            }
            let Some(sock) = &c.replay else { return };
            let msg = match sock.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(_) => return,
            };
            // DEALER: [empty delimiter, (topic,) seq, payload].
            let (seq, payload) = match msg.as_slice() {
                [d, _, seq, payload] | [d, seq, payload] if d.is_empty() && seq.len() == 8 => (
                    u64::from_be_bytes(seq[..].try_into().expect("8 bytes")),
                    payload,
                ),
                _ => {
                    c.stats.malformed += 1;
                    continue;
                }
            };
            if seq == END_SEQ {
                self.finish_repair(i, false);
                return;
            }
            let upto = c
                .repair
                .as_ref()
                .and_then(|r| r.held.front())
                .map_or(u64::MAX, |(s, _)| *s);
            // Below the next expected: already applied; above it: the
            // batches before are no longer buffered (the held batches
            // will show the gap); past the held ones: not needed.
            if seq == c.stats.next_seq && seq < upto {
                let payload = payload.clone();
                self.apply(i, seq, &payload, true);
            }
        }
    }

    /// Ends engine `i`'s replay (its end marker came, or `timed_out`) and
    /// applies the batches held meanwhile.
    fn finish_repair(&mut self, i: usize, timed_out: bool) {
        let c = self.conn(i);
        let Some(r) = c.repair.take() else { return };
        if timed_out {
            // Late replies must not be read as the answer to a later
            // request: a fresh socket (none if it cannot connect).
            let ctx = self.ctx.clone();
            let c = self.conn(i);
            c.replay = c
                .endpoint
                .replay
                .as_deref()
                .and_then(|ep| socket(&ctx, zmq::DEALER, ep).ok());
        }
        self.release_held(i, r.held);
    }

    /// Applies held batches in order; the first gap left among them is
    /// unrepaired (engine forgotten), a later one starts another replay.
    fn release_held(&mut self, i: usize, mut held: VecDeque<(u64, Vec<u8>)>) {
        let mut first = true;
        while let Some((seq, payload)) = held.pop_front() {
            let c = self.conn(i);
            if seq < c.stats.next_seq {
                c.stats.duplicates += 1;
                continue;
            }
            if seq > c.stats.next_seq {
                if !first {
                    c.stats.gaps += 1;
                    held.push_front((seq, payload));
                    if self.start_repair(i, held.clone()) {
                        return;
                    }
                    let (seq, payload) = held.pop_front().expect("pushed above");
                    self.forget(i, seq);
                    self.apply(i, seq, &payload, false);
                    first = false;
                    continue;
                }
                self.forget(i, seq);
            }
            first = false;
            self.apply(i, seq, &payload, false);
        }
    }

    /// A gap before `seq` that replay did not close: forget the engine and
    /// go on from `seq`.
    fn forget(&mut self, i: usize, seq: u64) {
        let id = self.conn(i).id;
        let c = self.conn(i);
        c.stats.unrepaired += 1;
        c.stats.next_seq = seq;
        let _ = self.write().clear_engine(id);
    }

    /// Applies the batch `seq` of engine `i` (the next expected).
    fn apply(&mut self, i: usize, seq: u64, payload: &[u8], replayed: bool) {
        let index = Arc::clone(&self.index);
        let c = self.conn(i);
        debug_assert_eq!(seq, c.stats.next_seq);
        c.stats.next_seq = seq.saturating_add(1);
        match decode_batch(payload, &mut c.groups) {
            Ok(batch) => {
                c.stats.batches += 1;
                c.stats.replayed += u64::from(replayed);
                c.stats.skipped += u64::from(batch.skipped);
                let mut ix = index.write().unwrap_or_else(|e| e.into_inner());
                for ev in &batch.events {
                    if ix.apply(c.id, ev).is_err() {
                        c.stats.refused += 1;
                    }
                }
            }
            Err(_) => c.stats.malformed += 1,
        }
    }
}
