//! A store in Redis or Valkey, through the `redis` crate's synchronous
//! connections.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::{Client, Connection, RedisWrite, ToRedisArgs, Value};

use crate::error::{ConfigError, StoreError};
use crate::{check_names, Fetched, Store};

/// How a [`RedisStore`] connects.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]` (or `unix:///path`).
    pub url: String,
    /// The bound of each read and write on the socket (each call is one
    /// pipelined round trip). Default 50 ms.
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
/// Connections are opened lazily, with `connect_timeout`; every socket
/// read and write is bounded by `timeout`. A connection whose call failed
/// is dropped (its stream's state is unknown); a failure to connect, or an
/// I/O failure or timeout on a call, starts a backoff during which calls
/// fail at once with [`StoreError::Unavailable`], so a dead store costs a
/// request nothing. Calls from several threads use separate connections.
pub struct RedisStore {
    client: Client,
    cfg: RedisConfig,
    idle: Mutex<Vec<Connection>>,
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
        Ok(RedisStore {
            client,
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

    fn connection(&self) -> Result<Connection, StoreError> {
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
        let con = self
            .client
            .get_connection_with_timeout(self.cfg.connect_timeout)
            .and_then(|c| {
                c.set_read_timeout(Some(self.cfg.timeout))?;
                c.set_write_timeout(Some(self.cfg.timeout))?;
                Ok(c)
            });
        match con {
            Ok(c) => {
                let mut b = lock(&self.backoff);
                b.until = None;
                b.next = self.cfg.backoff;
                Ok(c)
            }
            Err(e) => {
                self.fail();
                Err(if e.is_timeout() {
                    StoreError::Timeout(self.cfg.connect_timeout)
                } else {
                    StoreError::Unavailable(e.to_string())
                })
            }
        }
    }

    /// Runs `pipe` on a connection: one round trip.
    fn run(&self, pipe: &redis::Pipeline) -> Result<Vec<Value>, StoreError> {
        let mut con = self.connection()?;
        match pipe.query::<Vec<Value>>(&mut con) {
            Ok(v) => {
                let mut idle = lock(&self.idle);
                if idle.len() < self.cfg.max_idle {
                    idle.push(con);
                }
                Ok(v)
            }
            Err(e) if e.is_timeout() => {
                self.fail();
                Err(StoreError::Timeout(self.cfg.timeout))
            }
            Err(e) if e.is_io_error() || e.is_connection_dropped() => {
                self.fail();
                Err(StoreError::Unavailable(e.to_string()))
            }
            // A server error reply (WRONGTYPE, OOM, READONLY...): the
            // connection is in a known state and is dropped anyway.
            Err(e) => Err(StoreError::Failed(e.to_string())),
        }
    }
}

/// An object given in two parts, written as one argument straight into the
/// command buffer (no joined copy first).
struct Parts<'a>([&'a [u8]; 2]);

impl ToRedisArgs for Parts<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        let mut w = out.writer_for_next_arg();
        for p in self.0 {
            // The writer appends to the command's Vec: it cannot fail.
            let _ = std::io::Write::write_all(&mut w, p);
        }
    }
}

fn unexpected(what: &str, v: &Value) -> StoreError {
    StoreError::Failed(format!("unexpected reply to {what}: {v:?}"))
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
        let mut p = redis::pipe();
        for n in names {
            p.cmd("EXISTS").arg(*n);
        }
        let r = self.run(&p)?;
        if r.len() != names.len() {
            return Err(StoreError::Failed("EXISTS: wrong number of replies".into()));
        }
        r.iter()
            .map(|v| match v {
                Value::Int(i) => Ok(*i > 0),
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
        let mut p = redis::pipe();
        for n in names {
            p.cmd("GETRANGE").arg(*n).arg(0).arg(max_bytes);
        }
        let r = self.run(&p)?;
        if r.len() != names.len() {
            return Err(StoreError::Failed(
                "GETRANGE: wrong number of replies".into(),
            ));
        }
        r.into_iter()
            .map(|v| match v {
                Value::BulkString(b) if b.is_empty() => Ok(Fetched::Absent),
                Value::BulkString(b) if b.len() > max_bytes => Ok(Fetched::Oversized),
                Value::BulkString(b) => Ok(Fetched::Value(b)),
                Value::Nil => Ok(Fetched::Absent),
                v => Err(unexpected("GETRANGE", &v)),
            })
            .collect()
    }

    fn batch_put(&self, items: &[(&str, &[u8])]) -> Result<(), StoreError> {
        check_names(items.iter().map(|(n, _)| *n))?;
        if items.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for (n, b) in items {
            p.cmd("SET").arg(*n).arg(*b);
            if self.cfg.ttl_s > 0 {
                p.arg("EX").arg(self.cfg.ttl_s);
            }
            p.ignore();
        }
        self.run(&p).map(drop)
    }

    fn batch_put_parts(&self, items: &[(&str, [&[u8]; 2])]) -> Result<(), StoreError> {
        check_names(items.iter().map(|(n, _)| *n))?;
        if items.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for (n, parts) in items {
            p.cmd("SET").arg(*n).arg(Parts(*parts));
            if self.cfg.ttl_s > 0 {
                p.arg("EX").arg(self.cfg.ttl_s);
            }
            p.ignore();
        }
        self.run(&p).map(drop)
    }

    fn delete(&self, names: &[&str]) -> Result<(), StoreError> {
        check_names(names.iter().copied())?;
        if names.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        p.cmd("DEL");
        for n in names {
            p.arg(*n);
        }
        p.ignore();
        self.run(&p).map(drop)
    }
}
