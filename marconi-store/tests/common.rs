//! Shared by the fault tests: a real redis-server (or valkey-server) on
//! 127.0.0.1, and the fault contract every backend must keep.
#![allow(dead_code, reason = "each test binary uses a part of it")]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use marconi_store::{Lookup, MissKind, StoreStats, StoreTier};

/// Set to 1 by the CI script: a missing server binary fails the test.
pub(crate) const STRICT_ENV: &str = "MARCONI_STORE_STRICT";

/// The server binary: $MARCONI_REDIS_SERVER, else redis-server or
/// valkey-server on PATH.
pub(crate) fn server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MARCONI_REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["redis-server", "valkey-server"] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// The binary, or `None` after printing why the test is skipped; panics
/// when $MARCONI_STORE_STRICT is 1.
pub(crate) fn server_or_skip(test: &str) -> Option<PathBuf> {
    let b = server_binary();
    if b.is_none() {
        assert!(
            std::env::var(STRICT_ENV).as_deref() != Ok("1"),
            "{test}: no redis-server or valkey-server on PATH and {STRICT_ENV}=1"
        );
        eprintln!("SKIPPED {test}: no redis-server or valkey-server on PATH (apt-get install redis-server)");
    }
    b
}

/// A port nothing listens on right now.
pub(crate) fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// A redis-server this test started; stopped (killed and reaped) on drop.
pub(crate) struct Server {
    child: Option<Child>,
    bin: PathBuf,
    pub(crate) port: u16,
    dir: tempfile::TempDir,
}

impl Server {
    /// Starts a server with no persistence on a free port of 127.0.0.1 and
    /// waits (at most 10 s) until it accepts connections.
    pub(crate) fn start(bin: &std::path::Path) -> Server {
        let mut s = Server {
            child: None,
            bin: bin.to_path_buf(),
            port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
        };
        s.launch();
        s
    }

    fn launch(&mut self) {
        let child = Command::new(&self.bin)
            .args(["--bind", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--enable-debug-command", "yes", "--protected-mode", "yes"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(mut c) = redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server did not answer on port {} within 10 s",
            self.port
        );
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again, empty, on the same port.
    pub(crate) fn restart_empty(&mut self) {
        self.kill();
        self.launch();
    }

    /// A direct connection for the test's own commands.
    pub(crate) fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .expect("connect to the test server")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A listener that accepts connections and never answers (a hung store).
pub(crate) struct Silent {
    pub(crate) port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Silent {
    pub(crate) fn start() -> Silent {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.set_nonblocking(true).expect("nonblocking");
        let port = l.local_addr().expect("addr").port();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            // Bounded: at most 60 s, and until the test stops it.
            let start = Instant::now();
            while !s.load(std::sync::atomic::Ordering::Relaxed)
                && start.elapsed() < Duration::from_secs(60)
            {
                if let Ok((c, _)) = l.accept() {
                    held.push(c);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Silent {
            port,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub(crate) fn tokens(n: u32, salt: u32) -> Vec<u32> {
    (0..n)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ salt)
        .collect()
}

pub(crate) fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn hit(l: &Lookup) -> Option<&[u8]> {
    match l {
        Lookup::Hit(p) => Some(p),
        Lookup::Miss(_) => None,
    }
}

/// Asserts the lookup is a miss of `kind`.
pub(crate) fn assert_miss(l: &Lookup, kind: MissKind, what: &str) {
    assert_eq!(l, &Lookup::Miss(kind), "{what}");
}

/// Raw bytes of the object `name` (asserts it is there).
pub(crate) fn raw_get(t: &StoreTier, name: &str) -> Vec<u8> {
    match t.store().batch_get(&[name], 1 << 30).expect("raw get") {
        r if matches!(r[0], marconi_store::Fetched::Value(_)) => match &r[0] {
            marconi_store::Fetched::Value(v) => v.clone(),
            _ => unreachable!(),
        },
        r => panic!("raw get {name}: {r:?}"),
    }
}

pub(crate) fn raw_put(t: &StoreTier, name: &str, bytes: &[u8]) {
    t.store().batch_put(&[(name, bytes)]).expect("raw put");
}

/// The fault contract, the same for every backend. `a` and `b` are two
/// tiers of the same model on one store (two engines); `foreign` is
/// another model and `newer` another layout version, on the same store.
/// Each fault is made through the raw store under the tier, then read.
pub(crate) fn fault_contract(a: &StoreTier, b: &StoreTier, foreign: &StoreTier, newer: &StoreTier) {
    let t = tokens(37, 1);
    let state = value(100_000, 7);
    let s0 = a.stats();
    assert_eq!(s0, StoreStats::default(), "a new tier has counted nothing");

    // Round trip, and sharing between two engines of one model.
    a.put_state(&t, 20, &state).expect("put state");
    assert_eq!(hit(&a.get_state(&t, 20).unwrap()), Some(&state[..]));
    assert_eq!(
        hit(&b.get_state(&t, 20).unwrap()),
        Some(&state[..]),
        "same model shares"
    );
    // Never across models or layout versions (different keys: absent).
    assert_miss(
        &foreign.get_state(&t, 20).unwrap(),
        MissKind::Absent,
        "foreign model",
    );
    assert_miss(
        &newer.get_state(&t, 20).unwrap(),
        MissKind::Absent,
        "newer layout",
    );
    // Another position or other tokens: absent.
    assert_miss(
        &a.get_state(&t, 21).unwrap(),
        MissKind::Absent,
        "other position",
    );
    assert_miss(
        &a.get_state(&tokens(37, 2), 20).unwrap(),
        MissKind::Absent,
        "other tokens",
    );
    assert!(a.get_state(&t, 0).is_err() && a.get_state(&t, 38).is_err());

    let name = a.name(&a.keyer().state_key(&t, 20).unwrap());
    let good = raw_get(a, &name);

    // Truncated.
    raw_put(a, &name, &good[..good.len() / 2]);
    assert_miss(&a.get_state(&t, 20).unwrap(), MissKind::Truncated, "half");
    raw_put(a, &name, &good[..10]);
    assert_miss(
        &a.get_state(&t, 20).unwrap(),
        MissKind::Truncated,
        "10 bytes",
    );
    // Corrupt: one flipped payload bit, a flipped magic, garbage.
    let mut c = good.clone();
    c[5000] ^= 1;
    raw_put(a, &name, &c);
    assert_miss(
        &a.get_state(&t, 20).unwrap(),
        MissKind::Corrupt,
        "flipped bit",
    );
    let mut c = good.clone();
    c[0] ^= 0xff;
    raw_put(a, &name, &c);
    assert_miss(&a.get_state(&t, 20).unwrap(), MissKind::Corrupt, "magic");
    raw_put(a, &name, &value(good.len(), 3));
    assert_miss(&a.get_state(&t, 20).unwrap(), MissKind::Corrupt, "garbage");
    // Swapped between keys: another state's valid envelope under this name.
    let other_state = value(100_000, 9);
    a.put_state(&t, 30, &other_state).expect("put");
    let other_name = a.name(&a.keyer().state_key(&t, 30).unwrap());
    raw_put(a, &name, &raw_get(a, &other_name));
    assert_miss(&a.get_state(&t, 20).unwrap(), MissKind::WrongKey, "swapped");
    // Another model's value, and another layout version's, under this name.
    foreign.put_state(&t, 20, &state).expect("put");
    raw_put(
        a,
        &name,
        &raw_get(
            foreign,
            &foreign.name(&foreign.keyer().state_key(&t, 20).unwrap()),
        ),
    );
    assert_miss(
        &a.get_state(&t, 20).unwrap(),
        MissKind::ForeignModel,
        "foreign",
    );
    newer.put_state(&t, 20, &state).expect("put");
    raw_put(
        a,
        &name,
        &raw_get(
            newer,
            &newer.name(&newer.keyer().state_key(&t, 20).unwrap()),
        ),
    );
    assert_miss(
        &a.get_state(&t, 20).unwrap(),
        MissKind::Version,
        "newer version",
    );
    // Repaired by a fresh put.
    a.put_state(&t, 20, &state).expect("put");
    assert_eq!(hit(&a.get_state(&t, 20).unwrap()), Some(&state[..]));
    // Deleted.
    a.delete_state(&t, 20).expect("delete");
    assert_miss(&a.get_state(&t, 20).unwrap(), MissKind::Absent, "deleted");
    assert!(a
        .put_state(&t, 20, &value(a.max_value_bytes() + 1, 0))
        .is_err());

    // KV blocks: 37 tokens of blocks of 8 = 4 full blocks.
    let blocks: Vec<Vec<u8>> = (0..4).map(|i| value(4096, i)).collect();
    let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
    a.put_kv(&t, 0, &refs).expect("put kv");
    assert!(a.put_kv(&t, 1, &refs).is_err(), "past the full blocks");
    assert_eq!(a.kv_prefix(&t), 4);
    assert_eq!(
        b.kv_prefix(&t[..20]),
        2,
        "a shorter request shares its prefix"
    );
    assert_eq!(foreign.kv_prefix(&t), 0);
    let got = b.get_kv(&t, 0, 10, Some(4096)).unwrap();
    assert_eq!(got.iter().map(|p| &p[..]).collect::<Vec<_>>(), refs);
    let got = a.get_kv(&t, 2, 10, None).unwrap();
    assert_eq!(got.len(), 2);
    assert!(
        a.get_kv(&t, 0, 10, Some(4095)).unwrap().is_empty(),
        "wrong block size"
    );
    // Block 1 corrupt: blocks 0 only; the exists hint still says 4.
    let n1 = a.name(&a.keyer().kv_keys(&t)[1]);
    let mut c = raw_get(a, &n1);
    c[200] ^= 4;
    raw_put(a, &n1, &c);
    assert_eq!(a.get_kv(&t, 0, 10, Some(4096)).unwrap().len(), 1);
    // Blocks 0 and 1 swapped: nothing.
    let n0 = a.name(&a.keyer().kv_keys(&t)[0]);
    a.put_kv(&t, 0, &refs).expect("put kv");
    let (b0, b1) = (raw_get(a, &n0), raw_get(a, &n1));
    raw_put(a, &n0, &b1);
    raw_put(a, &n1, &b0);
    assert!(a.get_kv(&t, 0, 10, None).unwrap().is_empty());
    assert_eq!(a.get_kv(&t, 2, 10, None).unwrap().len(), 2);

    let s = a.stats();
    let want = StoreStats {
        hits: 2 + 2 + 1 + 2,
        absent: 3,
        truncated: 2,
        corrupt: 3 + 1,
        version: 1,
        foreign_model: 1,
        wrong_key: 1 + 1,
        oversized: 1,
        puts: 1 + 1 + 1 + 4 + 4,
        put_failures: 0,
        bytes_read: 2 * 100_000 + 2 * 4096 + 4096 + 2 * 4096,
        bytes_written: 3 * 100_000 + 8 * 4096,
        ..StoreStats::default()
    };
    assert_eq!(s, want);
}
