//! The tiered cache through the C ABI: refusals (NULL, foreign and freed
//! handles, foreign leases, bad configurations, buffers too small, all or
//! nothing), the engine's cycle with the ops replayed, and two handles
//! sharing a store as two engine processes do: the second resumes from
//! what the first wrote, a corrupt object or a store that is down gives
//! misses, counted.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::status::marconi_status;
use marconi::store::*;
use marconi::tiered::*;

mod common;
use common::*;

fn tiered_config(device: &marconi_cache_config, host: u64, store: u64) -> marconi_tiered_config {
    let mut cfg = init(marconi_tiered_config_init);
    cfg.device = device;
    cfg.host.capacity_bytes = if host > 0 { chain(host) } else { 0 };
    cfg.store.capacity_bytes = if store > 0 { chain(store) } else { 0 };
    cfg.store.bandwidth_bytes_per_s = 20e9;
    cfg.store.latency_s = 10e-6;
    cfg
}

fn new_tiered(cfg: &marconi_tiered_config) -> *mut marconi_tiered {
    let mut t = ptr::null_mut();
    // SAFETY: valid config and out pointer.
    ok(unsafe { marconi_tiered_new(cfg, &mut t) });
    t
}

/// A tiered cache of `device`, `host` and `store` tokens of chains (the
/// handle copies its configuration: nothing here outlives the call).
fn tiered_of(device: u64, host: u64, store: u64) -> *mut marconi_tiered {
    new_tiered(&tiered_config(&device_config(device), host, store))
}

fn lookup(
    t: *const marconi_tiered,
    tokens: &[u32],
    store: *const marconi_store,
) -> marconi_tiered_hit {
    let mut out = marconi_tiered_hit::default();
    // SAFETY: valid handle, arrays and out pointer.
    ok(unsafe {
        marconi_tiered_lookup(
            t,
            0,
            tokens.as_ptr(),
            tokens.len(),
            ptr::null(),
            0,
            store,
            &mut out,
        )
    });
    out
}

fn loads(t: *const marconi_tiered, lease: u64) -> Vec<marconi_load_order> {
    let mut n = 0usize;
    // SAFETY: a size query.
    let st = unsafe { marconi_tiered_lease_loads(t, lease, ptr::null_mut(), 0, &mut n) };
    assert!(matches!(
        st,
        marconi_status::Ok | marconi_status::BufferTooSmall
    ));
    let mut v = vec![marconi_load_order::default(); n];
    // SAFETY: v has n elements.
    ok(unsafe { marconi_tiered_lease_loads(t, lease, v.as_mut_ptr(), v.len(), &mut n) });
    v
}

fn plan(t: *const marconi_tiered, lease: u64) -> Vec<u32> {
    let mut n = 0usize;
    let mut v = vec![0u32; 256];
    // SAFETY: v has 256 elements.
    ok(unsafe { marconi_tiered_lease_plan(t, lease, v.as_mut_ptr(), v.len(), &mut n) });
    v.truncate(n);
    v
}

/// Drains the ops: (kind, tier, tokens).
fn drain_ops(t: *const marconi_tiered) -> Vec<(u32, u32, Vec<u32>)> {
    drain_all_tier_ops(marconi_tiered_drain_ops, t)
        .into_iter()
        .map(|(o, tokens)| (o.kind, o.tier, tokens))
        .collect()
}

fn stats(t: *const marconi_tiered) -> marconi_tiered_stats {
    stats_by(marconi_tiered_get_stats, t)
}

/// Chat sessions over a shared system prompt: (input, output) per request.
fn workload(sessions: u32, turns: u32, seed: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let system: Vec<u32> = (0..64).map(|i| 1_000_000 + i).collect();
    let mut hist = vec![system; sessions as usize];
    let mut out = Vec::new();
    for _ in 0..turns {
        for h in hist.iter_mut() {
            let n = 10 + rnd() % 60;
            h.extend((0..n).map(|_| rnd() % 50_000));
            let reply: Vec<u32> = (0..(5 + rnd() % 30)).map(|_| rnd() % 50_000).collect();
            out.push((h.clone(), reply.clone()));
            h.extend(reply);
        }
    }
    out
}

/// The bytes an engine would keep for a chain (here: a digest of it).
fn blob(tokens: &[u32]) -> Vec<u8> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut out = Vec::with_capacity(64);
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    for i in 0..8u64 {
        out.extend_from_slice(&(h ^ i).to_le_bytes());
    }
    out
}

/// An engine over a tiered handle: device slots hold chains, the host
/// copies are a map, the store is a store handle (or none).
struct Engine {
    t: *mut marconi_tiered,
    store: *const marconi_store,
    slots: BTreeMap<u32, Vec<u32>>,
    next_slot: u32,
    host: BTreeMap<Vec<u32>, Vec<u8>>,
    resumed_bytes_checked: u64,
    failures: u64,
    put_failures: u64,
}

impl Engine {
    fn new(t: *mut marconi_tiered, store: *const marconi_store) -> Self {
        Engine {
            t,
            store,
            slots: BTreeMap::new(),
            next_slot: 0,
            host: BTreeMap::new(),
            resumed_bytes_checked: 0,
            failures: 0,
            put_failures: 0,
        }
    }

    /// Reads the chain `tokens` from `tier`; None on a miss.
    fn read(&self, tier: u32, tokens: &[u32]) -> Option<Vec<u8>> {
        if tier == marconi_tier::Host as u32 {
            return self.host.get(tokens).cloned();
        }
        let mut buf = vec![0u8; 4096];
        let (mut len, mut found) = (0usize, 0u32);
        // SAFETY: valid store, tokens and buffers.
        ok(unsafe {
            marconi_store_get_state(
                self.store,
                tokens.as_ptr(),
                tokens.len(),
                tokens.len(),
                buf.as_mut_ptr(),
                buf.len(),
                &mut len,
                &mut found,
            )
        });
        (found == 1).then(|| buf[..len].to_vec())
    }

    /// Serves one request; returns its lookup.
    fn serve(&mut self, input: &[u32], output: &[u32]) -> marconi_tiered_hit {
        let l = lookup(self.t, input, self.store);
        let mut hit = l.hit_tokens;
        if l.tier != marconi_tier::Device as u32 {
            let orders = loads(self.t, l.lease);
            let state = orders.last().unwrap();
            assert_eq!(state.kind, marconi_load_kind::State as u32);
            assert_eq!(state.position, l.hit_tokens);
            let want = &input[..hit as usize];
            match self.read(state.tier, want) {
                Some(b) => {
                    assert_eq!(b, blob(want), "a load returned another chain's bytes");
                    self.resumed_bytes_checked += b.len() as u64;
                }
                None => {
                    // SAFETY: valid handle and lease.
                    ok(unsafe { marconi_tiered_report_load_failure(self.t, l.lease) });
                    self.failures += 1;
                    hit = l.device_hit_tokens;
                }
            }
        } else if hit > 0 {
            assert_eq!(self.slots[&l.device_state_slot], input[..hit as usize]);
        }
        let mut full = input.to_vec();
        full.extend_from_slice(output);
        let mut states = Vec::new();
        for p in plan(self.t, l.lease).into_iter().filter(|&p| p > hit) {
            states.push(self.save(&full[..p as usize]));
        }
        states.push(self.save(&full));
        let mut taken = vec![0u8; states.len()];
        let mut r = marconi_admit_result::default();
        let (f, t) = (marconi_tiered_admit, Some(&mut taken[..]));
        ok(admit_by(
            f,
            self.t,
            l.lease,
            &full,
            &states,
            None::<&[u32]>,
            t,
            &mut r,
        ));
        // SAFETY: valid handle and lease.
        ok(unsafe { marconi_tiered_release(self.t, l.lease) });
        // The ops first: a state the device could not take may go straight
        // to the host, copied from the engine's own slot.
        self.apply_ops();
        for (s, &tk) in states.iter().zip(&taken) {
            if tk == 0 {
                self.slots.remove(&s.slot);
            }
        }
        l
    }

    fn save(&mut self, tokens: &[u32]) -> marconi_saved_state {
        let slot = self.next_slot;
        self.next_slot += 1;
        self.slots.insert(slot, tokens.to_vec());
        marconi_saved_state {
            position: tokens.len() as u32,
            slot,
        }
    }

    fn apply_ops(&mut self) {
        for (kind, tier, tokens) in drain_ops(self.t) {
            let host = tier == marconi_tier::Host as u32;
            if kind == marconi_tier_op_kind::Write as u32 && host {
                assert!(
                    self.slots.values().any(|s| *s == tokens),
                    "a host write of a chain no device slot holds"
                );
                self.host.insert(tokens.clone(), blob(&tokens));
            } else if kind == marconi_tier_op_kind::Write as u32 {
                let b = self
                    .host
                    .get(&tokens)
                    .expect("a store write of a chain the host lacks");
                // SAFETY: valid store, tokens and data.
                let st = unsafe {
                    marconi_store_put_state(
                        self.store,
                        tokens.as_ptr(),
                        tokens.len(),
                        tokens.len(),
                        b.as_ptr(),
                        b.len(),
                    )
                };
                // A store that is down does not take it: a later miss.
                if st != marconi_status::Ok {
                    assert_eq!(st, marconi_status::BackendFailure, "{}", last_error());
                    self.put_failures += 1;
                }
            } else if host {
                assert!(
                    self.host.remove(&tokens).is_some(),
                    "a host drop of a chain never written"
                );
            }
        }
        let mut slots = vec![0u32; 4096];
        let mut pages = vec![0u32; 1];
        let (st, _, ns) =
            drain_freed_by(marconi_tiered_drain_freed, self.t, &mut pages, &mut slots);
        ok(st);
        for s in &slots[..ns] {
            assert!(
                self.slots.remove(s).is_some(),
                "a slot freed twice or never taken"
            );
        }
    }
}

fn dir_store(dir: &std::path::Path) -> *mut marconi_store {
    store_at(marconi_store_backend::Dir, dir.to_str().unwrap())
}

/// A store for "paper-7b test", calls timed out after 200 ms.
fn store_at(backend: marconi_store_backend, location: &str) -> *mut marconi_store {
    common::store_at(backend, location, "paper-7b test", 200, None)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("marconi-tiered-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn the_engine_cycle_keeps_its_copies_in_step_with_the_tiers() {
    let t = tiered_of(300, 900, 0);
    let mut e = Engine::new(t, ptr::null());
    for (input, output) in workload(10, 6, 3) {
        e.serve(&input, &output);
        // SAFETY: valid handle.
        ok(unsafe { marconi_tiered_check(t) });
    }
    let s = stats(t);
    assert!(s.hits_by_tier[1] > 0, "no hit from the host: {s:?}");
    assert!(s.writes[1] > 0);
    assert_eq!(e.failures, 0);
    assert!(e.resumed_bytes_checked > 0);
    assert_eq!(s.requests, 60);
    // SAFETY: from marconi_tiered_new, freed once.
    unsafe { marconi_tiered_free(t) };
}

#[test]
fn a_second_handle_resumes_from_the_shared_store() {
    let dir = temp_dir("shared");
    let store = dir_store(&dir);
    let dev = device_config(300);
    let cfg = tiered_config(&dev, 600, 100_000);
    let reqs = workload(8, 5, 11);

    let a = new_tiered(&cfg);
    let mut ea = Engine::new(a, store);
    for (input, output) in &reqs {
        ea.serve(input, output);
    }
    assert!(stats(a).writes[2] > 0, "A wrote nothing to the store");

    // A handle that needs the KV blocks in the store finds none (this
    // engine's objects are whole chains, its KV is in the state objects).
    let kv_less = new_tiered(&cfg);
    for (input, _) in reqs.iter().rev().take(8) {
        let l = lookup(kv_less, input, store);
        assert_eq!(l.shared, 0);
        // SAFETY: valid handle and lease.
        ok(unsafe { marconi_tiered_release(kv_less, l.lease) });
    }
    assert_eq!(stats(kv_less).shared_hits, 0);

    // B: a fresh handle (another engine process) on the same store.
    let mut cfg_b = cfg;
    cfg_b.store_states_hold_kv = 1;
    let cfg = cfg_b;
    let b = new_tiered(&cfg);
    let mut eb = Engine::new(b, store);
    let mut shared = 0;
    for (input, output) in reqs.iter().rev().take(8) {
        let l = eb.serve(input, output);
        if l.shared == 1 {
            assert_eq!(l.tier, marconi_tier::Store as u32);
            shared += 1;
        }
    }
    assert!(shared > 0, "B never resumed from A's entries");
    let s = stats(b);
    assert_eq!(s.shared_hits, shared);
    assert_eq!(s.store_probe_failures, 0);
    assert_eq!(eb.failures, 0);

    // Every object corrupted: B's probe still finds names, every read is a
    // miss (the envelope's checksum), counted, and B recomputes.
    for f in std::fs::read_dir(&dir).unwrap() {
        let p = f.unwrap().path();
        if p.is_file() {
            let mut bytes = std::fs::read(&p).unwrap();
            let n = bytes.len();
            bytes[n - 1] ^= 0xff;
            std::fs::write(&p, bytes).unwrap();
        }
    }
    let c = new_tiered(&cfg);
    let mut ec = Engine::new(c, store);
    for (input, output) in reqs.iter().rev().take(8) {
        ec.serve(input, output);
    }
    let s = stats(c);
    assert!(ec.failures > 0 && s.load_failures == ec.failures);
    assert_eq!(
        s.shared_hits, s.load_failures,
        "every shared hit was a corrupt object"
    );
    let mut ss = versioned::<marconi_store_stats>();
    // SAFETY: valid store and out.
    ok(unsafe { marconi_store_get_stats(store, &mut ss) });
    assert!(ss.corrupt >= ec.failures, "{ss:?}");

    // SAFETY: handles from their _new, freed once.
    unsafe {
        marconi_tiered_free(a);
        marconi_tiered_free(b);
        marconi_tiered_free(c);
        marconi_store_free(store);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_store_that_is_down_gives_misses_not_errors() {
    // Nothing listens on port 1 of the loopback.
    let store = store_at(marconi_store_backend::Redis, "redis://127.0.0.1:1");
    let t = tiered_of(300, 600, 100_000);
    let mut e = Engine::new(t, store);
    let reqs = workload(4, 3, 5);
    for (input, output) in &reqs {
        e.serve(input, output);
    }
    assert!(e.put_failures > 0, "the workload must write to the store");
    let before = stats(t);
    // What the store tier thinks it holds was never taken: those loads
    // miss, are reported, and the engine recomputes.
    assert_eq!(before.load_failures, e.failures);
    assert_eq!(before.store_probe_failures, before.store_probes);
    let start = std::time::Instant::now();
    let l = lookup(t, &reqs[0].0, store);
    assert!(start.elapsed() < std::time::Duration::from_secs(2));
    // SAFETY: valid handle and lease.
    ok(unsafe { marconi_tiered_release(t, l.lease) });
    let s = stats(t);
    assert_eq!(s.store_probes, before.store_probes + 1);
    assert_eq!(s.store_probe_failures, before.store_probe_failures + 1);
    assert_eq!(l.shared, 0);
    // SAFETY: from their _new, freed once.
    unsafe {
        marconi_tiered_free(t);
        marconi_store_free(store);
    }
}

#[test]
fn bad_configurations_are_refused() {
    let dev = device_config(300);
    let base = tiered_config(&dev, 600, 1_000);
    let refused = |f: &dyn Fn(&mut marconi_tiered_config), want: marconi_status| {
        let mut c = base;
        f(&mut c);
        let mut t = ptr::null_mut();
        // SAFETY: valid pointers (the config may be wrong).
        let st = unsafe { marconi_tiered_new(&c, &mut t) };
        assert_eq!(st, want, "{}", last_error());
        assert!(t.is_null(), "nothing is written on failure");
    };
    refused(&|c| c.device = ptr::null(), marconi_status::NullArgument);
    refused(&|c| c.write_mode = 7, marconi_status::InvalidConfig);
    refused(
        &|c| c.host.capacity_bytes = 0,
        marconi_status::InvalidConfig,
    );
    refused(
        &|c| c.host.bandwidth_bytes_per_s = f64::NAN,
        marconi_status::InvalidConfig,
    );
    refused(
        &|c| c.store.bandwidth_bytes_per_s = 0.0,
        marconi_status::InvalidConfig,
    );
    refused(&|c| c.store.latency_s = -1.0, marconi_status::InvalidConfig);
    refused(
        &|c| c.compute_flops = f64::INFINITY,
        marconi_status::InvalidConfig,
    );
    refused(&|c| c.promote = 2, marconi_status::InvalidConfig);
    refused(
        &|c| c.store_states_hold_kv = 9,
        marconi_status::InvalidConfig,
    );
    refused(&|c| c.max_store_probe = 0, marconi_status::InvalidConfig);
    refused(&|c| c.exclusive = 2, marconi_status::InvalidConfig);
    // A struct of the first version (it ends before `exclusive`) is read,
    // with exclusive tiers; one cut inside that version is refused.
    let first = std::mem::offset_of!(marconi_tiered_config, exclusive);
    let mut older = base;
    older.struct_size = first as u32;
    older.exclusive = 7; // past the caller's struct: never read
    let mut t = ptr::null_mut();
    // SAFETY: valid pointers; the struct is whole.
    ok(unsafe { marconi_tiered_new(&older, &mut t) });
    // SAFETY: a live handle.
    unsafe { marconi_tiered_free(t) };
    refused(
        &|c| c.struct_size = first as u32 - 4,
        marconi_status::UnsupportedStructSize,
    );
    refused(
        &|c| c.struct_size = 8,
        marconi_status::UnsupportedStructSize,
    );
    let mut zd = dev;
    zd.capacity_bytes = 0;
    refused(&|c| c.device = &zd, marconi_status::InvalidConfig);

    let mut t = ptr::null_mut();
    // SAFETY: NULL config.
    assert_eq!(
        unsafe { marconi_tiered_new(ptr::null(), &mut t) },
        marconi_status::NullArgument
    );
    // SAFETY: NULL out.
    assert_eq!(
        unsafe { marconi_tiered_new(&base, ptr::null_mut()) },
        marconi_status::NullArgument
    );
    let mut small = MaybeUninit::<[u64; 2]>::uninit();
    // SAFETY: 16 writable bytes, refused as too small before any write.
    assert_eq!(
        unsafe { marconi_tiered_config_init(small.as_mut_ptr().cast(), 16) },
        marconi_status::UnsupportedStructSize
    );
    // SAFETY: NULL.
    assert_eq!(
        unsafe { marconi_tiered_config_init(ptr::null_mut(), 64) },
        marconi_status::NullArgument
    );
}

#[test]
fn bad_calls_are_refused_and_change_nothing() {
    let t = tiered_of(300, 600, 0);
    let other = tiered_of(300, 600, 0);
    let input: Vec<u32> = (0..50).collect();
    let mut out = marconi_tiered_hit::default();

    // SAFETY (this block): every call is given NULL, a foreign pointer of
    // at least 8 readable bytes, or valid pointers with bad values.
    unsafe {
        // A foreign pointer: not a tiered handle (here, a store config's memory).
        let foreign = [0u64; 16];
        let fake = foreign.as_ptr().cast::<marconi_tiered>();
        let toks = input.as_ptr();
        let hit: *mut marconi_tiered_hit = &mut out;
        let null = ptr::null::<u32>();
        let no_store = ptr::null::<marconi_store>();
        let foreign_store = foreign.as_ptr().cast::<marconi_store>();
        let t_c: *const marconi_tiered = t;
        // (what, handle, tokens, n_tokens, n_checkpoints (NULL array), store, out)
        type Case<'a> = (
            &'a str,
            *const marconi_tiered,
            *const u32,
            usize,
            usize,
            *const marconi_store,
            *mut marconi_tiered_hit,
        );
        let null_arg = marconi_status::NullArgument;
        let invalid = marconi_status::InvalidArgument;
        let cases: [(Case, marconi_status); 8] = [
            (
                ("NULL handle", ptr::null(), toks, 50, 0, no_store, hit),
                null_arg,
            ),
            (("NULL tokens", t_c, null, 50, 0, no_store, hit), null_arg),
            (
                ("NULL checkpoints, 3", t_c, toks, 50, 3, no_store, hit),
                null_arg,
            ),
            (
                ("NULL out", t_c, toks, 50, 0, no_store, ptr::null_mut()),
                null_arg,
            ),
            (
                ("0 tokens", t_c, toks, 0, 0, no_store, hit),
                marconi_status::EmptyTokens,
            ),
            (
                (
                    "2^32 - 1 tokens",
                    t_c,
                    toks,
                    u32::MAX as usize,
                    0,
                    no_store,
                    hit,
                ),
                marconi_status::TooManyTokens,
            ),
            (
                ("a foreign handle", fake, toks, 50, 0, no_store, hit),
                invalid,
            ),
            (
                ("a foreign store", t_c, toks, 50, 0, foreign_store, hit),
                invalid,
            ),
        ];
        for ((what, h, tokens, n, n_cp, store, out), want) in cases {
            let st = marconi_tiered_lookup(h, 0, tokens, n, ptr::null(), n_cp, store, out);
            assert_eq!(st, want, "{what}");
        }
        marconi_tiered_free(fake.cast_mut());
        assert_eq!(
            foreign, [0u64; 16],
            "a foreign pointer is not freed or written"
        );
        assert_eq!(stats(t).requests, 0, "a refused lookup counts nothing");

        let l = lookup(t, &input, ptr::null());
        // Another handle's lease, a made-up lease.
        assert_eq!(
            marconi_tiered_release(other, l.lease),
            marconi_status::UnknownLease
        );
        assert_eq!(
            marconi_tiered_release(t, l.lease ^ 1),
            marconi_status::UnknownLease
        );
        assert_eq!(
            marconi_tiered_report_load_failure(other, l.lease),
            marconi_status::UnknownLease
        );
        let mut n = 0usize;
        assert_eq!(
            marconi_tiered_lease_plan(other, l.lease, ptr::null_mut(), 0, &mut n),
            marconi_status::UnknownLease
        );
        assert_eq!(
            marconi_tiered_lease_plan(t, l.lease, ptr::null_mut(), 4, &mut n),
            marconi_status::NullArgument
        );
        // A state position never planned: refused, nothing admitted.
        let bad = [marconi_saved_state {
            position: 7,
            slot: 1,
        }];
        let mut r = marconi_admit_result::default();
        assert_ne!(
            marconi_tiered_admit(
                t,
                l.lease,
                input.as_ptr(),
                50,
                bad.as_ptr(),
                1,
                ptr::null(),
                0,
                ptr::null_mut(),
                &mut r
            ),
            marconi_status::Ok
        );
        assert_eq!(stats(t).used_bytes[0], 0);
        ok(marconi_tiered_release(t, l.lease));
        // Released twice.
        assert_eq!(
            marconi_tiered_release(t, l.lease),
            marconi_status::UnknownLease
        );

        // Stats: too small a struct_size, NULL.
        let mut s = marconi_tiered_stats {
            struct_size: 8,
            ..Default::default()
        };
        assert_eq!(
            marconi_tiered_get_stats(t, &mut s),
            marconi_status::UnsupportedStructSize
        );
        assert_eq!(
            marconi_tiered_get_stats(t, ptr::null_mut()),
            marconi_status::NullArgument
        );
        // An older caller's shorter struct: only its bytes are written.
        let mut old = [0u64; 3];
        old[0] = 24;
        ok(marconi_tiered_get_stats(t, old.as_mut_ptr().cast()));
        assert_eq!(old[1], 1, "requests");
        assert_eq!(old[2], 50, "input tokens");

        // Drain: all or nothing.
        let (mut no, mut nt) = (0usize, 0usize);
        assert_eq!(
            marconi_tiered_drain_ops(t, ptr::null_mut(), 1, &mut no, ptr::null_mut(), 0, &mut nt),
            marconi_status::NullArgument
        );
        ok(marconi_tiered_settle(t));
        ok(marconi_tiered_check(t));

        marconi_tiered_free(t);
        marconi_tiered_free(other);
        marconi_tiered_free(ptr::null_mut());
    }
}

#[test]
fn a_drain_too_small_drains_nothing() {
    let t = tiered_of(200, 900, 0);
    let mut e = Engine::new(t, ptr::null());
    // Serve without draining, until ops are pending.
    let reqs = workload(6, 4, 9);
    let mut pending = (0usize, 0usize);
    for (input, output) in &reqs {
        let l = lookup(t, input, ptr::null());
        let mut full = input.clone();
        full.extend_from_slice(output);
        let st = [e.save(&full)];
        let mut r = marconi_admit_result::default();
        let f = marconi_tiered_admit;
        ok(admit_by(
            f,
            t,
            l.lease,
            &full,
            &st,
            None::<&[u32]>,
            None,
            &mut r,
        ));
        // SAFETY: valid handle and lease.
        ok(unsafe { marconi_tiered_release(t, l.lease) });
        // A size query.
        let (s, no, nt) = drain_tier_ops(marconi_tiered_drain_ops, t, &mut [], &mut []);
        pending = (no, nt);
        if pending.0 > 1 {
            assert_eq!(s, marconi_status::BufferTooSmall);
            break;
        }
    }
    assert!(pending.0 > 1, "the workload must demote");
    // Room for the ops but one token short: nothing drained.
    let mut ops = vec![marconi_tier_op::default(); pending.0];
    let mut toks = vec![0u32; pending.1 - 1];
    let (s, no, nt) = drain_tier_ops(marconi_tiered_drain_ops, t, &mut ops, &mut toks);
    assert_eq!(s, marconi_status::BufferTooSmall);
    assert_eq!((no, nt), pending);
    assert_eq!(drain_ops(t).len(), pending.0, "nothing was lost");
    assert!(drain_ops(t).is_empty());
    // SAFETY: from marconi_tiered_new.
    unsafe { marconi_tiered_free(t) };
}
