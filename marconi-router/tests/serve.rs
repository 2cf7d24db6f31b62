//! `marconi-router serve` over real HTTP on 127.0.0.1 (Dynamo's standalone
//! indexer API): registration all or nothing, slots freed on unregister, a
//! worker's failed replay costs that worker only, a stalled client holds up
//! neither other clients nor event ingestion, answers leave at once on a
//! kept-open connection, Dynamo's status codes and content types, scores
//! capped at the deepest state; then a bounded load with a stalled client.
//!
//! Each test starts its own server in process. With
//! `MARCONI_ROUTER_TEST_BIN=path/to/marconi-router` they run against that
//! binary instead (`serve --http 127.0.0.1:PORT`, default settings), which
//! is how an older build is checked against them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use marconi_router::hash::{ChainHasher, RequestKeys, DEFAULT_SEED};
use marconi_router::serve::{ServeConfig, Server};
use serde_json::{json, Value};

fn port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A server under test: in process, or the binary named by
/// `MARCONI_ROUTER_TEST_BIN`.
enum Target {
    InProcess(Option<Server>),
    Binary(Child),
}

struct Srv {
    addr: SocketAddr,
    target: Target,
}

impl Srv {
    fn start(cfg: ServeConfig) -> Srv {
        if let Ok(bin) = std::env::var("MARCONI_ROUTER_TEST_BIN") {
            let addr: SocketAddr = format!("127.0.0.1:{}", port()).parse().expect("addr");
            let child = Command::new(bin)
                .args(["serve", "--http", &addr.to_string()])
                .spawn()
                .expect("start the binary");
            let srv = Srv {
                addr,
                target: Target::Binary(child),
            };
            // Ready when it answers `/health`, not when a connect succeeds:
            // a connect to a port nothing listens on yet can succeed by
            // connecting the socket to itself (the port is in the
            // ephemeral range), and the binary may still be starting.
            let end = Instant::now() + Duration::from_secs(20);
            loop {
                let ok = try_raw(addr, "GET", "/health", None, b"", Duration::from_secs(2))
                    .is_ok_and(|a| a.status == 200);
                if ok {
                    break;
                }
                assert!(Instant::now() < end, "the binary did not answer /health");
                std::thread::sleep(Duration::from_millis(50));
            }
            return srv;
        }
        let s = Server::bind("127.0.0.1:0", cfg).expect("bind");
        Srv {
            addr: s.local_addr(),
            target: Target::InProcess(Some(s)),
        }
    }

    /// The server process is still there (always, in process).
    fn alive(&mut self) -> bool {
        match &mut self.target {
            Target::InProcess(_) => true,
            Target::Binary(c) => matches!(c.try_wait(), Ok(None)),
        }
    }
}

impl Drop for Srv {
    fn drop(&mut self) {
        match &mut self.target {
            Target::InProcess(s) => {
                if let Some(s) = s.take() {
                    s.stop();
                }
            }
            Target::Binary(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// An answer: status, Content-Type (if any), body, headers (lower-case names).
#[derive(Debug)]
struct Answer {
    status: u16,
    ctype: Option<String>,
    body: String,
    headers: Vec<(String, String)>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one HTTP/1.1 answer (Content-Length bodies).
fn read_answer(r: &mut BufReader<TcpStream>) -> std::io::Result<Answer> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "closed",
        ));
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body)?;
    Ok(Answer {
        status,
        ctype: headers
            .iter()
            .find(|(k, _)| k == "content-type")
            .map(|(_, v)| v.clone()),
        body: String::from_utf8_lossy(&body).into_owned(),
        headers,
    })
}

fn request_bytes(method: &str, path: &str, ctype: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    if let Some(ct) = ctype {
        req.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut b = req.into_bytes();
    b.extend_from_slice(body);
    b
}

/// One request on a fresh connection, answered within 10 s.
fn raw(addr: SocketAddr, method: &str, path: &str, ctype: Option<&str>, body: &[u8]) -> Answer {
    try_raw(addr, method, path, ctype, body, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn try_raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    ctype: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> std::io::Result<Answer> {
    let s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    (&s).write_all(&request_bytes(method, path, ctype, body))?;
    read_answer(&mut BufReader::new(s))
}

fn post(addr: SocketAddr, path: &str, body: Value) -> Answer {
    raw(
        addr,
        "POST",
        path,
        Some("application/json"),
        body.to_string().as_bytes(),
    )
}

fn get(addr: SocketAddr, path: &str) -> Answer {
    raw(addr, "GET", path, None, b"")
}

/// A kept-open connection.
struct Conn {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Conn {
    fn new(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Conn {
            w: s.try_clone().expect("clone"),
            r: BufReader::new(s),
        }
    }
    fn post(&mut self, path: &str, body: &Value) -> Answer {
        self.w
            .write_all(&request_bytes(
                "POST",
                path,
                Some("application/json"),
                body.to_string().as_bytes(),
            ))
            .expect("send");
        read_answer(&mut self.r).expect("answer")
    }
}

fn key(b: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(b, s).expect("vec");
}

/// `[1.0, [BlockStored(kv) group 0, BlockStored([state]) group 1], 0]`,
/// with `extra_keys: [nil, …]` as vLLM 0.33 publishes blocks without keys.
fn payload(kv: &[u64], state: u64) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 3).expect("vec");
    rmp::encode::write_f64(&mut b, 1.0).expect("vec");
    rmp::encode::write_array_len(&mut b, 2).expect("vec");
    for (hashes, group) in [(kv, 0u64), (&[state][..], 1)] {
        rmp::encode::write_map_len(&mut b, 6).expect("vec");
        key(&mut b, "extra_keys");
        rmp::encode::write_array_len(&mut b, hashes.len() as u32).expect("vec");
        for _ in hashes {
            rmp::encode::write_nil(&mut b).expect("vec");
        }
        key(&mut b, "type");
        key(&mut b, "BlockStored");
        key(&mut b, "block_hashes");
        rmp::encode::write_array_len(&mut b, hashes.len() as u32).expect("vec");
        for &h in hashes {
            rmp::encode::write_uint(&mut b, h).expect("vec");
        }
        key(&mut b, "block_size");
        rmp::encode::write_uint(&mut b, 4).expect("vec");
        key(&mut b, "group_idx");
        rmp::encode::write_uint(&mut b, group).expect("vec");
        key(&mut b, "kv_cache_spec_kind");
        key(
            &mut b,
            if group == 1 {
                "mamba"
            } else {
                "full_attention"
            },
        );
    }
    rmp::encode::write_uint(&mut b, 0).expect("vec");
    b
}

/// A worker's PUB socket (vLLM's framing: `[topic, seq, payload]`).
struct Publisher {
    sock: zmq::Socket,
    endpoint: String,
    next: u64,
    _ctx: zmq::Context,
}

impl Publisher {
    fn new() -> Publisher {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::PUB).expect("PUB");
        let endpoint = format!("tcp://127.0.0.1:{}", port());
        sock.bind(&endpoint).expect("bind");
        Publisher {
            sock,
            endpoint,
            next: 0,
            _ctx: ctx,
        }
    }
    fn publish_seq(&mut self, seq: u64, p: &[u8]) {
        self.sock
            .send_multipart([&b""[..], &seq.to_be_bytes(), p], 0)
            .expect("send");
        self.next = seq + 1;
    }
    fn publish(&mut self, p: &[u8]) {
        self.publish_seq(self.next, p);
    }
}

/// Token blocks 1..=12 (4-token blocks) of namespace `salt`, their hashes.
fn chain(salt: Option<&str>, first: u32) -> (Vec<u32>, Vec<u64>) {
    let hasher = ChainHasher::new(DEFAULT_SEED, 4);
    let keys = RequestKeys {
        lora: None,
        cache_salt: salt.map(str::to_string),
    };
    let tokens: Vec<u32> = (first..first + 12).collect();
    let mut kv = Vec::new();
    hasher.wire_hashes_keyed(&tokens, &keys, &mut kv);
    (tokens, kv)
}

/// `tokens` and one more token.
fn plus(tokens: &[u32], t: u32) -> Vec<u32> {
    let mut v = tokens.to_vec();
    v.push(t);
    v
}

fn reg(id: u64, ep: &str) -> Value {
    json!({"instance_id": id, "endpoint": ep, "model_name": "m", "block_size": 4})
}

/// Publishes `batch` (as the next batch, over and over: the SUB joins in
/// the background) until `/query` of `query` shows `done`.
fn publish_until(
    addr: SocketAddr,
    p: &mut Publisher,
    batch: &[u8],
    query: &Value,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        p.publish(batch);
        let a = post(addr, "/query", query.clone());
        assert_eq!(a.status, 200, "{a:?}");
        if done(&a.json()) {
            return a.json();
        }
        assert!(Instant::now() < end, "the stream never reached the index");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue item 1: a failed `/register` (bad endpoint, bad replay endpoint)
/// keeps nothing; the next one works and so do `/workers` and `/query`.
#[test]
fn a_failed_registration_keeps_nothing() {
    let mut s = Srv::start(ServeConfig::default());
    let addr = s.addr;
    let good = format!("tcp://127.0.0.1:{}", port());
    // The sequence that used to end the process: a refused endpoint, then
    // a good registration, then `/workers`.
    let bad = json!({"instance_id": 1, "endpoint": "garbage", "model_name": "m", "block_size": 4});
    assert_eq!(post(addr, "/register", bad).status, 400);
    assert_eq!(post(addr, "/register", reg(1, &good)).status, 201);
    let w = get(addr, "/workers");
    assert_eq!(w.status, 200, "{w:?}");
    assert_eq!(w.json()[0]["instance_id"], 1);
    for bad in [
        json!({"instance_id": 2, "endpoint": "garbage", "model_name": "m", "block_size": 4}),
        json!({"instance_id": 2, "endpoint": "tcp://127.0.0.1", "model_name": "m", "block_size": 4}),
        json!({"instance_id": 2, "endpoint": "udp://127.0.0.1:5", "model_name": "m", "block_size": 4}),
        json!({"instance_id": 2, "endpoint": good, "model_name": "m", "block_size": 4,
               "replay_endpoint": "garbage"}),
        json!({"instance_id": 2, "endpoint": good, "model_name": "n", "block_size": 4,
               "replay_endpoint": "tcp://127.0.0.1:x"}),
    ] {
        let a = post(addr, "/register", bad.clone());
        assert_eq!(a.status, 400, "{bad}: {a:?}");
        assert!(a.json()["error"].is_string(), "{a:?}");
        let w = get(addr, "/workers");
        assert_eq!(w.status, 200, "{w:?}");
        assert_eq!(
            w.json().as_array().map(Vec::len),
            Some(1),
            "{bad} left a worker"
        );
    }
    // Nor an index for the model of a refused registration.
    assert!(get(addr, "/dump").json().get("n:default").is_none());
    assert_eq!(post(addr, "/register", reg(2, &good)).status, 201);
    assert_eq!(
        get(addr, "/workers").json().as_array().map(Vec::len),
        Some(2)
    );
    let q = post(
        addr,
        "/query",
        json!({"token_ids": [1, 2, 3, 4, 5], "model_name": "m"}),
    );
    assert_eq!(q.status, 200, "{q:?}");
    assert!(s.alive());
}

/// Issue item 2: a replay that cannot work is refused up front, and a
/// worker whose replay fails (nothing answers) is forgotten alone: the
/// other worker's events keep arriving meanwhile, the service stays up.
#[test]
fn a_failed_replay_forgets_that_worker_only() {
    let mut s = Srv::start(ServeConfig {
        replay_timeout: Duration::from_secs(5),
        ..ServeConfig::default()
    });
    let addr = s.addr;
    let (mut pa, mut pb) = (Publisher::new(), Publisher::new());
    let a = post(
        addr,
        "/register",
        json!({"instance_id": 1, "endpoint": pa.endpoint, "model_name": "m", "block_size": 4,
               "replay_endpoint": "garbage"}),
    );
    assert_eq!(a.status, 400, "{a:?}");
    // A replay endpoint where nothing answers.
    let dead = format!("tcp://127.0.0.1:{}", port());
    let a = post(
        addr,
        "/register",
        json!({"instance_id": 1, "endpoint": pa.endpoint, "model_name": "m", "block_size": 4,
               "replay_endpoint": dead}),
    );
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(post(addr, "/register", reg(2, &pb.endpoint)).status, 201);
    let (ta, ka) = chain(None, 1);
    let (tb, kb) = chain(None, 100);
    let qa = json!({"token_ids": plus(&ta, 0), "model_name": "m"});
    let qb = json!({"token_ids": plus(&tb, 0), "model_name": "m"});
    // B's first batch is seq 0: no gap. A's first batch arrives as seq 0
    // as well, repeated until the SUB has joined (duplicates are skipped).
    pb.publish_seq(0, &[]);
    let batch_a = payload(&ka, ka[1]);
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        pa.publish_seq(0, &batch_a);
        if post(addr, "/query", qa.clone()).json()["scores"]["1"]["0"] == 8 {
            break;
        }
        assert!(Instant::now() < end, "A's stream never reached the index");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A skips to seq 5: a gap; its replay goes unanswered.
    pa.publish_seq(5, &payload(&ka[..1], ka[0]));
    let listener = |id: u64| -> Value {
        let w = get(addr, "/workers").json();
        w.as_array()
            .and_then(|v| v.iter().find(|x| x["instance_id"] == id).cloned())
            .map_or(Value::Null, |x| x["listeners"]["0"].clone())
    };
    let end = Instant::now() + Duration::from_secs(10);
    while listener(1)["gaps"] != 1 {
        assert!(
            Instant::now() < end,
            "the gap was not seen: {}",
            listener(1)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // While A's replay is pending, B's batches are applied.
    let t0 = Instant::now();
    let batch_b = payload(&kb, kb[1]);
    let mut seq = 1;
    loop {
        pb.publish_seq(seq, &batch_b);
        seq += 1;
        if post(addr, "/query", qb.clone()).json()["scores"]["2"]["0"] == 8 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "B stalled");
        std::thread::sleep(Duration::from_millis(10));
    }
    if std::env::var("MARCONI_ROUTER_TEST_BIN").is_err() {
        assert_eq!(
            listener(1)["unrepaired"],
            0,
            "B's batch waited for A's replay to time out ({:?})",
            t0.elapsed()
        );
    }
    // Then A's replay times out: A alone is forgotten, then goes on from
    // the batch that made the gap.
    let end = Instant::now() + Duration::from_secs(20);
    while listener(1)["unrepaired"] != 1 {
        assert!(Instant::now() < end, "{}", listener(1));
        std::thread::sleep(Duration::from_millis(20));
    }
    let q = post(addr, "/query", qa.clone()).json();
    assert_eq!(
        q["kv_scores"]["1"]["0"], 4,
        "A holds only the batch after the gap: {q}"
    );
    assert_eq!(post(addr, "/query", qb).json()["scores"]["2"]["0"], 8);
    assert!(s.alive());
    assert_eq!(get(addr, "/health").status, 200);
}

/// Issue item 3: a client that sends headers and part of a body, then
/// waits, holds up neither other requests nor event ingestion; it is
/// answered 408 once the body deadline passes. One that stops within its
/// headers is cut off as well; one declaring a body over 64 MiB gets 413.
#[test]
fn a_stalled_client_holds_up_nothing() {
    let mut s = Srv::start(ServeConfig {
        header_timeout: Duration::from_secs(4),
        body_timeout: Duration::from_secs(4),
        ..ServeConfig::default()
    });
    let addr = s.addr;
    let mut p = Publisher::new();
    assert_eq!(post(addr, "/register", reg(1, &p.endpoint)).status, 201);
    // The worker's stream reaches the index first (its SUB has joined).
    let (t, k) = chain(None, 1);
    let q = json!({"token_ids": plus(&t, 0), "model_name": "m"});
    publish_until(addr, &mut p, &payload(&k, k[1]), &q, |v| {
        v["scores"]["1"]["0"] == 8
    });
    // Stalled in the body, and stalled in the headers.
    let body_stall = TcpStream::connect(addr).expect("connect");
    (&body_stall)
        .write_all(
            b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200000\r\n\r\n{\"token_ids\": [1,",
        )
        .expect("send");
    let head_stall = TcpStream::connect(addr).expect("connect");
    (&head_stall)
        .write_all(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Le")
        .expect("send");
    std::thread::sleep(Duration::from_millis(100));
    // Others are answered at once, and events are applied meanwhile.
    let t0 = Instant::now();
    for _ in 0..5 {
        let a = try_raw(addr, "GET", "/health", None, b"", Duration::from_secs(1))
            .expect("/health answered while a client stalls");
        assert_eq!(a.status, 200);
    }
    let (t2, k2) = chain(None, 200);
    let q2 = json!({"token_ids": plus(&t2, 0), "model_name": "m"});
    publish_until(addr, &mut p, &payload(&k2, k2[2]), &q2, |v| {
        v["scores"]["1"]["0"] == 12
    });
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "served while stalled: {:?}",
        t0.elapsed()
    );
    if std::env::var("MARCONI_ROUTER_TEST_BIN").is_err() {
        // The stalled body gets 408 at its deadline, then the connection closes.
        body_stall
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut r = BufReader::new(body_stall);
        let a = read_answer(&mut r).expect("408");
        assert_eq!(a.status, 408, "{a:?}");
        let mut rest = Vec::new();
        assert_eq!(r.read_to_end(&mut rest).expect("closed"), 0);
        // The stalled head: the connection is closed.
        head_stall
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut rest = Vec::new();
        let _ = (&head_stall).read_to_end(&mut rest);
        // Over 64 MiB declared: 413 without reading it.
        let big = TcpStream::connect(addr).expect("connect");
        big.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        (&big)
            .write_all(
                format!(
                    "POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    (64 << 20) + 1
                )
                .as_bytes(),
            )
            .expect("send");
        let a = read_answer(&mut BufReader::new(big)).expect("413");
        assert_eq!(a.status, 413, "{a:?}");
    }
    assert!(s.alive());
    assert_eq!(get(addr, "/health").status, 200);
}

/// `TCP_NODELAY` of the server's accepted socket connected to `peer`, found
/// among this process's descriptors (the server runs in process).
#[cfg(target_os = "linux")]
fn server_nodelay(server: SocketAddr, peer: SocketAddr) -> Option<bool> {
    use std::mem::ManuallyDrop;
    use std::os::fd::FromRawFd;
    for e in std::fs::read_dir("/proc/self/fd").ok()? {
        let Ok(fd) = e.ok()?.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap_or_default();
        if !link.to_string_lossy().starts_with("socket:") {
            continue;
        }
        // SAFETY: `fd` is an open socket of this process; ManuallyDrop
        // leaves it open, and only getsockopt/getsockname/getpeername run.
        let s = ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
        if s.local_addr().ok() == Some(server) && s.peer_addr().ok() == Some(peer) {
            return s.nodelay().ok();
        }
    }
    None
}

#[cfg(not(target_os = "linux"))]
fn server_nodelay(_: SocketAddr, _: SocketAddr) -> Option<bool> {
    Some(true)
}

/// Issue item 4: with 24 workers that all score, each `/query` answer on a
/// kept-open connection leaves at once (the 40 ms delayed-ACK stall of a
/// response written in pieces without `TCP_NODELAY` would show in every
/// one); `/query` lists only the workers that score.
#[test]
fn answers_leave_at_once_on_a_kept_open_connection() {
    let mut s = Srv::start(ServeConfig::default());
    let addr = s.addr;
    let mut p = Publisher::new();
    let mut quiet = Publisher::new();
    for id in 0..24 {
        assert_eq!(post(addr, "/register", reg(id, &p.endpoint)).status, 201);
    }
    for id in 100..104 {
        assert_eq!(
            post(addr, "/register", reg(id, &quiet.endpoint)).status,
            201
        );
    }
    let (t, k) = chain(None, 1);
    let q = json!({"token_ids": plus(&t, 0), "model_name": "m"});
    let ans = publish_until(addr, &mut p, &payload(&k, k[1]), &q, |v| {
        v["scores"].as_object().map(|m| m.len()) == Some(24)
    });
    let _ = &mut quiet;
    let mut c = Conn::new(addr);
    assert_eq!(c.post("/query", &q).status, 200);
    if std::env::var("MARCONI_ROUTER_TEST_BIN").is_err() {
        // The server's end of this connection is a socket of this process.
        let mine = c.w.local_addr().expect("addr");
        assert_eq!(server_nodelay(addr, mine), Some(true), "TCP_NODELAY");
    }
    let mut slow = 0;
    let n = 40;
    for _ in 0..n {
        let t0 = Instant::now();
        let a = c.post("/query", &q);
        assert_eq!(a.status, 200);
        if t0.elapsed() >= Duration::from_millis(40) {
            slow += 1;
        }
    }
    assert!(slow < n / 2, "{slow} of {n} answers took 40 ms or more");
    // Only the 24 that score are listed; the 4 quiet ones are not.
    assert_eq!(ans["instances"].as_object().map(|m| m.len()), Some(24));
    assert!(ans["instances"].get("100").is_none());
    assert!(ans.to_string().len() > 1300, "an answer over 1.3 KB");
    assert!(s.alive());
}

/// Issue item 5: unregistering frees the worker's slot: 70
/// register/unregister cycles for one model all succeed (with another
/// worker staying registered, so the model's index stays).
#[test]
fn unregistering_frees_the_slot() {
    let mut s = Srv::start(ServeConfig::default());
    let addr = s.addr;
    let ep = format!("tcp://127.0.0.1:{}", port());
    assert_eq!(post(addr, "/register", reg(1, &ep)).status, 201);
    for i in 0..70 {
        let a = post(addr, "/register", reg(1000 + i, &ep));
        assert_eq!(a.status, 201, "cycle {i}: {a:?}");
        let a = post(
            addr,
            "/unregister",
            json!({"instance_id": 1000 + i, "model_name": "m"}),
        );
        assert_eq!(a.status, 200, "cycle {i}: {a:?}");
    }
    // 63 more fit beside worker 1, then the 64-engine index is full.
    for i in 0..63 {
        assert_eq!(post(addr, "/register", reg(2000 + i, &ep)).status, 201);
    }
    assert_eq!(post(addr, "/register", reg(3000, &ep)).status, 400);
    assert_eq!(
        get(addr, "/workers").json().as_array().map(Vec::len),
        Some(64)
    );
    assert!(s.alive());
}

/// Issue item 6 and the API table of docs/routing.md: Dynamo 1.6.1's
/// status codes and content types.
#[test]
fn status_codes_and_content_types_are_dynamos() {
    let s = Srv::start(ServeConfig::default());
    let addr = s.addr;
    let ep = format!("tcp://127.0.0.1:{}", port());
    let json_ct = Some("application/json");
    let text = "text/plain; charset=utf-8";
    let reg1 = reg(1, &ep).to_string();
    let mut r = reg(1, &ep);
    r["dp_rank"] = Value::Null;
    let reg1_null_rank = r.to_string();
    // (method, path, content type, body) -> (status, content type)
    type Case<'a> = (
        &'a str,
        &'a str,
        Option<&'a str>,
        &'a str,
        u16,
        Option<&'a str>,
    );
    let cases: Vec<Case<'_>> = vec![
        ("GET", "/health", None, "", 200, None),
        ("HEAD", "/health", None, "", 200, None),
        ("POST", "/health", json_ct, "", 405, None),
        ("GET", "/register", None, "", 405, None),
        ("PUT", "/query", json_ct, "{}", 405, None),
        ("GET", "/nothing", None, "", 404, None),
        ("POST", "/register", None, &reg1, 415, Some(text)),
        (
            "POST",
            "/register",
            Some("text/plain"),
            &reg1,
            415,
            Some(text),
        ),
        ("POST", "/register", json_ct, "", 400, Some(text)),
        ("POST", "/register", json_ct, "{", 400, Some(text)),
        ("POST", "/register", json_ct, "{}", 422, Some(text)),
        (
            "POST",
            "/query",
            json_ct,
            r#"{"model_name": "m"}"#,
            422,
            Some(text),
        ),
        (
            "POST",
            "/query",
            json_ct,
            r#"{"token_ids": [-1], "model_name": "m"}"#,
            422,
            Some(text),
        ),
        (
            "POST",
            "/register",
            Some("application/json; charset=utf-8"),
            &reg1,
            201,
            json_ct,
        ),
        ("POST", "/register", json_ct, &reg1, 409, json_ct),
        ("POST", "/register", json_ct, &reg1_null_rank, 409, json_ct),
        (
            "POST",
            "/query",
            json_ct,
            r#"{"token_ids": [1], "model_name": "nope"}"#,
            404,
            json_ct,
        ),
        (
            "POST",
            "/query",
            json_ct,
            r#"{"token_ids": [1, 2, 3, 4, 5], "model_name": "m"}"#,
            200,
            json_ct,
        ),
        (
            "POST",
            "/query_by_hash",
            json_ct,
            r#"{"block_hashes": [1, -2, 18446744073709551615], "model_name": "m"}"#,
            200,
            json_ct,
        ),
        (
            "POST",
            "/query_by_hash",
            json_ct,
            r#"{"block_hashes": [1], "model_name": "m", "cache_salt": "x"}"#,
            400,
            json_ct,
        ),
        ("GET", "/workers", None, "", 200, json_ct),
        ("GET", "/workers?model_name=m", None, "", 200, json_ct),
        ("GET", "/dump", None, "", 200, json_ct),
        (
            "POST",
            "/unregister",
            json_ct,
            r#"{"instance_id": 9, "model_name": "m"}"#,
            404,
            json_ct,
        ),
        (
            "POST",
            "/unregister",
            json_ct,
            r#"{"instance_id": 1, "model_name": "m", "dp_rank": 3}"#,
            200,
            json_ct,
        ),
        // As Dynamo: the last worker gone, the model's index goes.
        (
            "POST",
            "/query",
            json_ct,
            r#"{"token_ids": [1, 2, 3, 4, 5], "model_name": "m"}"#,
            404,
            json_ct,
        ),
    ];
    for (method, path, ct, body, status, want_ct) in cases {
        let a = raw(addr, method, path, ct, body.as_bytes());
        assert_eq!(
            (a.status, a.ctype.as_deref()),
            (status, want_ct),
            "{method} {path} {ct:?} {body}: {a:?}"
        );
        if status == 405 {
            assert!(a.header("allow").is_some(), "{a:?}");
        }
        if want_ct.is_none() {
            assert_eq!(a.body, "", "{method} {path}");
        }
        if want_ct == json_ct {
            assert!(serde_json::from_str::<Value>(&a.body).is_ok(), "{a:?}");
        }
    }
    assert_eq!(get(addr, "/dump").json(), json!({}));
}

/// Scores capped at the deepest state, the KV match in `kv_scores`, a
/// cache salt hashed as vLLM does; `/query_by_hash` and `/dump` agree.
#[test]
fn scores_are_capped_at_the_deepest_state() {
    let s = Srv::start(ServeConfig::default());
    let addr = s.addr;
    let mut p = Publisher::new();
    assert_eq!(post(addr, "/register", reg(7, &p.endpoint)).status, 201);
    // The same stream from a worker without recurrent layers: its KV match
    // is all resumable, so it is scored by it, not capped.
    let mut r9 = reg(9, &p.endpoint);
    r9["attention_only"] = json!(true);
    assert_eq!(post(addr, "/register", r9).status, 201);
    let (tokens, kv) = chain(Some("salt"), 1);
    let query = json!({"token_ids": plus(&tokens, 13), "model_name": "m", "cache_salt": "salt"});
    let body = publish_until(addr, &mut p, &payload(&kv, kv[1]), &query, |v| {
        v["kv_scores"].get("7").is_some() && v["kv_scores"].get("9").is_some()
    });
    assert_eq!(body["scores"], json!({"7": {"0": 8}, "9": {"0": 12}}));
    assert_eq!(body["kv_scores"], json!({"7": {"0": 12}, "9": {"0": 12}}));
    assert_eq!(
        body["instances"]["7"],
        json!({"longest_matched": 8, "gpu": 8, "dp": {"0": 8}, "cpu": 8, "disk": 8})
    );
    assert_eq!(body["instances"]["9"]["gpu"], 12);
    // Without the salt the same tokens hash elsewhere: no match.
    let plain = json!({"token_ids": plus(&tokens, 13), "model_name": "m"});
    assert_eq!(
        post(addr, "/query", plain).json(),
        json!({"scores": {}, "frequencies": [], "instances": {}, "kv_scores": {}})
    );
    // By hash: the request is one token past its blocks; signed or not.
    let signed: Vec<i64> = kv.iter().map(|&h| h as i64).collect();
    for hashes in [json!(kv), json!(signed)] {
        let by_hash = json!({"block_hashes": hashes, "model_name": "m"});
        assert_eq!(
            post(addr, "/query_by_hash", by_hash).json()["scores"],
            json!({"7": {"0": 8}, "9": {"0": 12}})
        );
    }
    let dump = get(addr, "/dump").json();
    let blocks = dump["m:default"]["events"][0]["event"]["data"]["stored"]["blocks"]
        .as_array()
        .expect("blocks")
        .len();
    assert_eq!(blocks, 3);
    assert_eq!(dump["m:default"]["events"][0]["states"], json!([kv[1]]));
}

/// A bounded load: 8 clients × 60 requests (queries, health, workers) while
/// events arrive and two clients stall mid-request; every request is
/// answered, the index ends exact.
#[test]
fn bounded_load_with_stalled_clients() {
    let s = Srv::start(ServeConfig {
        header_timeout: Duration::from_secs(5),
        body_timeout: Duration::from_secs(5),
        ..ServeConfig::default()
    });
    let addr = s.addr;
    let mut p = Publisher::new();
    for id in 0..4 {
        assert_eq!(post(addr, "/register", reg(id, &p.endpoint)).status, 201);
    }
    let stall1 = TcpStream::connect(addr).expect("connect");
    (&stall1)
        .write_all(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200000\r\n\r\n{")
        .expect("send");
    let stall2 = TcpStream::connect(addr).expect("connect");
    (&stall2).write_all(b"GET /heal").expect("send");
    let (t, k) = chain(None, 1);
    let q = json!({"token_ids": plus(&t, 0), "model_name": "m"});
    publish_until(addr, &mut p, &payload(&k, k[1]), &q, |v| {
        v["scores"].as_object().map(|m| m.len()) == Some(4)
    });
    let t0 = Instant::now();
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let q = q.clone();
            std::thread::spawn(move || {
                let mut conn = Conn::new(addr);
                for i in 0..60 {
                    match (c + i) % 3 {
                        0 => {
                            let a = conn.post("/query", &q);
                            assert_eq!(a.status, 200);
                            assert_eq!(a.json()["scores"]["0"]["0"], 8);
                        }
                        1 => assert_eq!(get(addr, "/health").status, 200),
                        _ => assert_eq!(get(addr, "/workers").status, 200),
                    }
                }
            })
        })
        .collect();
    // Events keep arriving during the load.
    let (t2, k2) = chain(None, 500);
    let mut extra = 0;
    while !clients.iter().all(|c| c.is_finished()) {
        p.publish(&payload(&k2, k2[2]));
        extra += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    for c in clients {
        c.join().expect("a client failed");
    }
    let q2 = json!({"token_ids": plus(&t2, 0), "model_name": "m"});
    let a = post(addr, "/query", q2).json();
    assert!(extra > 0);
    assert_eq!(a["kv_scores"]["0"]["0"], 12, "{a}");
    assert_eq!(a["scores"]["3"]["0"], 12, "{a}");
    println!("480 requests from 8 clients in {:?}", t0.elapsed());
    drop((stall1, stall2));
}
