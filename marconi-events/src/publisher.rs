//! A publisher with vLLM's `ZmqEventPublisher` framing (docs/events.md §5):
//! PUB `[topic, seq, payload]`, a ROUTER that replays buffered batches from
//! a sequence number, then an end marker.
//!
//! ZeroMQ is spoken by the pure-Rust [`zeromq`] crate (ZMTP 3, interoperable
//! with libzmq, pyzmq and the ZeroMQ stacks routers use), so the library
//! links no C++ runtime. The sockets live on one background thread running
//! a single-threaded tokio runtime; [`Publisher::publish`] hands a payload
//! to it through a bounded queue and never blocks: on a full queue the
//! batch is dropped and its sequence number skipped, so subscribers see the
//! loss as a gap. PUB itself drops for a subscriber that does not keep up
//! (the gap is repaired by replay).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's end-of-replay sequence: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// How long one replay reply may wait for a peer that does not read.
const REPLY_TIMEOUT: Duration = Duration::from_secs(1);

/// What a [`Publisher`] is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublisherConfig {
    /// PUB endpoint: bound when it contains `*` or `::` or is `ipc://`
    /// (vLLM's rule), connected otherwise. A `*` port binds a free port.
    pub endpoint: String,
    /// ROUTER endpoint for replay (bound); `None` for no replay.
    pub replay_endpoint: Option<String>,
    /// Topic frame (may be empty).
    pub topic: Vec<u8>,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    /// vLLM's `hwm`: checked (>= 0) and kept for configuration
    /// compatibility; the pure-Rust PUB bounds each subscriber's queue
    /// itself and drops past it.
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
    /// A ZeroMQ operation failed (bind, connect, ...).
    #[error("zeromq: {what}: {err}")]
    Zmq {
        /// What was being done.
        what: String,
        /// The error.
        err: String,
    },
    /// The queue to the publisher thread is full; the batch was dropped
    /// (its sequence number is skipped).
    #[error("publisher queue full: batch {0} dropped")]
    QueueFull(u64),
    /// The publisher thread is gone.
    #[error("publisher stopped")]
    Stopped,
}

fn zerr<E: std::fmt::Display>(what: impl Into<String>) -> impl FnOnce(E) -> PublishError {
    let what = what.into();
    move |err| PublishError::Zmq {
        what,
        err: err.to_string(),
    }
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

type Batch = (u64, Vec<u8>);

/// The publisher: see the module documentation.
pub struct Publisher {
    /// `None` once dropping (the thread then drains the queue and stops).
    tx: Mutex<Option<mpsc::Sender<Batch>>>,
    next_seq: AtomicU64,
    dropped: AtomicU64,
    replays: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: Option<String>,
}

/// vLLM's rule: bind, or connect.
fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// libzmq's wildcards in the form the `zeromq` crate binds: `tcp://*:p`
/// (every interface) and `tcp://host:*` (a free port).
fn bind_form(endpoint: &str) -> String {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return endpoint.to_string();
    };
    let (host, port) = rest.rsplit_once(':').unwrap_or((rest, "*"));
    let host = if host == "*" { "0.0.0.0" } else { host };
    let port = if port == "*" { "0" } else { port };
    format!("tcp://{host}:{port}")
}

struct Sockets {
    pub_sock: PubSocket,
    router: Option<RouterSocket>,
    endpoint: String,
    replay_endpoint: Option<String>,
}

async fn open(cfg: &PublisherConfig) -> Result<Sockets, PublishError> {
    if cfg.endpoint.starts_with("inproc://") {
        return Err(PublishError::Config(
            "inproc:// endpoints are not supported (tcp:// or ipc://)".into(),
        ));
    }
    let mut pub_sock = PubSocket::new();
    let endpoint = if binds(&cfg.endpoint) {
        let ep = bind_form(&cfg.endpoint);
        pub_sock
            .bind(&ep)
            .await
            .map_err(zerr(format!("bind {}", cfg.endpoint)))?
            .to_string()
    } else {
        pub_sock
            .connect(&cfg.endpoint)
            .await
            .map_err(zerr(format!("connect {}", cfg.endpoint)))?;
        cfg.endpoint.clone()
    };
    let (router, replay_endpoint) = match &cfg.replay_endpoint {
        Some(ep) => {
            let mut r = RouterSocket::new();
            let bound = r
                .bind(&bind_form(ep))
                .await
                .map_err(zerr(format!("bind {ep}")))?;
            (Some(r), Some(bound.to_string()))
        }
        None => (None, None),
    };
    Ok(Sockets {
        pub_sock,
        router,
        endpoint,
        replay_endpoint,
    })
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
        let (tx, rx) = mpsc::channel::<Batch>(cfg.max_queue as usize);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let replays = Arc::new(AtomicU64::new(0));
        let worker_replays = Arc::clone(&replays);
        let thread = std::thread::Builder::new()
            .name("marconi-events".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(zerr("tokio runtime")(e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let s = match open(&cfg).await {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok((s.endpoint.clone(), s.replay_endpoint.clone())));
                    Worker {
                        pub_sock: s.pub_sock,
                        router: s.router,
                        buffer: VecDeque::with_capacity(cfg.buffer_steps.min(4096)),
                        cfg,
                        replays: worker_replays,
                    }
                    .run(rx)
                    .await;
                });
            })
            .map_err(|e| PublishError::Config(format!("cannot spawn the publisher thread: {e}")))?;
        let (endpoint, replay_endpoint) = match ready_rx.recv() {
            Ok(Ok(eps)) => eps,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(PublishError::Stopped);
            }
        };
        Ok(Publisher {
            tx: Mutex::new(Some(tx)),
            next_seq: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            replays,
            thread: Some(thread),
            endpoint,
            replay_endpoint,
        })
    }

    /// Queues one encoded batch; returns its sequence number. Never blocks:
    /// on a full queue the batch is dropped, its number skipped, and
    /// [`PublishError::QueueFull`] returned.
    pub fn publish(&self, payload: Vec<u8>) -> Result<u64, PublishError> {
        let tx = match self.tx.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let Some(tx) = tx.as_ref() else {
            return Err(PublishError::Stopped);
        };
        // The number is taken under the lock so queue order is seq order.
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        match tx.try_send((seq, payload)) {
            Ok(()) => Ok(seq),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                Err(PublishError::QueueFull(seq))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(PublishError::Stopped),
        }
    }

    /// Counters.
    pub fn stats(&self) -> PublisherStats {
        let next = self.next_seq.load(Ordering::Relaxed);
        let dropped = self.dropped.load(Ordering::Relaxed);
        PublisherStats {
            queued: next - dropped,
            dropped,
            replays: self.replays.load(Ordering::Relaxed),
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
}

impl Drop for Publisher {
    /// Sends what is queued, then stops the thread and closes the sockets.
    fn drop(&mut self) {
        match self.tx.lock() {
            Ok(mut g) => drop(g.take()),
            Err(p) => drop(p.into_inner().take()),
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Worker {
    pub_sock: PubSocket,
    router: Option<RouterSocket>,
    buffer: VecDeque<Batch>,
    cfg: PublisherConfig,
    replays: Arc<AtomicU64>,
}

/// The next replay request, or never without a ROUTER.
async fn next_request(router: &mut Option<RouterSocket>) -> Option<ZmqMessage> {
    match router {
        Some(r) => r.recv().await.ok(),
        None => std::future::pending().await,
    }
}

fn message(frames: Vec<Vec<u8>>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(
        frames
            .into_iter()
            .map(Into::into)
            .collect::<Vec<bytes::Bytes>>(),
    )
    .ok()
}

impl Worker {
    /// Until the queue closes and runs empty: publishes queued batches,
    /// keeping them for replay, and answers replay requests.
    async fn run(mut self, mut rx: mpsc::Receiver<Batch>) {
        loop {
            tokio::select! {
                batch = rx.recv() => match batch {
                    Some((seq, payload)) => self.forward(seq, payload).await,
                    None => break,
                },
                Some(req) = next_request(&mut self.router) => self.serve_replay(req).await,
            }
        }
        let _ = self.pub_sock.close().await;
        if let Some(r) = self.router.take() {
            let _ = r.close().await;
        }
    }

    /// Publishes one batch and keeps it for replay.
    async fn forward(&mut self, seq: u64, payload: Vec<u8>) {
        let frames = vec![
            self.cfg.topic.clone(),
            seq.to_be_bytes().to_vec(),
            payload.clone(),
        ];
        if let Some(m) = message(frames) {
            // PUB never waits on a subscriber: past its queue it drops,
            // and the subscriber sees a gap it repairs by replay.
            let _ = self.pub_sock.send(m).await;
        }
        if self.buffer.len() == self.cfg.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    /// Answers one replay request `[identity, "", start seq]` (anything
    /// else is ignored, as vLLM does): the buffered batches from `start`,
    /// then vLLM 0.33's end marker with an empty topic frame.
    async fn serve_replay(&mut self, req: ZmqMessage) {
        let frames = req.into_vec();
        if frames.len() != 3 || !frames[1].is_empty() {
            return;
        }
        let Ok(start) = <[u8; 8]>::try_from(&frames[2][..]) else {
            return;
        };
        let start = u64::from_be_bytes(start);
        let id = frames[0].to_vec();
        let Some(router) = self.router.as_mut() else {
            return;
        };
        let topic = self.cfg.topic.clone();
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let mut f = vec![id.clone(), Vec::new()];
            if self.cfg.replay_topic {
                f.push(topic.clone());
            }
            f.push(seq.to_be_bytes().to_vec());
            f.push(payload.clone());
            let Some(m) = message(f) else { return };
            match tokio::time::timeout(REPLY_TIMEOUT, router.send(m)).await {
                Ok(Ok(())) => {}
                _ => return, // peer gone or not reading
            }
        }
        let mut f = vec![id, Vec::new()];
        if self.cfg.replay_topic {
            f.push(Vec::new());
        }
        f.push(END_SEQ.to_vec());
        f.push(Vec::new());
        if let Some(m) = message(f) {
            let _ = tokio::time::timeout(REPLY_TIMEOUT, router.send(m)).await;
        }
        self.replays.fetch_add(1, Ordering::Relaxed);
    }
}
