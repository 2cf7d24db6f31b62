//! A publisher with vLLM's `ZmqEventPublisher` framing (docs/events.md §5):
//! PUB `[topic, seq, payload]`, a ROUTER that replays buffered batches from
//! a sequence number, then an end marker.
//!
//! The sockets live on one background thread (ZeroMQ sockets are not
//! thread-safe); [`Publisher::publish`] hands a payload to it through an
//! inproc PUSH/PULL pair with a bounded queue and never blocks: on a full
//! queue the batch is dropped and its sequence number skipped, so
//! subscribers see the loss as a gap.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// vLLM's end-of-replay sequence: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// What a [`Publisher`] is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublisherConfig {
    /// PUB endpoint: bound when it contains `*` or `::` or is `ipc://` /
    /// `inproc://` (vLLM's rule), connected otherwise.
    pub endpoint: String,
    /// ROUTER endpoint for replay (bound); `None` for no replay.
    pub replay_endpoint: Option<String>,
    /// Topic frame (may be empty).
    pub topic: Vec<u8>,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    /// PUB high-water mark (vLLM's `hwm`).
    pub hwm: i32,
    /// Batches waiting for the publisher thread before `publish` drops
    /// (vLLM's `max_queue_size`).
    pub max_queue: i32,
    /// Whether replay replies carry the topic frame (vLLM after PR #45177).
    pub replay_topic: bool,
}

impl PublisherConfig {
    /// vLLM's defaults on `endpoint` and `replay_endpoint`.
    pub fn new(endpoint: &str, replay_endpoint: Option<&str>) -> Self {
        PublisherConfig {
            endpoint: endpoint.into(),
            replay_endpoint: replay_endpoint.map(Into::into),
            topic: Vec::new(),
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue: 100_000,
            replay_topic: true,
        }
    }
}

/// Why a publisher could not be built or a batch not be queued.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A bad configuration value.
    #[error("invalid publisher configuration: {0}")]
    Config(String),
    /// A ZeroMQ call failed (bind, connect, ...).
    #[error("zeromq: {what}: {err}")]
    Zmq {
        /// What was being done.
        what: String,
        /// The ZeroMQ error.
        err: zmq::Error,
    },
    /// The queue to the publisher thread is full; the batch was dropped
    /// (its sequence number is skipped).
    #[error("publisher queue full: batch {0} dropped")]
    QueueFull(u64),
    /// The publisher thread is gone.
    #[error("publisher stopped")]
    Stopped,
}

fn zerr(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> PublishError {
    let what = what.into();
    move |err| PublishError::Zmq { what, err }
}

/// Counters of a publisher.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Batches queued by `publish`.
    pub queued: u64,
    /// Batches dropped on a full queue.
    pub dropped: u64,
    /// Replay requests served.
    pub replays: u64,
}

#[derive(Default)]
struct Shared {
    replays: AtomicU64,
}

/// The publisher: see the module documentation.
pub struct Publisher {
    push: Mutex<zmq::Socket>,
    next_seq: AtomicU64,
    dropped: AtomicU64,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    inproc: String,
    endpoint: String,
    replay_endpoint: Option<String>,
}

fn last_endpoint(s: &zmq::Socket) -> Option<String> {
    s.get_last_endpoint().ok().and_then(Result::ok)
}

static INSTANCE: AtomicU64 = AtomicU64::new(0);

fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

impl Publisher {
    /// Binds (or connects) the sockets and starts the publisher thread.
    pub fn new(cfg: PublisherConfig) -> Result<Self, PublishError> {
        if cfg.buffer_steps == 0 {
            return Err(PublishError::Config("buffer_steps is 0".into()));
        }
        if cfg.hwm < 0 || cfg.max_queue <= 0 {
            return Err(PublishError::Config(format!(
                "hwm {} must be >= 0 and max_queue {} > 0",
                cfg.hwm, cfg.max_queue
            )));
        }
        let ctx = zmq::Context::new();
        let pub_sock = ctx.socket(zmq::PUB).map_err(zerr("PUB socket"))?;
        pub_sock.set_sndhwm(cfg.hwm).map_err(zerr("PUB hwm"))?;
        pub_sock.set_linger(0).map_err(zerr("PUB linger"))?;
        if binds(&cfg.endpoint) {
            pub_sock
                .bind(&cfg.endpoint)
                .map_err(zerr(format!("bind {}", cfg.endpoint)))?;
        } else {
            pub_sock
                .connect(&cfg.endpoint)
                .map_err(zerr(format!("connect {}", cfg.endpoint)))?;
        }
        let endpoint = last_endpoint(&pub_sock).unwrap_or_else(|| cfg.endpoint.clone());
        let router = match &cfg.replay_endpoint {
            Some(ep) => {
                let r = ctx.socket(zmq::ROUTER).map_err(zerr("ROUTER socket"))?;
                r.set_linger(0).map_err(zerr("ROUTER linger"))?;
                r.bind(ep).map_err(zerr(format!("bind {ep}")))?;
                Some(r)
            }
            None => None,
        };
        let replay_endpoint = router.as_ref().map(|r| {
            last_endpoint(r).unwrap_or_else(|| cfg.replay_endpoint.clone().unwrap_or_default())
        });
        let inproc = format!(
            "inproc://marconi-events-{}-{}",
            std::process::id(),
            INSTANCE.fetch_add(1, Ordering::Relaxed)
        );
        let pull = ctx.socket(zmq::PULL).map_err(zerr("PULL socket"))?;
        pull.set_rcvhwm(cfg.max_queue).map_err(zerr("PULL hwm"))?;
        pull.bind(&inproc).map_err(zerr("bind inproc"))?;
        let push = ctx.socket(zmq::PUSH).map_err(zerr("PUSH socket"))?;
        push.set_sndhwm(cfg.max_queue).map_err(zerr("PUSH hwm"))?;
        push.set_linger(0).map_err(zerr("PUSH linger"))?;
        push.connect(&inproc).map_err(zerr("connect inproc"))?;

        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared::default());
        let worker = Worker {
            pub_sock,
            router,
            pull,
            buffer: VecDeque::with_capacity(cfg.buffer_steps.min(4096)),
            cfg,
            stop: Arc::clone(&stop),
            shared: Arc::clone(&shared),
            _ctx: ctx,
        };
        let thread = std::thread::Builder::new()
            .name("marconi-events".into())
            .spawn(move || worker.run())
            .map_err(|e| PublishError::Config(format!("cannot spawn the publisher thread: {e}")))?;
        Ok(Publisher {
            push: Mutex::new(push),
            next_seq: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            stop,
            shared,
            thread: Some(thread),
            inproc,
            endpoint,
            replay_endpoint,
        })
    }

    /// Queues one encoded batch; returns its sequence number. Never blocks:
    /// on a full queue the batch is dropped, its number skipped, and
    /// [`PublishError::QueueFull`] returned.
    pub fn publish(&self, payload: Vec<u8>) -> Result<u64, PublishError> {
        let push = match self.push.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        // The number is taken under the lock so queue order is seq order.
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let res = push.send_multipart([seq.to_be_bytes().to_vec(), payload], zmq::DONTWAIT);
        match res {
            Ok(()) => Ok(seq),
            Err(zmq::Error::EAGAIN) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                Err(PublishError::QueueFull(seq))
            }
            Err(zmq::Error::ETERM) => Err(PublishError::Stopped),
            Err(err) => Err(PublishError::Zmq {
                what: "queue a batch".into(),
                err,
            }),
        }
    }

    /// Counters.
    pub fn stats(&self) -> PublisherStats {
        let next = self.next_seq.load(Ordering::Relaxed);
        let dropped = self.dropped.load(Ordering::Relaxed);
        PublisherStats {
            queued: next - dropped,
            dropped,
            replays: self.shared.replays.load(Ordering::Relaxed),
        }
    }

    /// The sequence number the next batch gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq.load(Ordering::Relaxed)
    }

    /// The PUB endpoint as bound or connected (a `*` port resolved).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The ROUTER endpoint as bound (a `*` port resolved), if replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The inproc endpoint of the queue (diagnostics).
    pub fn queue_endpoint(&self) -> &str {
        &self.inproc
    }
}

impl Drop for Publisher {
    /// Sends what is queued, then stops the thread (within about 50 ms of
    /// the queue running empty) and closes the sockets without lingering.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Worker {
    pub_sock: zmq::Socket,
    router: Option<zmq::Socket>,
    pull: zmq::Socket,
    buffer: VecDeque<(u64, Vec<u8>)>,
    cfg: PublisherConfig,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    // Dropped last: the sockets above close first.
    _ctx: zmq::Context,
}

impl Worker {
    fn run(mut self) {
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            let (pull_ready, router_ready) = {
                let mut items = vec![self.pull.as_poll_item(zmq::POLLIN)];
                if let Some(r) = &self.router {
                    items.push(r.as_poll_item(zmq::POLLIN));
                }
                let timeout = if stopping { 0 } else { 50 };
                match zmq::poll(&mut items, timeout) {
                    Ok(_) => (
                        items[0].is_readable(),
                        items.get(1).is_some_and(|i| i.is_readable()),
                    ),
                    Err(zmq::Error::EINTR) => continue,
                    Err(_) => return,
                }
            };
            if router_ready {
                self.serve_replays();
            }
            if pull_ready {
                self.forward_queued();
            }
            if stopping && !pull_ready {
                return;
            }
        }
    }

    /// Publishes every queued batch and keeps it for replay.
    fn forward_queued(&mut self) {
        while let Ok(frames) = self.pull.recv_multipart(zmq::DONTWAIT) {
            let [seq, payload]: [Vec<u8>; 2] = match frames.try_into() {
                Ok(f) => f,
                Err(_) => continue,
            };
            let Ok(seq_bytes) = <[u8; 8]>::try_from(seq.as_slice()) else {
                continue;
            };
            // PUB never blocks: past the high-water mark it drops, and the
            // subscriber sees a gap it repairs by replay.
            let _ = self.pub_sock.send_multipart(
                [self.cfg.topic.as_slice(), &seq_bytes, payload.as_slice()],
                zmq::DONTWAIT,
            );
            if self.buffer.len() == self.cfg.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer
                .push_back((u64::from_be_bytes(seq_bytes), payload));
        }
    }

    /// Answers every waiting replay request.
    fn serve_replays(&mut self) {
        let Some(router) = &self.router else { return };
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            // [identity, "", start seq]; anything else is ignored (vLLM too).
            if frames.len() != 3 || !frames[1].is_empty() {
                continue;
            }
            let Ok(start) = <[u8; 8]>::try_from(frames[2].as_slice()) else {
                continue;
            };
            let start = u64::from_be_bytes(start);
            let id = frames[0].as_slice();
            let topic = self.cfg.topic.as_slice();
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let seq = seq.to_be_bytes();
                let r = if self.cfg.replay_topic {
                    router.send_multipart([id, b"", topic, &seq, payload], zmq::DONTWAIT)
                } else {
                    router.send_multipart([id, b"", &seq, payload], zmq::DONTWAIT)
                };
                if r.is_err() {
                    break; // peer gone or over its high-water mark
                }
            }
            // vLLM 0.33 sends the end marker with an empty topic frame.
            let _ = if self.cfg.replay_topic {
                router.send_multipart([id, b"", b"", &END_SEQ, b""], zmq::DONTWAIT)
            } else {
                router.send_multipart([id, b"", &END_SEQ, b""], zmq::DONTWAIT)
            };
            self.shared.replays.fetch_add(1, Ordering::Relaxed);
        }
    }
}
