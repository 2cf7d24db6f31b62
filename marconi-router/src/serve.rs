//! `marconi-router serve`: the HTTP API of NVIDIA Dynamo's standalone KV
//! indexer (`python -m dynamo.indexer`, Dynamo 1.6.1: `/register`,
//! `/unregister`, `/query`, `/query_by_hash`, `/dump`, `/workers`,
//! `/health`; the same request and response JSON, status codes and content
//! types, differences listed in docs/routing.md) over this crate's index,
//! answering with resumable depth: a worker's score is capped at its
//! deepest recurrent state within the KV match (the semantics Dynamo's
//! design proposal for hybrid models, DEP 12169, gives its indexer), so an
//! operator swaps one process for the other.
//!
//! How it runs ([`Server`]):
//!
//! - HTTP/1.1 by hyper (axum's router and JSON extractors, so malformed
//!   bodies, content types and methods are refused as Dynamo refuses them)
//!   on a tokio runtime: every connection is its own task, `TCP_NODELAY`
//!   on every accepted socket, a deadline for each request's headers
//!   ([`ServeConfig::header_timeout`]) and for its body
//!   ([`ServeConfig::body_timeout`], then 408), bodies up to 64 MiB (then
//!   413), at most [`ServeConfig::max_connections`] connections at once.
//! - One thread per index (`(model_name, routing_group)`, as Dynamo keeps
//!   one radix tree per pair) owns that index's ZeroMQ subscriptions and
//!   applies their batches ([`Subscriber`]); it never waits on an HTTP
//!   client. Queries read the index under its lock, taken for one index
//!   walk (requests are hashed before), so a slow or stalled client holds
//!   nothing.
//! - Registration is all or nothing: endpoints are checked up front
//!   ([`check_endpoint`]), connected before the worker takes an index slot,
//!   and nothing is kept when any step fails. Unregistering frees the slot.
//!   A worker whose replay fails is forgotten by its index (it
//!   under-reports until its cache turns over); nothing a worker sends ends
//!   the service.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Query as QueryParams, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Deserializer};
use serde_json::{json, Map, Value};

use crate::hash::{ChainHasher, RequestKeys, DEFAULT_SEED};
use crate::index::{BlockHash, EngineId, Index, Overlap};
use crate::sub::{check_endpoint, EngineEndpoint, FeedStats, Subscriber};

/// Largest request body read (a query of 16 M tokens fits); past it, 413.
pub const MAX_BODY: usize = 64 << 20;

/// How a [`Server`] hashes, repairs and bounds its clients.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The engines' `NONE_HASH` seed.
    pub seed: String,
    /// How long a gap replay may take before it counts as unrepaired.
    pub replay_timeout: Duration,
    /// How long a client may take to send a request's headers before its
    /// connection is closed; the clock starts when the server waits for
    /// them, so an idle kept-open connection is closed after as long.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body before it is
    /// answered 408 and its connection closed.
    pub body_timeout: Duration,
    /// Connections served at once; one more is closed on accept.
    pub max_connections: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            seed: DEFAULT_SEED.into(),
            replay_timeout: Duration::from_secs(2),
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// `/register`'s body (Dynamo's fields; `additional_salt` and `tenant_id`
/// are accepted and ignored, as Dynamo does).
#[derive(Clone, Debug, Deserialize)]
pub struct Register {
    /// Worker instance.
    pub instance_id: u64,
    /// Its ZeroMQ PUB endpoint.
    pub endpoint: String,
    /// Model (selects the index).
    pub model_name: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Worker pool within the model.
    #[serde(default = "default_group")]
    pub routing_group: String,
    /// Data-parallel rank (`null` or omitted: 0, as Dynamo reads it).
    #[serde(default, deserialize_with = "null_zero")]
    pub dp_rank: u32,
    /// Its ZeroMQ ROUTER endpoint for gap replay.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Ignored (Dynamo parses it for forward compatibility).
    #[serde(default, alias = "additionalsalt")]
    pub additional_salt: Option<String>,
    /// Ignored (Dynamo accepts and ignores it).
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// The worker's model has no recurrent layers (marconi-router's own
    /// field; default false): every KV block it holds is resumable, so its
    /// score is its KV match. A hybrid worker's score is capped at its
    /// deepest state.
    #[serde(default)]
    pub attention_only: bool,
}

/// `/query`'s body.
#[derive(Clone, Debug, Deserialize)]
pub struct Query {
    /// The request's tokens.
    pub token_ids: Vec<u32>,
    /// Model.
    pub model_name: String,
    /// Worker pool.
    #[serde(default = "default_group")]
    pub routing_group: String,
    /// Ignored, as Dynamo does.
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// LoRA adapter (hashed with an empty path, libmarconi's LoRA form).
    #[serde(default)]
    pub lora_name: Option<String>,
    /// The request's cache salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// `/query_by_hash`'s body.
#[derive(Clone, Debug, Deserialize)]
pub struct QueryByHash {
    /// The request's block hashes: the engines' (vLLM's) chained hashes as
    /// they travel in events, as unsigned or as signed (two's complement)
    /// 64-bit integers.
    #[serde(deserialize_with = "hashes")]
    pub block_hashes: Vec<BlockHash>,
    /// Model.
    pub model_name: String,
    /// Worker pool.
    #[serde(default = "default_group")]
    pub routing_group: String,
    /// Ignored, as Dynamo does.
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// Refused when present (400), as Dynamo does: hashes carry their salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// `/unregister`'s body.
#[derive(Clone, Debug, Deserialize)]
pub struct Unregister {
    /// Worker instance.
    pub instance_id: u64,
    /// Model.
    pub model_name: String,
    /// Worker pool (omitted: every pool of the model, every rank).
    #[serde(default)]
    pub routing_group: Option<String>,
    /// Ignored, as Dynamo does.
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// One rank of the pool given (omitted: every rank). Without
    /// `routing_group` it is ignored, as Dynamo ignores it.
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

/// `GET /workers` filters.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct WorkersFilter {
    /// Only this model's workers.
    #[serde(default)]
    pub model_name: Option<String>,
    /// Only this pool's workers.
    #[serde(default)]
    pub routing_group: Option<String>,
}

fn null_zero<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    Ok(Option::<u32>::deserialize(d)?.unwrap_or(0))
}

fn default_group() -> String {
    "default".into()
}

fn hashes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BlockHash>, D::Error> {
    struct H(BlockHash);
    impl<'de> Deserialize<'de> for H {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl serde::de::Visitor<'_> for V {
                type Value = H;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a 64-bit integer")
                }
                fn visit_u64<E>(self, v: u64) -> Result<H, E> {
                    Ok(H(v))
                }
                fn visit_i64<E>(self, v: i64) -> Result<H, E> {
                    Ok(H(v as u64))
                }
            }
            d.deserialize_any(V)
        }
    }
    Ok(Vec::<H>::deserialize(d)?.into_iter().map(|h| h.0).collect())
}

type GroupKey = (String, String);

#[derive(Clone, Debug)]
struct Worker {
    instance_id: u64,
    dp_rank: u32,
    endpoint: String,
    engine: EngineId,
    /// No recurrent layers: scored by its KV match.
    attention_only: bool,
}

enum Cmd {
    Add(EngineEndpoint, mpsc::SyncSender<Result<EngineId, String>>),
    Remove(Vec<EngineId>, mpsc::SyncSender<()>),
}

/// One index, its workers, and the thread feeding it.
struct Group {
    block_size: u32,
    hasher: ChainHasher,
    index: Arc<RwLock<Index>>,
    workers: Vec<Worker>,
    /// Feed counters by engine slot, as the feed thread last copied them.
    stats: Arc<Mutex<Vec<FeedStats>>>,
    cmds: mpsc::Sender<Cmd>,
    thread: Option<JoinHandle<()>>,
}

impl Group {
    fn new(key: &GroupKey, block_size: u32, cfg: &ServeConfig) -> Result<Group, String> {
        let sub =
            Subscriber::new(block_size, &[], cfg.replay_timeout).map_err(|e| e.to_string())?;
        let index = sub.shared_index();
        let stats: Arc<Mutex<Vec<FeedStats>>> = Arc::default();
        let (tx, rx) = mpsc::channel();
        let st = Arc::clone(&stats);
        let thread = std::thread::Builder::new()
            .name(format!("feed {}:{}", key.0, key.1))
            .spawn(move || feed(sub, &rx, &st))
            .map_err(|e| format!("feed thread: {e}"))?;
        Ok(Group {
            block_size,
            hasher: ChainHasher::new(&cfg.seed, block_size),
            index,
            workers: Vec::new(),
            stats,
            cmds: tx,
            thread: Some(thread),
        })
    }

    fn stats(&self, e: EngineId) -> FeedStats {
        lock(&self.stats)
            .get(e.index())
            .cloned()
            .unwrap_or_default()
    }
}

/// The feed thread of one index: applies its workers' batches, adds and
/// removes workers on command, until the group is dropped.
fn feed(mut sub: Subscriber, cmds: &mpsc::Receiver<Cmd>, stats: &Mutex<Vec<FeedStats>>) {
    // How long a command may wait for the poll to return.
    const TICK: Duration = Duration::from_millis(10);
    loop {
        loop {
            match cmds.try_recv() {
                Ok(Cmd::Add(ep, reply)) => {
                    let _ = reply.send(sub.add_engine(&ep).map_err(|e| e.to_string()));
                }
                Ok(Cmd::Remove(engines, reply)) => {
                    for e in engines {
                        let _ = sub.remove_engine(e);
                    }
                    let _ = reply.send(());
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        if sub.poll(TICK).is_err() {
            // zmq_poll itself failed (never seen): retry after a pause.
            std::thread::sleep(TICK);
        }
        let slots = sub.index().engines();
        let mut st = lock(stats);
        st.clear();
        st.extend((0..slots).map(|i| match sub.engine(i) {
            Ok(e) => sub.feed_stats(e).clone(),
            Err(_) => FeedStats::default(),
        }));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

struct Shared {
    cfg: ServeConfig,
    groups: RwLock<BTreeMap<GroupKey, Group>>,
    /// Serializes registrations and unregistrations (never queries).
    admin: tokio::sync::Mutex<()>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let groups = std::mem::take(&mut *write(&self.groups));
        for (_, mut g) in groups {
            let t = g.thread.take();
            drop(g);
            if let Some(t) = t {
                let _ = t.join();
            }
        }
    }
}

type Reply = (StatusCode, Value);

fn error(status: StatusCode, msg: impl Into<String>) -> Reply {
    (status, json!({ "error": msg.into() }))
}

fn no_index(model: &str, group: &str) -> Reply {
    error(
        StatusCode::NOT_FOUND,
        format!("no indexer for model={model} routing_group={group}"),
    )
}

async fn register(sh: &Shared, r: Register) -> Reply {
    if let Err(e) = check_endpoint(&r.endpoint) {
        return error(StatusCode::BAD_REQUEST, e.to_string());
    }
    if let Some(Err(e)) = r.replay_endpoint.as_deref().map(check_endpoint) {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "invalid replay endpoint `{}`: {e}",
                r.replay_endpoint.as_deref().unwrap_or_default()
            ),
        );
    }
    if r.block_size == 0 {
        return error(StatusCode::BAD_REQUEST, "block_size must be > 0");
    }
    let _admin = sh.admin.lock().await;
    let key = (r.model_name.clone(), r.routing_group.clone());
    let (cmds, created) = {
        let mut groups = write(&sh.groups);
        let created = !groups.contains_key(&key);
        if created {
            match Group::new(&key, r.block_size, &sh.cfg) {
                Ok(g) => {
                    groups.insert(key.clone(), g);
                }
                Err(e) => return error(StatusCode::BAD_REQUEST, e),
            }
        }
        let g = groups.get(&key).expect("present");
        if g.block_size != r.block_size {
            return error(
                StatusCode::CONFLICT,
                format!(
                    "block_size mismatch for model={} routing_group={}: existing={}, requested={}",
                    r.model_name, r.routing_group, g.block_size, r.block_size
                ),
            );
        }
        if g.workers
            .iter()
            .any(|w| w.instance_id == r.instance_id && w.dp_rank == r.dp_rank)
        {
            return error(
                StatusCode::CONFLICT,
                format!(
                    "instance {} dp_rank {} already registered",
                    r.instance_id, r.dp_rank
                ),
            );
        }
        (g.cmds.clone(), created)
    };
    let ep = EngineEndpoint {
        name: format!("{}:{}", r.instance_id, r.dp_rank),
        events: r.endpoint.clone(),
        replay: r.replay_endpoint.clone(),
        topic: Vec::new(),
    };
    let added = command(&cmds, |tx| Cmd::Add(ep, tx))
        .await
        .unwrap_or_else(|| Err("the index's feed has stopped".into()));
    let mut groups = write(&sh.groups);
    match added {
        Ok(engine) => {
            if let Some(g) = groups.get_mut(&key) {
                g.workers.push(Worker {
                    instance_id: r.instance_id,
                    dp_rank: r.dp_rank,
                    endpoint: r.endpoint,
                    engine,
                    attention_only: r.attention_only,
                });
            }
            (StatusCode::CREATED, json!({"status": "ok"}))
        }
        Err(e) => {
            if created {
                groups.remove(&key);
            }
            error(StatusCode::BAD_REQUEST, e)
        }
    }
}

/// Sends a command to a feed thread and waits for its answer off the
/// runtime's threads; `None` when the thread is gone.
async fn command<T: Send + 'static>(
    cmds: &mpsc::Sender<Cmd>,
    make: impl FnOnce(mpsc::SyncSender<T>) -> Cmd,
) -> Option<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    cmds.send(make(tx)).ok()?;
    tokio::task::spawn_blocking(move || rx.recv().ok())
        .await
        .ok()
        .flatten()
}

async fn unregister(sh: &Shared, u: Unregister) -> Reply {
    let _admin = sh.admin.lock().await;
    let mut removed: Vec<(GroupKey, mpsc::Sender<Cmd>, Vec<EngineId>)> = Vec::new();
    {
        let mut groups = write(&sh.groups);
        for (key, g) in groups.iter_mut() {
            if key.0 != u.model_name {
                continue;
            }
            let rank = match &u.routing_group {
                Some(rg) if *rg != key.1 => continue,
                Some(_) => u.dp_rank,
                None => None,
            };
            let (gone, kept): (Vec<Worker>, Vec<Worker>) = g.workers.drain(..).partition(|w| {
                w.instance_id == u.instance_id && rank.is_none_or(|r| r == w.dp_rank)
            });
            g.workers = kept;
            if !gone.is_empty() {
                removed.push((
                    key.clone(),
                    g.cmds.clone(),
                    gone.iter().map(|w| w.engine).collect(),
                ));
            }
        }
    }
    if removed.is_empty() {
        return error(
            StatusCode::NOT_FOUND,
            format!("instance {} not found", u.instance_id),
        );
    }
    for (key, cmds, engines) in removed {
        // The slots are free once the feed thread has dropped them.
        let _ = command(&cmds, |tx| Cmd::Remove(engines, tx)).await;
        let mut groups = write(&sh.groups);
        if groups.get(&key).is_some_and(|g| g.workers.is_empty()) {
            // As Dynamo: the last worker gone, the index goes (queries 404).
            groups.remove(&key);
        }
    }
    (StatusCode::OK, json!({"status": "ok"}))
}

/// Scores of a request already hashed, in Dynamo's `/query` shape: only
/// workers that score are listed (`scores`, `instances`); `kv_scores`
/// (marconi's) lists each worker's KV match where it is not 0.
fn score(sh: &Shared, key: &GroupKey, hashes: &[BlockHash], input_len: usize) -> Reply {
    let groups = read(&sh.groups);
    let Some(g) = groups.get(key) else {
        return no_index(&key.0, &key.1);
    };
    let mut out: Vec<Overlap> = Vec::new();
    read(&g.index).overlap_hashes(hashes, input_len, &mut out);
    let (mut scores, mut kv_scores, mut instances) = (Map::new(), Map::new(), Map::new());
    for w in &g.workers {
        let o = out.get(w.engine.index()).copied().unwrap_or_default();
        let id = w.instance_id.to_string();
        let rank = w.dp_rank.to_string();
        let score = if w.attention_only {
            o.kv_matched_tokens
        } else {
            o.resumable_tokens
        };
        if o.kv_matched_tokens > 0 {
            entry(&mut kv_scores, &id).insert(rank.clone(), json!(o.kv_matched_tokens));
        }
        if score == 0 {
            continue;
        }
        entry(&mut scores, &id).insert(rank.clone(), json!(score));
        let inst = instances.entry(id).or_insert_with(
            || json!({"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}),
        );
        // One tier (device): the lower tiers' counts are cumulative, so
        // equal to the device's.
        let best = inst["gpu"].as_u64().unwrap_or(0).max(u64::from(score));
        for k in ["longest_matched", "gpu", "cpu", "disk"] {
            inst[k] = json!(best);
        }
        inst["dp"][rank] = json!(score);
    }
    (
        StatusCode::OK,
        json!({
            "scores": scores,
            "frequencies": [],
            "instances": instances,
            "kv_scores": kv_scores,
        }),
    )
}

fn group_of(sh: &Shared, model: &str, group: &str) -> Result<(GroupKey, ChainHasher, u32), Reply> {
    let key = (model.to_string(), group.to_string());
    let groups = read(&sh.groups);
    match groups.get(&key) {
        Some(g) => Ok((key, g.hasher.clone(), g.block_size)),
        None => Err(no_index(model, group)),
    }
}

fn query(sh: &Shared, q: &Query) -> Reply {
    let (key, hasher, _) = match group_of(sh, &q.model_name, &q.routing_group) {
        Ok(g) => g,
        Err(r) => return r,
    };
    // Hashed before any lock: the index is locked for its walk only.
    let keys = RequestKeys {
        lora: q.lora_name.clone().map(|n| (n, String::new())),
        cache_salt: q.cache_salt.clone(),
    };
    let mut h: Vec<BlockHash> = Vec::new();
    hasher.wire_hashes_keyed(&q.token_ids, &keys, &mut h);
    score(sh, &key, &h, q.token_ids.len())
}

fn query_by_hash(sh: &Shared, q: &QueryByHash) -> Reply {
    if q.cache_salt.is_some() {
        return error(
            StatusCode::BAD_REQUEST,
            "cache_salt is not accepted by /query_by_hash; block_hashes must already include the intended cache salt",
        );
    }
    let (key, _, block_size) = match group_of(sh, &q.model_name, &q.routing_group) {
        Ok(g) => g,
        Err(r) => return r,
    };
    // The request is at least one token past its last block.
    let len = q
        .block_hashes
        .len()
        .saturating_mul(block_size as usize)
        .saturating_add(1);
    score(sh, &key, &q.block_hashes, len)
}

/// Every index's content, keyed `model:group` as Dynamo's `/dump`: one
/// stored event per worker with its blocks (`block_hash` only: the index
/// keeps no tokens) and, a marconi extension, its states.
fn dump(sh: &Shared) -> Reply {
    let mut all = Map::new();
    let groups = read(&sh.groups);
    for ((model, group), g) in groups.iter() {
        let by_engine = read(&g.index).blocks_by_engine();
        let mut events = Vec::new();
        for w in &g.workers {
            let Some((blocks, states)) = by_engine.get(w.engine.index()) else {
                continue;
            };
            let blocks: Vec<Value> = blocks.iter().map(|h| json!({"block_hash": h})).collect();
            events.push(json!({
                "worker_id": w.instance_id,
                "storage_tier": "device",
                "event": {"event_id": 0, "data": {"stored": {
                    "parent_hash": null, "start_position": null, "blocks": blocks}},
                    "dp_rank": w.dp_rank},
                "states": states,
            }));
        }
        all.insert(
            format!("{model}:{group}"),
            json!({"block_size": g.block_size, "events": events}),
        );
    }
    (StatusCode::OK, Value::Object(all))
}

/// Registered workers, Dynamo's `/workers` shape (plus each listener's feed
/// counters).
fn workers(sh: &Shared, f: &WorkersFilter) -> Reply {
    let mut out = Vec::new();
    let groups = read(&sh.groups);
    for ((model, group), g) in groups.iter() {
        if f.model_name.as_ref().is_some_and(|m| m != model)
            || f.routing_group.as_ref().is_some_and(|r| r != group)
        {
            continue;
        }
        // instance -> (endpoints by rank, listeners by rank)
        let mut by_id: BTreeMap<u64, (JsonMap, JsonMap)> = BTreeMap::new();
        for w in &g.workers {
            let e = by_id.entry(w.instance_id).or_default();
            e.0.insert(w.dp_rank.to_string(), json!(w.endpoint));
            let st = g.stats(w.engine);
            e.1.insert(
                w.dp_rank.to_string(),
                json!({"endpoint": w.endpoint, "status": "active",
                       "batches": st.batches, "gaps": st.gaps, "unrepaired": st.unrepaired}),
            );
        }
        for (id, (endpoints, listeners)) in by_id {
            out.push(json!({
                "instance_id": id, "source": "zmq", "status": "active",
                "model_name": model, "routing_group": group, "block_size": g.block_size,
                "endpoints": endpoints, "listeners": listeners,
            }));
        }
    }
    (StatusCode::OK, Value::Array(out))
}

type JsonMap = Map<String, Value>;

fn entry<'a>(m: &'a mut Map<String, Value>, k: &str) -> &'a mut Map<String, Value> {
    m.entry(k.to_string())
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
        .expect("inserted as an object")
}

type St = State<Arc<Shared>>;

fn reply((status, body): Reply) -> Response {
    (status, Json(body)).into_response()
}

/// Runs `f` off the runtime's threads (hashing a long request, walking a
/// large index): the connections of other clients go on meanwhile.
async fn blocking(sh: Arc<Shared>, f: impl FnOnce(&Shared) -> Reply + Send + 'static) -> Response {
    match tokio::task::spawn_blocking(move || f(&sh)).await {
        Ok(r) => reply(r),
        Err(e) => reply(error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
    }
}

/// Reads the whole body before the handler runs, within the body deadline
/// and [`MAX_BODY`].
async fn read_body(State(sh): St, req: Request, next: Next) -> Response {
    let too_large = || {
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "request body over 64 MiB",
        )
            .into_response()
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(sh.cfg.body_timeout, axum::body::to_bytes(body, MAX_BODY)).await {
        Err(_) => {
            let mut r = (
                StatusCode::REQUEST_TIMEOUT,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "request body not received in time",
            )
                .into_response();
            r.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            r
        }
        Ok(Err(e)) => {
            let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(s) = src {
                if s.is::<http_body_util::LengthLimitError>() {
                    return too_large();
                }
                src = s.source();
            }
            (
                StatusCode::BAD_REQUEST,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                format!("Failed to read the request body: {e}"),
            )
                .into_response()
        }
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    }
}

fn router(sh: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route(
            "/register",
            post(|State(sh): St, Json(r): Json<Register>| async move { reply(register(&sh, r).await) }),
        )
        .route(
            "/unregister",
            post(|State(sh): St, Json(u): Json<Unregister>| async move {
                reply(unregister(&sh, u).await)
            }),
        )
        .route(
            "/query",
            post(|State(sh): St, Json(q): Json<Query>| async move {
                blocking(sh, move |sh| query(sh, &q)).await
            }),
        )
        .route(
            "/query_by_hash",
            post(|State(sh): St, Json(q): Json<QueryByHash>| async move {
                blocking(sh, move |sh| query_by_hash(sh, &q)).await
            }),
        )
        .route(
            "/dump",
            get(|State(sh): St| async move { blocking(sh, dump).await }),
        )
        .route(
            "/workers",
            get(|State(sh): St, QueryParams(f): QueryParams<WorkersFilter>| async move {
                reply(workers(&sh, &f))
            }),
        )
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(Arc::clone(&sh), read_body))
        .with_state(sh)
}

/// `marconi-router serve` running: its HTTP listener on a tokio runtime and
/// one feed thread per index. Dropping it (or [`Server::stop`]) closes
/// every connection and subscription.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Listens on `addr` (`127.0.0.1:8090`; port 0 for any) and serves
    /// until dropped.
    pub fn bind(addr: &str, cfg: ServeConfig) -> io::Result<Server> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(
                std::thread::available_parallelism()
                    .map_or(2, |n| n.get())
                    .clamp(2, 8),
            )
            .thread_name("marconi-router-http")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
        let local = listener.local_addr()?;
        let shared = Arc::new(Shared {
            cfg,
            groups: RwLock::new(BTreeMap::new()),
            admin: tokio::sync::Mutex::new(()),
        });
        let (tx, rx) = tokio::sync::oneshot::channel();
        let app = router(Arc::clone(&shared));
        let stop = Arc::new(AtomicBool::new(false));
        rt.spawn(accept(listener, app, shared.cfg.clone(), rx));
        Ok(Server {
            addr: local,
            shared,
            stop,
            shutdown: Some(tx),
            rt: Some(rt),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Registers a worker as `POST /register` does: the status and JSON
    /// body it would answer.
    pub fn register(&self, r: Register) -> (u16, Value) {
        let rt = self.rt.as_ref().expect("running");
        let (s, v) = rt.block_on(register(&self.shared, r));
        (s.as_u16(), v)
    }

    /// Blocks the calling thread until [`Server::stop`] is called from
    /// another (the binary serves forever).
    pub fn wait(&self) {
        while !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops serving: the listener, every connection, every feed thread.
    pub fn stop(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
        let groups = std::mem::take(&mut *write(&self.shared.groups));
        for (_, mut g) in groups {
            let t = g.thread.take();
            drop(g);
            if let Some(t) = t {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shut();
    }
}

async fn accept(
    listener: tokio::net::TcpListener,
    app: Router,
    cfg: ServeConfig,
    mut shutdown: tokio::sync::oneshot::Receiver<()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections.max(1)));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut shutdown => return,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(_) => {
                // Out of descriptors, or a connection reset before accept:
                // pause, never stop listening.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            drop(stream);
            continue;
        };
        // Each answer leaves at once, not after the peer's delayed ACK.
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let header_timeout = cfg.header_timeout;
        tokio::spawn(async move {
            let _permit = permit;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc);
            let _ = conn.await;
        });
    }
}
