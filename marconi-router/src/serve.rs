//! `marconi-router serve`: the HTTP API of NVIDIA Dynamo's standalone KV
//! indexer (`python -m dynamo.indexer`, Dynamo 1.6.1: `/register`,
//! `/unregister`, `/query`, `/query_by_hash`, `/dump`, `/workers`,
//! `/health`; the same request and response JSON) over this crate's index,
//! answering with resumable depth: a worker's score is capped at its
//! deepest recurrent state within the KV match (the semantics Dynamo's
//! design proposal for hybrid models, DEP 12169, gives its indexer), so an
//! operator swaps one process for the other.
//!
//! One [`Subscriber`] per `(model_name, routing_group)`, as Dynamo keeps one
//! radix tree per pair; one thread serves HTTP and polls the streams in
//! turn ([`Service::run`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::hash::{ChainHasher, RequestKeys, DEFAULT_SEED};
use crate::index::{BlockHash, EngineId, Overlap};
use crate::sub::{EngineEndpoint, SubError, Subscriber};

/// Largest request body read (a query of 16 M tokens fits).
const MAX_BODY: u64 = 64 << 20;

/// How a [`Service`] hashes and repairs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The engines' `NONE_HASH` seed.
    pub seed: String,
    /// How long a gap replay may take before it counts as unrepaired.
    pub replay_timeout: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            seed: DEFAULT_SEED.into(),
            replay_timeout: Duration::from_secs(2),
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
    /// Data-parallel rank.
    #[serde(default)]
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

/// `/query`'s and `/query_by_hash`'s body.
#[derive(Clone, Debug, Deserialize)]
pub struct Query {
    /// The request's tokens (`/query`).
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    /// Its block hashes (`/query_by_hash`).
    #[serde(default)]
    pub block_hashes: Option<Vec<u64>>,
    /// Model.
    pub model_name: String,
    /// Worker pool.
    #[serde(default = "default_group")]
    pub routing_group: String,
    /// LoRA adapter (hashed with an empty path, libmarconi's LoRA form).
    #[serde(default)]
    pub lora_name: Option<String>,
    /// The request's cache salt.
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
    /// Worker pool (omitted: every pool of the model).
    #[serde(default)]
    pub routing_group: Option<String>,
    /// One rank (omitted: all).
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

fn default_group() -> String {
    "default".into()
}

struct Worker {
    instance_id: u64,
    dp_rank: u32,
    endpoint: String,
    engine: EngineId,
    /// No recurrent layers: scored by its KV match.
    attention_only: bool,
    /// Unregistered: its engine is cleared and its answers left out (the
    /// index keeps engine slots for its life).
    gone: bool,
}

struct Group {
    block_size: u32,
    sub: Subscriber,
    hasher: ChainHasher,
    workers: Vec<Worker>,
}

/// An HTTP answer: status and JSON body.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Body (JSON, or empty).
    pub body: String,
}

impl Reply {
    fn json(status: u16, v: &Value) -> Self {
        Reply {
            status,
            body: v.to_string(),
        }
    }
    fn error(status: u16, msg: impl Into<String>) -> Self {
        Reply::json(status, &json!({ "error": msg.into() }))
    }
}

/// The indexes and their streams, by `(model_name, routing_group)`.
pub struct Service {
    cfg: ServeConfig,
    groups: BTreeMap<(String, String), Group>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("groups", &self.groups.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Service {
    /// No workers yet.
    pub fn new(cfg: ServeConfig) -> Self {
        Service {
            cfg,
            groups: BTreeMap::new(),
        }
    }

    /// Registers a worker: 201 `{"status":"ok"}`; 409 for a worker already
    /// registered or another block size than its index's; 400 when the
    /// index is full or the endpoint is refused.
    pub fn register(&mut self, r: Register) -> Reply {
        if r.block_size == 0 {
            return Reply::error(400, "block_size must be > 0");
        }
        let key = (r.model_name.clone(), r.routing_group.clone());
        if let Some(g) = self.groups.get(&key) {
            if g.block_size != r.block_size {
                return Reply::error(
                    409,
                    format!(
                        "block_size mismatch for model={} routing_group={}: existing={}, requested={}",
                        r.model_name, r.routing_group, g.block_size, r.block_size
                    ),
                );
            }
            if g.workers
                .iter()
                .any(|w| !w.gone && w.instance_id == r.instance_id && w.dp_rank == r.dp_rank)
            {
                return Reply::error(
                    409,
                    format!(
                        "instance {} dp_rank {} already registered",
                        r.instance_id, r.dp_rank
                    ),
                );
            }
        } else {
            let sub = match Subscriber::new(r.block_size, &[], self.cfg.replay_timeout) {
                Ok(s) => s,
                Err(e) => return Reply::error(400, e.to_string()),
            };
            self.groups.insert(
                key.clone(),
                Group {
                    block_size: r.block_size,
                    sub,
                    hasher: ChainHasher::new(&self.cfg.seed, r.block_size),
                    workers: Vec::new(),
                },
            );
        }
        let g = self.groups.get_mut(&key).expect("inserted above");
        let ep = EngineEndpoint {
            name: format!("{}:{}", r.instance_id, r.dp_rank),
            events: r.endpoint.clone(),
            replay: r.replay_endpoint.clone(),
            topic: Vec::new(),
        };
        match g.sub.add_engine(&ep) {
            Ok(engine) => {
                g.workers.push(Worker {
                    instance_id: r.instance_id,
                    dp_rank: r.dp_rank,
                    endpoint: r.endpoint,
                    engine,
                    attention_only: r.attention_only,
                    gone: false,
                });
                Reply::json(201, &json!({"status": "ok"}))
            }
            Err(e) => Reply::error(400, e.to_string()),
        }
    }

    /// Unregisters a worker's ranks: its blocks leave the index and its
    /// stream is no longer read into it.
    pub fn unregister(&mut self, u: Unregister) -> Reply {
        let mut found = false;
        for ((model, group), g) in &mut self.groups {
            if *model != u.model_name || u.routing_group.as_ref().is_some_and(|r| r != group) {
                continue;
            }
            for w in &mut g.workers {
                if !w.gone
                    && w.instance_id == u.instance_id
                    && u.dp_rank.is_none_or(|r| r == w.dp_rank)
                {
                    w.gone = true;
                    found = true;
                    let _ = g.sub.clear_engine(w.engine);
                }
            }
        }
        if found {
            Reply::json(200, &json!({"status": "ok"}))
        } else {
            Reply::error(
                404,
                format!(
                    "instance {} not registered for model={}",
                    u.instance_id, u.model_name
                ),
            )
        }
    }

    /// Per-worker overlap of a request: Dynamo's `/query` answer, each
    /// score the resumable depth; `kv_scores` adds the KV match (what
    /// Dynamo reports).
    pub fn query(&self, q: &Query) -> Reply {
        let key = (q.model_name.clone(), q.routing_group.clone());
        let Some(g) = self.groups.get(&key) else {
            return Reply::error(
                404,
                format!(
                    "no indexer for model={} routing_group={}",
                    q.model_name, q.routing_group
                ),
            );
        };
        let (hashes, input_len) = match (&q.token_ids, &q.block_hashes) {
            (Some(t), None) => {
                let keys = RequestKeys {
                    lora: q.lora_name.clone().map(|n| (n, String::new())),
                    cache_salt: q.cache_salt.clone(),
                };
                let mut h: Vec<BlockHash> = Vec::new();
                g.hasher.wire_hashes_keyed(t, &keys, &mut h);
                (h, t.len())
            }
            (None, Some(h)) => {
                if q.cache_salt.is_some() {
                    return Reply::error(400, "cache_salt cannot apply to block_hashes");
                }
                // The request is at least one token past its last block.
                (h.clone(), h.len() * g.block_size as usize + 1)
            }
            _ => {
                return Reply::error(
                    422,
                    "expected token_ids (/query) or block_hashes (/query_by_hash)",
                )
            }
        };
        let mut out: Vec<Overlap> = Vec::new();
        g.sub.index().overlap_hashes(&hashes, input_len, &mut out);
        let (mut scores, mut kv_scores, mut instances) = (Map::new(), Map::new(), Map::new());
        for w in g.workers.iter().filter(|w| !w.gone) {
            let o = out[w.engine.index()];
            let id = w.instance_id.to_string();
            let rank = w.dp_rank.to_string();
            let score = if w.attention_only {
                o.kv_matched_tokens
            } else {
                o.resumable_tokens
            };
            if score > 0 {
                entry(&mut scores, &id).insert(rank.clone(), json!(score));
            }
            if o.kv_matched_tokens > 0 {
                entry(&mut kv_scores, &id).insert(rank.clone(), json!(o.kv_matched_tokens));
            }
            let inst = instances.entry(id).or_insert_with(
                || json!({"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}),
            );
            let best = inst["gpu"].as_u64().unwrap_or(0).max(u64::from(score));
            for k in ["longest_matched", "gpu", "cpu", "disk"] {
                inst[k] = json!(best);
            }
            inst["dp"][rank] = json!(score);
        }
        Reply::json(
            200,
            &json!({
                "scores": scores,
                "frequencies": [],
                "instances": instances,
                "kv_scores": kv_scores,
            }),
        )
    }

    /// Every index's content, keyed `model:group` as Dynamo's `/dump`:
    /// one stored event per worker with its blocks (`block_hash` only: the
    /// index keeps no tokens) and, a marconi extension, its states.
    pub fn dump(&self) -> Reply {
        let mut all = Map::new();
        for ((model, group), g) in &self.groups {
            let mut events = Vec::new();
            for w in g.workers.iter().filter(|w| !w.gone) {
                let idx = g.sub.index();
                let blocks: Vec<Value> = idx
                    .engine_blocks(w.engine)
                    .into_iter()
                    .map(|h| json!({"block_hash": h}))
                    .collect();
                events.push(json!({
                    "worker_id": w.instance_id,
                    "storage_tier": "device",
                    "event": {"event_id": 0, "data": {"stored": {
                        "parent_hash": null, "start_position": null, "blocks": blocks}},
                        "dp_rank": w.dp_rank},
                    "states": idx.engine_states(w.engine),
                }));
            }
            all.insert(
                format!("{model}:{group}"),
                json!({"block_size": g.block_size, "events": events}),
            );
        }
        Reply::json(200, &Value::Object(all))
    }

    /// Registered workers, Dynamo's `/workers` shape.
    pub fn workers(&self) -> Reply {
        let mut out = Vec::new();
        for ((model, group), g) in &self.groups {
            // instance -> (endpoints by rank, listeners by rank)
            let mut by_id: BTreeMap<u64, (JsonMap, JsonMap)> = BTreeMap::new();
            for w in g.workers.iter().filter(|w| !w.gone) {
                let e = by_id.entry(w.instance_id).or_default();
                e.0.insert(w.dp_rank.to_string(), json!(w.endpoint));
                let st = g.sub.feed_stats(w.engine);
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
        Reply::json(200, &Value::Array(out))
    }

    /// One HTTP request: method, path (query string ignored), body.
    pub fn handle(&mut self, method: &str, path: &str, body: &[u8]) -> Reply {
        let path = path.split('?').next().unwrap_or(path);
        fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Reply> {
            serde_json::from_slice(body).map_err(|e| Reply {
                status: 422,
                body: format!("Failed to deserialize the JSON body into the target type: {e}"),
            })
        }
        let r = match (method, path) {
            ("GET", "/health") => Ok(Reply {
                status: 200,
                body: String::new(),
            }),
            ("POST", "/register") => parse(body).map(|r| self.register(r)),
            ("POST", "/unregister") => parse(body).map(|u| self.unregister(u)),
            ("POST", "/query") => parse::<Query>(body).map(|mut q| {
                q.block_hashes = None;
                if q.token_ids.is_none() {
                    return Reply::error(422, "missing field `token_ids`");
                }
                self.query(&q)
            }),
            ("POST", "/query_by_hash") => parse::<Query>(body).map(|mut q| {
                q.token_ids = None;
                if q.block_hashes.is_none() {
                    return Reply::error(422, "missing field `block_hashes`");
                }
                self.query(&q)
            }),
            ("GET", "/dump") => Ok(self.dump()),
            ("GET", "/workers") => Ok(self.workers()),
            _ => Ok(Reply {
                status: 404,
                body: String::new(),
            }),
        };
        r.unwrap_or_else(|e| e)
    }

    /// Applies every batch waiting on any stream, waiting up to `timeout`
    /// on the first index (the others are drained without waiting).
    pub fn poll(&mut self, timeout: Duration) -> Result<u64, SubError> {
        let mut n = 0;
        let mut wait = timeout;
        for g in self.groups.values_mut() {
            n += g.sub.poll(wait)?;
            wait = Duration::ZERO;
        }
        Ok(n)
    }

    /// Serves HTTP on `server` until `stop()` holds, polling the streams
    /// between requests (every 5 ms at most when idle).
    pub fn run(
        &mut self,
        server: &tiny_http::Server,
        mut stop: impl FnMut() -> bool,
    ) -> Result<(), SubError> {
        while !stop() {
            match server.recv_timeout(Duration::from_millis(if self.groups.is_empty() {
                50
            } else {
                2
            })) {
                Ok(Some(mut req)) => {
                    let mut body = Vec::new();
                    let read = std::io::Read::read_to_end(
                        &mut std::io::Read::take(req.as_reader(), MAX_BODY + 1),
                        &mut body,
                    );
                    let reply = match read {
                        Ok(n) if n as u64 > MAX_BODY => {
                            Reply::error(413, "request body over 64 MiB")
                        }
                        Ok(_) => self.handle(req.method().as_str(), req.url(), &body),
                        Err(e) => Reply::error(400, e.to_string()),
                    };
                    let mut resp =
                        tiny_http::Response::from_string(reply.body).with_status_code(reply.status);
                    if let Ok(h) = tiny_http::Header::from_bytes("Content-Type", "application/json")
                    {
                        resp = resp.with_header(h);
                    }
                    // A client gone before its answer is its own loss.
                    let _ = req.respond(resp);
                }
                Ok(None) => {}
                Err(_) => {}
            }
            self.poll(Duration::ZERO)?;
        }
        Ok(())
    }
}

type JsonMap = Map<String, Value>;

fn entry<'a>(m: &'a mut Map<String, Value>, k: &str) -> &'a mut Map<String, Value> {
    m.entry(k.to_string())
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
        .expect("inserted as an object")
}
