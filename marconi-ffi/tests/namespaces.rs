//! Namespaces never meet in a shared store: a state another engine process
//! wrote for namespace 1 is never the hit of a lookup in namespace 2 (the
//! store probe of marconi_tiered_lookup and the store keys both carry the
//! namespace), over one directory store shared by two processes, and over
//! one Redis shared by two handles when a server binary is on PATH.
//!
//! The writer runs in a child process: this test binary started again with
//! MARCONI_NS_WRITER set, running only `namespaces_writer_child`.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::process::Command;
use std::ptr;

use marconi::config::*;
use marconi::store::*;
use marconi::tiered::*;

const WRITER_ENV: &str = "MARCONI_NS_WRITER";
/// The input both engines serve, and where the writer saved a state.
const LEN: u32 = 64;
const AT: usize = 48;

mod common;
use common::*;

fn input() -> Vec<u32> {
    (0..LEN).map(|i| 7_000 + i * 3).collect()
}

/// A store for "paper-7b namespaces", 500 ms to connect and for a call.
fn store_at(backend: marconi_store_backend, location: &str) -> *mut marconi_store {
    common::store_at(backend, location, "paper-7b namespaces", 500, Some(500))
}

/// A tiered cache with a store tier whose state objects carry their KV
/// (so a probed state needs no KV blocks).
fn tiered() -> (*mut marconi_tiered, Box<marconi_cache_config>) {
    let mut dev = Box::new(init(marconi_cache_config_init));
    dev.capacity_bytes = chain(300);
    let mut cfg = init(marconi_tiered_config_init);
    cfg.device = &*dev;
    cfg.host.capacity_bytes = chain(600);
    cfg.store.capacity_bytes = chain(100_000);
    cfg.store.bandwidth_bytes_per_s = 20e9;
    cfg.store.latency_s = 10e-6;
    cfg.store_states_hold_kv = 1;
    let mut t = ptr::null_mut();
    // SAFETY: valid config and out.
    ok(unsafe { marconi_tiered_new(&cfg, &mut t) });
    (t, dev)
}

/// (hit tokens, shared) of a lookup of the input in `ns` probing `store`.
fn probe(t: *const marconi_tiered, ns: u64, store: *const marconi_store) -> (u32, u32) {
    let tokens = input();
    let mut out = marconi_tiered_hit::default();
    // SAFETY: valid handles, arrays and out.
    ok(unsafe {
        marconi_tiered_lookup(
            t,
            ns,
            tokens.as_ptr(),
            tokens.len(),
            ptr::null(),
            0,
            store,
            &mut out,
        )
    });
    // SAFETY: a lease of this handle.
    ok(unsafe { marconi_tiered_release(t, out.lease) });
    (out.hit_tokens, out.shared)
}

fn found(store: *const marconi_store, ns: Option<u64>) -> bool {
    let tokens = input();
    let mut buf = vec![0u8; 4096];
    let (mut len, mut found) = (0usize, 0u32);
    let (toks, n, out, cap) = (tokens.as_ptr(), tokens.len(), buf.as_mut_ptr(), buf.len());
    // SAFETY: valid handle, arrays and outs.
    ok(unsafe {
        match ns {
            None => marconi_store_get_state(store, toks, n, AT, out, cap, &mut len, &mut found),
            Some(ns) => {
                marconi_store_get_state_ns(store, ns, toks, n, AT, out, cap, &mut len, &mut found)
            }
        }
    });
    if found == 1 {
        assert!(
            buf[..len] == state_bytes(ns)[..],
            "ns {ns:?} read another namespace's value"
        );
    }
    found == 1
}

/// The value written in `ns` (None: the handle's configured ns, 0).
fn state_bytes(ns: Option<u64>) -> Vec<u8> {
    let tag = match ns.unwrap_or(0) {
        0 => 0xAA,
        n => n as u8,
    };
    vec![tag; 1000]
}

/// What the writer process does: the state after input[..AT], written
/// with the plain call (the handle's configured ns, 0) and in namespace 1.
fn write_states(store: *const marconi_store) {
    let tokens = input();
    for ns in [None, Some(1u64)] {
        let v = state_bytes(ns);
        // SAFETY: valid handle and arrays.
        ok(unsafe {
            match ns {
                None => marconi_store_put_state(
                    store,
                    tokens.as_ptr(),
                    tokens.len(),
                    AT,
                    v.as_ptr(),
                    v.len(),
                ),
                Some(ns) => marconi_store_put_state_ns(
                    store,
                    ns,
                    tokens.as_ptr(),
                    tokens.len(),
                    AT,
                    v.as_ptr(),
                    v.len(),
                ),
            }
        });
    }
}

/// What the reader checks: each namespace sees its own state and no other.
fn check_isolation(store: *const marconi_store) {
    assert!(found(store, None), "the plain call reads the plain write");
    assert!(found(store, Some(0)), "ns 0 is the handle's configured ns");
    assert!(found(store, Some(1)));
    assert!(
        !found(store, Some(2)),
        "namespace 2 reads namespace 1's state"
    );
    let (t, _dev) = tiered();
    assert_eq!(
        probe(t, 1, store),
        (AT as u32, 1),
        "ns 1 resumes from its own state"
    );
    assert_eq!(
        probe(t, 0, store),
        (AT as u32, 1),
        "ns 0 resumes from its own state"
    );
    assert_eq!(
        probe(t, 2, store),
        (0, 0),
        "a lookup in namespace 2 resumed from another namespace's state"
    );
    assert_eq!(probe(t, 3, store), (0, 0));
    // SAFETY: from marconi_tiered_new, freed once.
    unsafe { marconi_tiered_free(t) };
}

#[test]
fn namespaces_writer_child() {
    let Ok(dir) = std::env::var(WRITER_ENV) else {
        return; // only in the child process
    };
    let s = store_at(marconi_store_backend::Dir, &dir);
    write_states(s);
    // SAFETY: from marconi_store_new, freed once.
    unsafe { marconi_store_free(s) };
}

#[test]
fn two_processes_on_one_directory_store_keep_namespaces_apart() {
    let dir = std::env::temp_dir().join(format!("marconi-ns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "namespaces_writer_child", "--test-threads=1"])
        .env(WRITER_ENV, &dir)
        .status()
        .unwrap();
    assert!(status.success(), "the writer process failed");
    assert!(
        std::fs::read_dir(&dir).unwrap().count() >= 2,
        "the writer wrote nothing"
    );
    let s = store_at(marconi_store_backend::Dir, dir.to_str().unwrap());
    check_isolation(s);
    // SAFETY: from marconi_store_new, freed once.
    unsafe { marconi_store_free(s) };
    let _ = std::fs::remove_dir_all(&dir);
}

/// A redis-server (or valkey-server) on 127.0.0.1, killed on drop.
struct Redis(std::process::Child, u16, std::path::PathBuf);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.2);
    }
}

fn redis_or_skip() -> Option<Redis> {
    let bin = std::env::var_os("MARCONI_REDIS_SERVER")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            let path = std::env::var_os("PATH")?;
            std::env::split_paths(&path)
                .flat_map(|d| ["redis-server", "valkey-server"].map(|n| d.join(n)))
                .find(|p| p.is_file())
        });
    let Some(bin) = bin else {
        assert!(
            std::env::var("MARCONI_STORE_STRICT").as_deref() != Ok("1"),
            "no redis-server or valkey-server on PATH and MARCONI_STORE_STRICT=1"
        );
        eprintln!("SKIPPED: no redis-server or valkey-server on PATH");
        return None;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("marconi-ns-redis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let child = Command::new(bin)
        .args([
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let r = Redis(child, port, dir);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < until,
            "redis-server did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Some(r)
}

#[test]
fn two_handles_on_one_redis_keep_namespaces_apart() {
    let Some(r) = redis_or_skip() else {
        return;
    };
    let url = format!("redis://127.0.0.1:{}/", r.1);
    let writer = store_at(marconi_store_backend::Redis, &url);
    write_states(writer);
    let reader = store_at(marconi_store_backend::Redis, &url);
    check_isolation(reader);
    // SAFETY: from marconi_store_new, each freed once.
    unsafe {
        marconi_store_free(writer);
        marconi_store_free(reader);
    }
}
