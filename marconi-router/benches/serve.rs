//! `/query` latency of `marconi-router serve` over HTTP on 127.0.0.1, one
//! kept-open connection, with 1, 20, 64 and 200 workers registered: every
//! worker of the queried index holds the request's blocks and a state, so
//! every one scores and is listed (the largest answer). An index holds at
//! most 64 workers, so at 200 the queried index has 64 and three other
//! routing groups of the model hold the other 136.
//!
//! `cargo bench -p marconi-router --bench serve` prints, per worker count,
//! the answer's size and p50 / p99 / max of `MARCONI_BENCH_QUERIES`
//! (default 2000) queries of 1,024 tokens timed one by one, from the first
//! byte sent to the last byte read.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
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

    /// POSTs `body`; the status and body of the answer.
    fn post(&mut self, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let mut req = head.into_bytes();
        req.extend_from_slice(body);
        self.w.write_all(&req).expect("send");
        let mut line = String::new();
        self.r.read_line(&mut line).expect("status");
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut len = 0;
        loop {
            line.clear();
            self.r.read_line(&mut line).expect("header");
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut b = vec![0; len];
        self.r.read_exact(&mut b).expect("body");
        (status, b)
    }
}

fn key(b: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(b, s).expect("vec");
}

/// One batch: the KV blocks `kv` (group 0) and a state at the end of block
/// `state` (group 1), 16-token blocks.
fn payload(kv: &[u64], state: u64) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 3).expect("vec");
    rmp::encode::write_f64(&mut b, 1.0).expect("vec");
    rmp::encode::write_array_len(&mut b, 2).expect("vec");
    for (hashes, group) in [(kv, 0u64), (&[state][..], 1)] {
        rmp::encode::write_map_len(&mut b, 5).expect("vec");
        key(&mut b, "type");
        key(&mut b, "BlockStored");
        key(&mut b, "block_hashes");
        rmp::encode::write_array_len(&mut b, hashes.len() as u32).expect("vec");
        for &h in hashes {
            rmp::encode::write_uint(&mut b, h).expect("vec");
        }
        key(&mut b, "block_size");
        rmp::encode::write_uint(&mut b, 16).expect("vec");
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

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn run(workers: usize, queries: usize) {
    let server = Server::bind("127.0.0.1:0", ServeConfig::default()).expect("bind");
    let addr = server.local_addr();
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).expect("PUB");
    let ep = format!("tcp://127.0.0.1:{}", port());
    publisher.bind(&ep).expect("bind");
    let mut admin = Conn::new(addr);
    for i in 0..workers {
        let group = if i < 64 {
            "default".to_string()
        } else {
            format!("g{}", i / 64)
        };
        let r = json!({"instance_id": i, "endpoint": ep, "model_name": "m", "block_size": 16,
                       "routing_group": group});
        let (st, body) = admin.post("/register", r.to_string().as_bytes());
        assert_eq!(st, 201, "{}", String::from_utf8_lossy(&body));
    }
    let hasher = ChainHasher::new(DEFAULT_SEED, 16);
    let tokens: Vec<u32> = (0..1024).collect();
    let mut kv = Vec::new();
    hasher.wire_hashes_keyed(&tokens, &RequestKeys::default(), &mut kv);
    let batch = payload(&kv, kv[kv.len() - 2]);
    let query = json!({"token_ids": tokens, "model_name": "m"}).to_string();
    let scoring = workers.min(64);
    let mut conn = Conn::new(addr);
    let end = Instant::now() + Duration::from_secs(30);
    let mut seq = 0u64;
    let size = loop {
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes(), &batch], 0)
            .expect("publish");
        seq += 1;
        let (st, body) = conn.post("/query", query.as_bytes());
        assert_eq!(st, 200);
        let v: Value = serde_json::from_slice(&body).expect("json");
        if v["scores"].as_object().map(|m| m.len()) == Some(scoring) {
            break body.len();
        }
        assert!(Instant::now() < end, "the stream never reached the index");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut t = Vec::with_capacity(queries);
    for _ in 0..queries {
        let t0 = Instant::now();
        let (st, _) = conn.post("/query", query.as_bytes());
        t.push(t0.elapsed());
        assert_eq!(st, 200);
    }
    let (p50, p99) = (pct(&mut t, 0.5), pct(&mut t, 0.99));
    let max = *t.last().expect("timed");
    println!(
        "{workers:>7} {scoring:>8} {size:>8} {:>9.3} {:>9.3} {:>9.3}",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3
    );
    server.stop();
}

fn main() {
    let queries: usize = std::env::var("MARCONI_BENCH_QUERIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    // `cargo bench` passes `--bench`; `cargo test --benches` runs a smoke.
    let queries = if std::env::args().any(|a| a == "--bench") {
        queries
    } else {
        20
    };
    println!(
        "/query of 1,024 tokens (64 blocks of 16), one kept-open connection, {queries} queries"
    );
    println!("workers  scoring   answer   p50 ms    p99 ms    max ms");
    for w in [1, 20, 64, 200] {
        run(w, queries);
    }
}
