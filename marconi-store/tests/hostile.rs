//! A hostile Redis on 127.0.0.1, started by each test: it trickles its
//! reply one byte every 20 ms, answers garbage, stalls after accepting, or
//! announces a value far larger than asked for. Every call must return
//! (a miss, or a refused write) within its timeout as a whole, plus the
//! connect timeout and scheduling slack, and never allocate what the
//! server announces.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use marconi_store::{Lookup, MissKind, RedisConfig, RedisStore, StoreTier, TierConfig};

const TIMEOUT: Duration = Duration::from_millis(50);
/// Connect timeout + call timeout + slack on a loaded 2-core machine.
const BOUND: Duration = Duration::from_millis(600);
/// How long a hostile server keeps one connection going at most (what a
/// call bounded per read only would take).
const SERVER_LIFETIME: Duration = Duration::from_secs(4);

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// A valid bulk header, then one byte every 20 ms.
    Trickle,
    /// Bytes that are no reply at all, as fast as it can.
    Garbage,
    /// Reads the request and never answers.
    Stall,
    /// Announces a 64 GB bulk string, then sends bytes as fast as it can.
    Oversized,
    /// An integer reply, one digit every 20 ms, never finished.
    TrickleLine,
}

/// The server: accepts until dropped; each connection runs `mode` for at
/// most [`SERVER_LIFETIME`].
struct Hostile {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Hostile {
    fn start(mode: Mode) -> Hostile {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let port = l.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut conns = Vec::new();
            let until = Instant::now() + Duration::from_secs(30);
            while !s.load(Ordering::Relaxed) && Instant::now() < until {
                match l.accept() {
                    Ok((c, _)) => {
                        let s2 = Arc::clone(&s);
                        conns.push(std::thread::spawn(move || serve(c, mode, &s2)));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            for c in conns {
                let _ = c.join();
            }
        });
        Hostile {
            port,
            stop,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(mut c: TcpStream, mode: Mode, stop: &AtomicBool) {
    let start = Instant::now();
    let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
    let _ = c.set_write_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0u8; 4096];
    // The request (whatever it is).
    let _ = c.read(&mut buf);
    let live = || !stop.load(Ordering::Relaxed) && start.elapsed() < SERVER_LIFETIME;
    match mode {
        Mode::Trickle | Mode::TrickleLine => {
            let head: &[u8] = if matches!(mode, Mode::Trickle) {
                b"$100000\r\n"
            } else {
                b":"
            };
            if c.write_all(head).is_err() {
                return;
            }
            while live() {
                if c.write_all(b"1").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Mode::Garbage => {
            let mut x: u32 = 0x9e37_79b9;
            let mut junk = [0u8; 1024];
            while live() {
                for b in junk.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    *b = x as u8;
                }
                // Never a valid reply type first.
                junk[0] = b'?';
                if c.write_all(&junk).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Mode::Stall => {
            while live() {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Mode::Oversized => {
            if c.write_all(b"$64000000000\r\n").is_err() {
                return;
            }
            let chunk = [b'x'; 64 * 1024];
            while live() {
                if c.write_all(&chunk).is_err() {
                    return;
                }
            }
        }
    }
}

fn tier(url: &str) -> StoreTier {
    let mut rc = RedisConfig::new(url);
    rc.timeout = TIMEOUT;
    rc.connect_timeout = TIMEOUT;
    // No backoff between the calls: every call meets the server again.
    rc.backoff = Duration::from_millis(1);
    rc.max_backoff = Duration::from_millis(1);
    let mut c = TierConfig::new("model-a", 8);
    c.max_value_bytes = 1 << 20;
    StoreTier::new(Box::new(RedisStore::new(rc).unwrap()), c).unwrap()
}

fn bounded<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let r = f();
    let took = start.elapsed();
    assert!(took < BOUND, "{what} took {took:?} (timeout {TIMEOUT:?})");
    r
}

fn check(mode: Mode) {
    let server = Hostile::start(mode);
    let t = tier(&server.url());
    let tokens: Vec<u32> = (0..64).collect();
    for round in 0..3 {
        let what = format!("{mode:?} round {round}");
        std::thread::sleep(Duration::from_millis(5));
        let l = bounded(&format!("{what}: get_state"), || {
            t.get_state(&tokens, 16).unwrap()
        });
        assert!(matches!(l, Lookup::Miss(_)), "{what}: {l:?}");
        std::thread::sleep(Duration::from_millis(5));
        let e = bounded(&format!("{what}: states_exist"), || {
            t.states_exist(&tokens, &[8, 16, 32])
        });
        assert!(e.is_none() || e == Some(vec![false; 3]), "{what}: {e:?}");
        std::thread::sleep(Duration::from_millis(5));
        let got = bounded(&format!("{what}: get_kv"), || {
            t.get_kv(&tokens, 0, 8, Some(1000)).unwrap()
        });
        assert!(got.is_empty(), "{what}");
        std::thread::sleep(Duration::from_millis(5));
        bounded(&format!("{what}: put_state"), || {
            t.put_state(&tokens, 16, &[7u8; 100])
        })
        .expect_err("a hostile server takes no write");
    }
    let s = t.stats();
    assert_eq!(s.hits, 0);
    if matches!(mode, Mode::Trickle | Mode::Stall | Mode::TrickleLine) {
        assert!(s.miss(MissKind::Timeout) > 0, "{mode:?}: {s:?}");
    }
}

#[test]
fn a_trickling_server_costs_one_timeout_per_call() {
    check(Mode::Trickle);
}

#[test]
fn a_reply_line_trickled_forever_costs_one_timeout() {
    check(Mode::TrickleLine);
}

#[test]
fn garbage_is_a_miss() {
    check(Mode::Garbage);
}

#[test]
fn a_stalled_server_costs_one_timeout_per_call() {
    check(Mode::Stall);
}

#[test]
fn an_announced_huge_value_is_refused_unread() {
    check(Mode::Oversized);
}
