//! A store in Redis or Valkey, over RESP2 connections of its own (the
//! `redis` crate parses the URL), so that every call is bounded as a whole.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::{Client, ConnectionInfo};

use crate::error::{ConfigError, StoreError};
use crate::resp::{command, Conn, Failure, Reply};
use crate::{check_names, Fetched, Store};

/// How a [`RedisStore`] connects.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]` (or `unix:///path`).
    pub url: String,
    /// The bound of each call as a whole (one pipelined round trip: the
    /// request written and every reply read, however slowly the server
    /// sends it). Default 50 ms.
    pub timeout: Duration,
    /// The bound of opening a connection (TCP connect and handshake).
    /// Default 50 ms.
    pub connect_timeout: Duration,
    /// After a failure to connect or a dropped connection, no new
    /// connection is tried for this long (doubling on each further failure
    /// up to `max_backoff`; calls meanwhile fail at once). Default 100 ms.
    pub backoff: Duration,
    /// The longest backoff. Default 5 s.
    pub max_backoff: Duration,
    /// Idle connections kept for reuse. Default 4.
    pub max_idle: usize,
    /// Expiry of every object written, in seconds (0: none, the server's
    /// eviction policy decides). Default 0.
    pub ttl_s: u64,
}

impl RedisConfig {
    /// The defaults for `url`.
    pub fn new(url: &str) -> Self {
        RedisConfig {
            url: url.to_owned(),
            timeout: Duration::from_millis(50),
            connect_timeout: Duration::from_millis(50),
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_idle: 4,
            ttl_s: 0,
        }
    }
}

#[derive(Debug)]
struct Backoff {
    /// No connection is tried before this.
    until: Option<Instant>,
    /// The next backoff.
    next: Duration,
}

/// Redis or Valkey as a store: batches are pipelines (`EXISTS`, bounded
/// `GETRANGE`, `SET`), each a single round trip on one connection.
///
/// Connections are opened lazily; opening one (connect and handshake) is
/// bounded by `connect_timeout`, and each call (its request written, every
/// reply read) by `timeout` as a whole: a server that trickles its reply
/// gets no fresh timeout per read. A reply larger than the values asked
/// for is refused before it is read. A connection whose call failed is
/// dropped (its stream's state is unknown); a failure to connect, or an
/// I/O failure, timeout or garbled reply on a call, starts a backoff during
/// which calls fail at once with [`StoreError::Unavailable`], so a dead or
/// hostile store costs a request nothing. Calls from several threads use
/// separate connections.
pub struct RedisStore {
    info: ConnectionInfo,
    cfg: RedisConfig,
    idle: Mutex<Vec<Conn>>,
    backoff: Mutex<Backoff>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data (a connection list, a backoff) is valid whatever a
    // panicking holder did.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Bytes of a reply line around a value (`$n\r\n`, CRLF) or of a short
/// reply (`:1\r\n`, `+OK\r\n`, an error line).
const REPLY_OVERHEAD: usize = 64;

impl RedisStore {
    /// A store for `cfg` (no connection is opened yet).
    pub fn new(cfg: RedisConfig) -> Result<RedisStore, ConfigError> {
        if cfg.timeout.is_zero() || cfg.connect_timeout.is_zero() {
            return Err(ConfigError(
                "timeout and connect_timeout must be > 0".into(),
            ));
        }
        let client = Client::open(cfg.url.as_str())
            .map_err(|e| ConfigError(format!("redis url {:?}: {e}", cfg.url)))?;
        let info = client.get_connection_info().clone();
        if matches!(info.addr, redis::ConnectionAddr::TcpTls { .. }) {
            return Err(ConfigError(format!(
                "redis url {:?}: TLS is not supported",
                cfg.url
            )));
        }
        Ok(RedisStore {
            info,
            backoff: Mutex::new(Backoff {
                until: None,
                next: cfg.backoff,
            }),
            cfg,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.cfg
    }

    fn fail(&self) {
        let mut b = lock(&self.backoff);
        b.until = Some(Instant::now() + b.next);
        b.next = (b.next * 2).min(self.cfg.max_backoff);
        lock(&self.idle).clear();
    }

    fn connection(&self) -> Result<Conn, StoreError> {
        if let Some(c) = lock(&self.idle).pop() {
            return Ok(c);
        }
        {
            let b = lock(&self.backoff);
            if let Some(until) = b.until {
                if Instant::now() < until {
                    return Err(StoreError::Unavailable(
                        "waiting out the reconnection backoff".into(),
                    ));
                }
            }
        }
        match Conn::open(&self.info, Instant::now() + self.cfg.connect_timeout) {
            Ok(c) => {
                let mut b = lock(&self.backoff);
                b.until = None;
                b.next = self.cfg.backoff;
                Ok(c)
            }
            Err(e) => {
                self.fail();
                Err(match e {
                    Failure::Timeout => StoreError::Timeout(self.cfg.connect_timeout),
                    Failure::Io(m) | Failure::Protocol(m) => StoreError::Unavailable(m),
                })
            }
        }
    }

    /// Runs `n` pipelined commands (`request`) on a connection: one round
    /// trip, bounded by `timeout` as a whole, its replies by
    /// `max_reply_bytes`. An error reply fails the call.
    fn run(
        &self,
        request: &[u8],
        n: usize,
        max_reply_bytes: usize,
    ) -> Result<Vec<Reply>, StoreError> {
        let mut con = self.connection()?;
        let deadline = Instant::now() + self.cfg.timeout;
        match con.exchange(request, n, max_reply_bytes, deadline) {
            Ok(v) => {
                if let Some(Reply::Error(e)) = v.iter().find(|r| matches!(r, Reply::Error(_))) {
                    // A server error reply (WRONGTYPE, OOM, READONLY...):
                    // the stream is in a known state, but the connection
                    // is dropped anyway.
                    return Err(StoreError::Failed(e.clone()));
                }
                let mut idle = lock(&self.idle);
                if idle.len() < self.cfg.max_idle {
                    idle.push(con);
                }
                Ok(v)
            }
            Err(Failure::Timeout) => {
                self.fail();
                Err(StoreError::Timeout(self.cfg.timeout))
            }
            Err(Failure::Io(m)) => {
                self.fail();
                Err(StoreError::Unavailable(m))
            }
            Err(Failure::Protocol(m)) => {
                self.fail();
                Err(StoreError::Failed(format!(
                    "not a reply to the request: {m}"
                )))
            }
        }
    }

    /// Runs commands that each answer a short reply.
    fn run_short(&self, request: &[u8], n: usize) -> Result<Vec<Reply>, StoreError> {
        self.run(request, n, n.saturating_mul(REPLY_OVERHEAD))
    }
}

fn unexpected(what: &str, v: &Reply) -> StoreError {
    StoreError::Failed(format!("unexpected reply to {what}: {v:?}"))
}

/// The `EX ttl` arguments of a SET, when objects expire.
fn ttl_args(ttl_s: u64) -> Option<String> {
    (ttl_s > 0).then(|| ttl_s.to_string())
}

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn timeout(&self) -> Duration {
        self.cfg.timeout
    }

    fn batch_exists(&self, names: &[&str]) -> Result<Vec<bool>, StoreError> {
        check_names(names.iter().copied())?;
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut req = Vec::new();
        for n in names {
            command(&mut req, &[&[b"EXISTS"], &[n.as_bytes()]]);
        }
        let r = self.run_short(&req, names.len())?;
        r.iter()
            .map(|v| match v {
                Reply::Int(i) => Ok(*i > 0),
                v => Err(unexpected("EXISTS", v)),
            })
            .collect()
    }

    fn batch_get(&self, names: &[&str], max_bytes: usize) -> Result<Vec<Fetched>, StoreError> {
        check_names(names.iter().copied())?;
        if names.is_empty() {
            return Ok(Vec::new());
        }
        // GETRANGE k 0 max returns at most max + 1 bytes (the end is
        // inclusive), so a larger object is seen without being read, and an
        // absent key is "" (no envelope is empty).
        let mut req = Vec::new();
        let end = max_bytes.to_string();
        for n in names {
            command(
                &mut req,
                &[&[b"GETRANGE"], &[n.as_bytes()], &[b"0"], &[end.as_bytes()]],
            );
        }
        let per = max_bytes.saturating_add(1 + REPLY_OVERHEAD);
        let r = self.run(&req, names.len(), per.saturating_mul(names.len()))?;
        r.into_iter()
            .map(|v| match v {
                Reply::Bulk(Some(b)) if b.is_empty() => Ok(Fetched::Absent),
                Reply::Bulk(Some(b)) if b.len() > max_bytes => Ok(Fetched::Oversized),
                Reply::Bulk(Some(b)) => Ok(Fetched::Value(b)),
                Reply::Bulk(None) => Ok(Fetched::Absent),
                v => Err(unexpected("GETRANGE", &v)),
            })
            .collect()
    }

    fn batch_put(&self, items: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let parts: Vec<(&str, [&[u8]; 2])> =
            items.iter().map(|(n, b)| (*n, [*b, &[][..]])).collect();
        self.batch_put_parts(&parts)
    }

    fn batch_put_parts(&self, items: &[(&str, [&[u8]; 2])]) -> Result<(), StoreError> {
        check_names(items.iter().map(|(n, _)| *n))?;
        if items.is_empty() {
            return Ok(());
        }
        let ttl = ttl_args(self.cfg.ttl_s);
        let mut req = Vec::new();
        for (n, parts) in items {
            match &ttl {
                Some(t) => command(
                    &mut req,
                    &[
                        &[b"SET"],
                        &[n.as_bytes()],
                        &parts[..],
                        &[b"EX"],
                        &[t.as_bytes()],
                    ],
                ),
                None => command(&mut req, &[&[b"SET"], &[n.as_bytes()], &parts[..]]),
            }
        }
        let r = self.run_short(&req, items.len())?;
        match r.iter().find(|v| !matches!(v, Reply::Status(_))) {
            Some(v) => Err(unexpected("SET", v)),
            None => Ok(()),
        }
    }

    fn delete(&self, names: &[&str]) -> Result<(), StoreError> {
        check_names(names.iter().copied())?;
        if names.is_empty() {
            return Ok(());
        }
        let mut args: Vec<&[&[u8]]> = Vec::with_capacity(names.len() + 1);
        let del: &[&[u8]] = &[b"DEL"];
        args.push(del);
        let keys: Vec<[&[u8]; 1]> = names.iter().map(|n| [n.as_bytes()]).collect();
        args.extend(keys.iter().map(|k| &k[..]));
        let mut req = Vec::new();
        command(&mut req, &args);
        match self.run_short(&req, 1)?.as_slice() {
            [Reply::Int(_)] => Ok(()),
            [v] => Err(unexpected("DEL", v)),
            _ => Err(StoreError::Failed("DEL: no reply".into())),
        }
    }
}
