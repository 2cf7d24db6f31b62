//! Redis/Valkey under the fault contract, against a real redis-server this
//! test starts on 127.0.0.1 (skipped with a message when the binary is
//! absent, failed instead when MARCONI_STORE_STRICT=1), plus what only a
//! network store does wrong: down, killed mid-run, restarted empty, slow,
//! hung.

mod common;

use std::time::{Duration, Instant};

use common::{
    assert_miss, fault_contract, free_port, server_or_skip, tokens, value, Server, Silent,
};
use marconi_store::{KeyerConfig, MissKind, RedisConfig, RedisStore, StoreTier, TierConfig};

const TIMEOUT: Duration = Duration::from_millis(100);
/// What a call may take at most: its timeouts (connect, then one read or
/// write) and scheduling slack on a loaded 2-core machine.
const BOUND: Duration = Duration::from_millis(800);

fn tier(url: &str, f: impl FnOnce(&mut TierConfig)) -> StoreTier {
    let mut rc = RedisConfig::new(url);
    rc.timeout = TIMEOUT;
    rc.connect_timeout = TIMEOUT;
    rc.backoff = Duration::from_millis(50);
    rc.max_backoff = Duration::from_millis(200);
    let mut c = TierConfig::new("model-a", 8);
    c.max_value_bytes = 1 << 20;
    f(&mut c);
    StoreTier::new(Box::new(RedisStore::new(rc).unwrap()), c).unwrap()
}

/// Runs `f` and asserts it took less than [`BOUND`].
fn bounded<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let r = f();
    let took = start.elapsed();
    assert!(took < BOUND, "{what} took {took:?}");
    r
}

#[test]
fn redis_store_keeps_the_fault_contract() {
    let Some(bin) = server_or_skip("redis_store_keeps_the_fault_contract") else {
        return;
    };
    let s = Server::start(&bin);
    let url = s.url();
    fault_contract(
        &tier(&url, |_| {}),
        &tier(&url, |_| {}),
        &tier(&url, |c| c.keyer = KeyerConfig::new("model-b", 8)),
        &tier(&url, |c| c.keyer.layout_version = 2),
    );
}

#[test]
fn a_store_never_started_gives_quick_misses() {
    let url = format!("redis://127.0.0.1:{}/", free_port());
    let a = tier(&url, |_| {});
    let t = tokens(16, 1);
    for _ in 0..20 {
        let l = bounded("get", || a.get_state(&t, 8).unwrap());
        assert_miss(&l, MissKind::Unavailable, "nothing listens");
        assert!(bounded("put", || a.put_state(&t, 8, &value(10, 0))).is_err());
        assert_eq!(bounded("prefix", || a.kv_prefix(&t)), 0);
    }
    let s = a.stats();
    assert_eq!((s.unavailable, s.hits, s.put_failures), (20 + 20, 0, 20));
}

#[test]
fn killed_mid_run_then_restarted_empty() {
    let Some(bin) = server_or_skip("killed_mid_run_then_restarted_empty") else {
        return;
    };
    let mut s = Server::start(&bin);
    let a = tier(&s.url(), |_| {});
    let t = tokens(40, 3);
    let v = value(200_000, 1);
    a.put_state(&t, 33, &v).unwrap();
    assert!(matches!(
        a.get_state(&t, 33).unwrap(),
        marconi_store::Lookup::Hit(_)
    ));
    s.kill();
    // The pooled connection is dead: a miss within the bound, then quick
    // misses while the backoff lasts.
    for _ in 0..10 {
        let l = bounded("get after kill", || a.get_state(&t, 33).unwrap());
        assert!(
            matches!(
                l,
                marconi_store::Lookup::Miss(MissKind::Unavailable | MissKind::Timeout)
            ),
            "{l:?}"
        );
    }
    s.restart_empty();
    // Reconnects once the backoff (at most 200 ms) is over: bounded wait.
    let start = Instant::now();
    let l = loop {
        let l = bounded("get after restart", || a.get_state(&t, 33).unwrap());
        if l != marconi_store::Lookup::Miss(MissKind::Unavailable)
            || start.elapsed() > Duration::from_secs(5)
        {
            break l;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_miss(&l, MissKind::Absent, "restarted empty");
    a.put_state(&t, 33, &v).unwrap();
    assert!(
        matches!(a.get_state(&t, 33).unwrap(), marconi_store::Lookup::Hit(p) if p[..] == v[..])
    );
}

#[test]
fn a_slow_store_times_out_into_misses() {
    let Some(bin) = server_or_skip("a_slow_store_times_out_into_misses") else {
        return;
    };
    let s = Server::start(&bin);
    let a = tier(&s.url(), |_| {});
    let t = tokens(16, 4);
    a.put_state(&t, 8, &value(1000, 1)).unwrap();
    // The server sleeps 1.5 s in one command (it is single-threaded).
    let mut con = s.connection();
    let sleeper = std::thread::spawn(move || {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(1.5)
            .query::<()>(&mut con)
    });
    std::thread::sleep(Duration::from_millis(100));
    let l = bounded("get while the server sleeps", || {
        a.get_state(&t, 8).unwrap()
    });
    assert_miss(&l, MissKind::Timeout, "slow");
    // Then the backoff: quick misses, no waiting on the server.
    let l = bounded("get in backoff", || a.get_state(&t, 8).unwrap());
    assert!(matches!(
        l,
        marconi_store::Lookup::Miss(MissKind::Unavailable | MissKind::Timeout)
    ));
    sleeper.join().unwrap().unwrap();
    // Recovered (bounded wait for the backoff).
    let start = Instant::now();
    while !matches!(a.get_state(&t, 8).unwrap(), marconi_store::Lookup::Hit(_)) {
        assert!(start.elapsed() < Duration::from_secs(5), "never recovered");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(a.stats().timeout >= 1);
}

#[test]
fn a_socket_that_never_answers_times_out_into_misses() {
    let silent = Silent::start();
    let a = tier(&format!("redis://127.0.0.1:{}/", silent.port), |_| {});
    let t = tokens(16, 4);
    for _ in 0..5 {
        let l = bounded("get from a silent socket", || a.get_state(&t, 8).unwrap());
        assert!(
            matches!(
                l,
                marconi_store::Lookup::Miss(MissKind::Timeout | MissKind::Unavailable)
            ),
            "{l:?}"
        );
        assert!(bounded("put to a silent socket", || a.put_state(
            &t,
            8,
            &value(10, 1)
        ))
        .is_err());
        std::thread::sleep(Duration::from_millis(60));
    }
    assert!(a.stats().timeout >= 1, "{:?}", a.stats());
}

#[test]
fn another_redis_type_under_a_key_is_a_miss() {
    let Some(bin) = server_or_skip("another_redis_type_under_a_key_is_a_miss") else {
        return;
    };
    let s = Server::start(&bin);
    let a = tier(&s.url(), |_| {});
    let t = tokens(16, 4);
    let name = a.name(&a.keyer().state_key(&t, 8).unwrap());
    let mut con = s.connection();
    redis::cmd("LPUSH")
        .arg(&name)
        .arg("x")
        .query::<i64>(&mut con)
        .unwrap();
    assert_miss(&a.get_state(&t, 8).unwrap(), MissKind::Failed, "a list");
    // The store is still usable for other keys.
    a.put_state(&t, 9, &value(10, 1)).unwrap();
    assert!(matches!(
        a.get_state(&t, 9).unwrap(),
        marconi_store::Lookup::Hit(_)
    ));
}
