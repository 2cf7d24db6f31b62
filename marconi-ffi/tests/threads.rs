//! Several engine threads share one cache handle through the C ABI; the
//! request cycle keeps its invariants and every id handed over comes back
//! at most once.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::collections::HashSet;
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use marconi::cache::*;
use marconi::config::*;
use marconi::status::marconi_status;

const PAGE: u32 = 16;

/// A raw handle shared between threads (the ABI documents it as thread-safe).
#[derive(Clone, Copy)]
struct Shared(*mut marconi_cache);
// SAFETY: marconi_cache is internally locked; the ABI allows concurrent calls.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// The handle (a method, so closures capture the whole `Shared`).
    fn get(self) -> *const marconi_cache {
        self.0
    }
}

mod common;
use common::*;

/// A cache of `capacity` bytes over pages of PAGE tokens.
fn cache_of(capacity: u64) -> *mut marconi_cache {
    let mut cfg = init(marconi_cache_config_init);
    cfg.capacity_bytes = capacity;
    cfg.page_size = PAGE;
    new_cache(&cfg)
}

#[test]
fn threads_share_a_cache() {
    // Small enough that evictions happen: about 30 states of paper-7b.
    let cache = cache_of(1_200_000_000);
    let shared = Shared(cache);
    let next_id = AtomicU32::new(1);
    let taken_pages = Mutex::new(HashSet::new());
    let taken_slots = Mutex::new(HashSet::new());
    let threads = 4;
    let per_thread = 60;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (next_id, taken_pages, taken_slots) = (&next_id, &taken_pages, &taken_slots);
            s.spawn(move || {
                let c = shared.get();
                let fresh = || next_id.fetch_add(1, Ordering::Relaxed);
                let system: Vec<u32> = (0..64).collect();
                for conv in 0..per_thread / 3 {
                    let mut history = system.clone();
                    for turn in 0..3u32 {
                        let base = 1_000_000 * (t + 1) + 1000 * conv + 100 * turn;
                        history.extend(base..base + 20);
                        let dst = fresh();
                        let mut l = marconi_lookup::default();
                        // SAFETY: live handle; history outlives the call.
                        ok(unsafe {
                            marconi_cache_lookup(c, 0, history.as_ptr(), history.len(), dst, &mut l)
                        });
                        assert!(l.hit_tokens < history.len() as u32);
                        assert!(l.kv_matched_tokens >= l.hit_tokens);
                        if l.state_slot != MARCONI_NO_SLOT {
                            assert_eq!(l.n_copy_orders, 1);
                            assert_eq!(l.copy_order.src_slot, l.state_slot);
                            assert_eq!(l.copy_order.dst_slot, dst);
                        }
                        let mut pages = vec![0u32; l.n_kv_pages as usize];
                        let mut plan = vec![0u32; l.n_plan as usize];
                        let (mut np, mut npl) = (0usize, 0usize);
                        // SAFETY: buffers sized from the lookup's counts.
                        ok(unsafe {
                            marconi_cache_lease_kv_pages(
                                c,
                                l.lease,
                                pages.as_mut_ptr(),
                                pages.len(),
                                &mut np,
                            )
                        });
                        // SAFETY: as above.
                        ok(unsafe {
                            marconi_cache_lease_plan(
                                c,
                                l.lease,
                                plan.as_mut_ptr(),
                                plan.len(),
                                &mut npl,
                            )
                        });
                        assert_eq!((np, npl), (pages.len(), plan.len()));
                        assert_eq!(pages.len() as u32, l.hit_tokens / PAGE);
                        // Decode 10 tokens, then admit with the engine's pages.
                        let mut full = history.clone();
                        full.extend(base + 50..base + 60);
                        let full_pages = full.len() / PAGE as usize;
                        let mut kv = pages.clone();
                        while kv.len() < full_pages {
                            kv.push(fresh());
                        }
                        let final_pos = (full.len() as u32 / PAGE) * PAGE;
                        let mut states: Vec<marconi_saved_state> = plan
                            .iter()
                            .map(|&p| marconi_saved_state {
                                position: p,
                                slot: fresh(),
                            })
                            .collect();
                        if !plan.contains(&final_pos) {
                            states.push(marconi_saved_state {
                                position: final_pos,
                                slot: fresh(),
                            });
                        }
                        let mut taken = vec![0u8; states.len()];
                        let mut out = marconi_admit_result::default();
                        ok(admit(c, l.lease, &full, &states, &kv, &mut taken, &mut out));
                        assert_eq!(
                            taken.iter().filter(|&&f| f == 1).count() as u32,
                            out.states_taken
                        );
                        let mut tp = taken_pages.lock().unwrap();
                        for &p in
                            &kv[out.kv_pages_taken_start as usize..out.kv_pages_taken_end as usize]
                        {
                            assert!(tp.insert(p), "page {p} taken twice");
                        }
                        drop(tp);
                        let mut ts = taken_slots.lock().unwrap();
                        for (s, &f) in states.iter().zip(&taken) {
                            if f == 1 {
                                assert!(ts.insert(s.slot), "slot {} taken twice", s.slot);
                            }
                        }
                        drop(ts);
                        // SAFETY: live handle.
                        ok(unsafe { marconi_cache_release(c, l.lease) });
                        // A released lease is refused, and changes nothing.
                        // SAFETY: live handle.
                        let again = unsafe { marconi_cache_release(c, l.lease) };
                        assert_eq!(again, marconi_status::UnknownLease);
                    }
                }
            });
        }
    });
    // SAFETY: live handle.
    ok(unsafe { marconi_cache_check(cache) });
    let s = cache_stats(cache);
    assert_eq!(s.requests, u64::from(threads * per_thread));
    assert_eq!(s.leases, 0);
    assert!(s.evictions > 0, "capacity too large for the test: {s:?}");
    assert!(s.hit_requests > 0);
    assert!(s.used_bytes <= s.capacity_bytes);
    assert_eq!(s.evictable_bytes, s.used_bytes, "nothing is leased");

    // Every freed id was taken by the cache, and comes back once.
    // NULL buffers with capacity 0 ask for the sizes.
    let (st, np, ns) = drain_freed(cache, &mut [], &mut []);
    assert!(np > 0 && ns > 0, "evictions freed nothing");
    assert_eq!(st, marconi_status::BufferTooSmall);
    let mut pages = vec![0u32; np];
    let mut slots = vec![0u32; ns];
    // Buffers of the sizes reported.
    let (st, wp, ws) = drain_freed(cache, &mut pages, &mut slots);
    ok(st);
    assert_eq!((wp, ws), (np, ns));
    let tp = taken_pages.lock().unwrap();
    let ts = taken_slots.lock().unwrap();
    assert_eq!(pages.iter().collect::<HashSet<_>>().len(), pages.len());
    assert_eq!(slots.iter().collect::<HashSet<_>>().len(), slots.len());
    assert!(pages.iter().all(|p| tp.contains(p)));
    assert!(slots.iter().all(|s| ts.contains(s)));
    // Cached states + freed slots = taken slots.
    assert_eq!(s.states as usize + slots.len(), ts.len());
    // Drained: nothing pending now.
    let (st, np, ns) = drain_freed(cache, &mut [], &mut []);
    ok(st);
    assert_eq!((np, ns), (0, 0));
    // SAFETY: no other thread uses the cache any more.
    unsafe { marconi_cache_free(cache) };
}

#[test]
fn a_stale_lease_never_reaches_another_cache() {
    let a = cache_of(1_000_000_000_000);
    let tokens: Vec<u32> = (0..40).collect();
    let mut l = marconi_lookup::default();
    // SAFETY: live handle.
    ok(unsafe {
        marconi_cache_lookup(a, 0, tokens.as_ptr(), tokens.len(), MARCONI_NO_SLOT, &mut l)
    });
    let stale = l.lease;
    // SAFETY: freed once, not used after.
    unsafe { marconi_cache_free(a) };
    let b = cache_of(1_000_000_000_000);
    // SAFETY: live handle.
    ok(unsafe {
        marconi_cache_lookup(b, 0, tokens.as_ptr(), tokens.len(), MARCONI_NO_SLOT, &mut l)
    });
    assert_ne!(l.lease, stale);
    let before = cache_stats(b);
    // SAFETY: live handle; the lease is stale.
    assert_eq!(
        unsafe { marconi_cache_release(b, stale) },
        marconi_status::UnknownLease
    );
    assert!(
        last_error().contains("not issued by this cache"),
        "{}",
        last_error()
    );
    assert_eq!(cache_stats(b), before);
    // SAFETY: live handle.
    ok(unsafe { marconi_cache_release(b, l.lease) });
    // SAFETY: freed once.
    unsafe { marconi_cache_free(b) };
}

/// A pool or a cache over pools shared between threads (internally locked).
struct SharedPtr<T>(*mut T);
impl<T> Clone for SharedPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedPtr<T> {}
// SAFETY: marconi_pool and marconi_pooled_cache are internally locked; the
// ABI allows concurrent calls on them.
unsafe impl<T> Send for SharedPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SharedPtr<T> {}

impl<T> SharedPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

fn pool_cfg(backend: u32, budget: u64) -> marconi::pool::marconi_pool_config {
    use marconi::pool::*;
    let mut cfg = init(marconi_pool_config_init);
    cfg.backend = backend;
    cfg.budget_bytes = budget;
    cfg.chunk_bytes = 64 << 10;
    cfg.kv_page_bytes = 4 << 10;
    cfg.state_slot_bytes = 16 << 10;
    cfg
}

/// Threads allocate, write, resolve and free on two shared pools, and hand
/// each other's handles to the wrong pool: always UNKNOWN_HANDLE, the
/// owner's bytes untouched.
#[test]
fn threads_share_two_pools_and_never_cross_handles() {
    use marconi::pool::*;
    let cfg = pool_cfg(1, 2 << 20);
    let (mut a, mut b) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: whole configs, writable outs.
    ok(unsafe { marconi_pool_new(&cfg, &mut a) });
    // SAFETY: as above.
    ok(unsafe { marconi_pool_new(&cfg, &mut b) });
    let pools = [SharedPtr(a), SharedPtr(b)];
    std::thread::scope(|s| {
        for t in 0..4u8 {
            s.spawn(move || {
                let (mine, other) = (pools[usize::from(t % 2)], pools[usize::from(1 - t % 2)]);
                for r in 0..150u32 {
                    let mut h = [0u64; 3];
                    // SAFETY: h has 3 writable handles.
                    let st =
                        unsafe { marconi_pool_allocate(mine.get(), r % 2, 3, h.as_mut_ptr(), 3) };
                    if st != marconi_status::Ok {
                        assert_eq!(st, marconi_status::OutOfMemory, "{}", last_error());
                        continue;
                    }
                    let mut l = [marconi_unit_location::default(); 3];
                    // SAFETY: 3 handles, 3 locations.
                    ok(unsafe {
                        marconi_pool_resolve(mine.get(), h.as_ptr(), 3, l.as_mut_ptr(), 3)
                    });
                    for x in &l {
                        // SAFETY: a live unit of this thread, mapped while live.
                        unsafe { ptr::write_bytes(x.address as *mut u8, t + 1, 64) };
                    }
                    // SAFETY: one handle, one location.
                    let st = unsafe {
                        marconi_pool_resolve(other.get(), h.as_ptr(), 1, l.as_mut_ptr(), 1)
                    };
                    assert_eq!(st, marconi_status::UnknownHandle);
                    // SAFETY: one readable handle.
                    let st = unsafe { marconi_pool_free_units(other.get(), h.as_ptr(), 1) };
                    assert_eq!(st, marconi_status::UnknownHandle);
                    // SAFETY: 3 handles, 3 locations.
                    ok(unsafe {
                        marconi_pool_resolve(mine.get(), h.as_ptr(), 3, l.as_mut_ptr(), 3)
                    });
                    for x in &l {
                        // SAFETY: as above.
                        let v = unsafe { std::slice::from_raw_parts(x.address as *const u8, 64) };
                        assert!(
                            v.iter().all(|&c| c == t + 1),
                            "a unit changed under its owner"
                        );
                    }
                    // SAFETY: 3 readable handles.
                    ok(unsafe { marconi_pool_free_units(mine.get(), h.as_ptr(), 3) });
                }
            });
        }
    });
    for p in pools {
        // SAFETY: freed once, no call in flight.
        unsafe { marconi_pool_free(p.get()) };
    }
}

/// Threads run whole requests through one shared cache over pools.
#[test]
fn threads_share_a_cache_over_pools() {
    use marconi::pooled::*;
    let mut cc = init(marconi_cache_config_init);
    cc.model_preset = c"nemotron-h-8b".as_ptr();
    cc.page_size = PAGE;
    let mut pc = pool_cfg(0, 8 << 30);
    pc.kv_page_bytes = 0;
    pc.state_slot_bytes = 0;
    let mut c = ptr::null_mut();
    // SAFETY: whole configs, writable out.
    ok(unsafe { marconi_pooled_cache_new(&cc, &pc, &mut c) });
    let shared = SharedPtr(c);
    std::thread::scope(|s| {
        for t in 0..4u32 {
            s.spawn(move || {
                for r in 0..40u32 {
                    let tokens: Vec<u32> = (0..64 + (r % 5) * 16)
                        .map(|i| {
                            if i < 48 {
                                i + 1
                            } else {
                                t * 100_000 + r * 1000 + i
                            }
                        })
                        .collect();
                    let c = shared.get();
                    let mut l = marconi_pooled_lookup::default();
                    let input = tokens.len() - 2;
                    // SAFETY: tokens readable, l writable.
                    ok(unsafe {
                        marconi_pooled_cache_lookup(c, 0, tokens.as_ptr(), input, &mut l)
                    });
                    let mut hit = vec![0u64; l.n_kv_pages as usize];
                    let mut n = 0;
                    // SAFETY: hit has n_kv_pages writable handles.
                    ok(unsafe {
                        marconi_pooled_cache_lease_kv_pages(
                            c,
                            l.lease,
                            hit.as_mut_ptr(),
                            hit.len(),
                            &mut n,
                        )
                    });
                    let want = tokens.len() / PAGE as usize - hit.len();
                    let (mut pg, mut sl) = (vec![0u64; want], [0u64; 1]);
                    // SAFETY: writable buffers of their lengths.
                    let st = unsafe {
                        marconi_pooled_cache_reserve(
                            c,
                            want as u32,
                            1,
                            pg.as_mut_ptr(),
                            want,
                            sl.as_mut_ptr(),
                            1,
                        )
                    };
                    if st != marconi_status::Ok {
                        assert_eq!(st, marconi_status::OutOfMemory, "{}", last_error());
                        // SAFETY: live lease.
                        ok(unsafe { marconi_pooled_cache_release(c, l.lease) });
                        continue;
                    }
                    let mut pages = hit.clone();
                    pages.extend_from_slice(&pg);
                    let st = [marconi_pooled_state {
                        position: (tokens.len() / PAGE as usize * PAGE as usize) as u32,
                        reserved: 0,
                        state_handle: sl[0],
                    }];
                    let (mut taken, mut res) =
                        ([0u8; 1], marconi::cache::marconi_admit_result::default());
                    // SAFETY: every buffer sized as passed.
                    ok(unsafe {
                        marconi_pooled_cache_admit(
                            c,
                            l.lease,
                            tokens.as_ptr(),
                            tokens.len(),
                            st.as_ptr(),
                            1,
                            pages.as_ptr(),
                            pages.len(),
                            taken.as_mut_ptr(),
                            &mut res,
                        )
                    });
                    let range = res.kv_pages_taken_start as usize..res.kv_pages_taken_end as usize;
                    let mut mine: Vec<u64> = (hit.len()..pages.len())
                        .filter(|i| !range.contains(i))
                        .map(|i| pages[i])
                        .collect();
                    if taken[0] == 0 {
                        mine.push(sl[0]);
                    }
                    // SAFETY: mine readable.
                    ok(unsafe { marconi_pooled_cache_free_units(c, mine.as_ptr(), mine.len()) });
                    // SAFETY: live lease.
                    ok(unsafe { marconi_pooled_cache_release(c, l.lease) });
                }
            });
        }
    });
    // SAFETY: live handle; then freed once.
    ok(unsafe { marconi_pooled_cache_check(c) });
    // SAFETY: as above.
    unsafe { marconi_pooled_cache_free(c) };
}

/// Threads demote and promote between one shared memfd device pool and one
/// shared host pool while another copies states inside the device pool:
/// every call returns (no lock-order deadlock, checked against a deadline),
/// and each thread's bytes arrive intact on both sides.
#[test]
fn threads_move_units_between_a_device_pool_and_a_host_pool() {
    use marconi::host_pool::*;
    use marconi::pool::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[derive(Clone, Copy)]
    struct Pools(*mut marconi_pool, *mut marconi_host_pool);
    // SAFETY: both pools are internally locked; the ABI allows concurrent calls.
    unsafe impl Send for Pools {}
    impl Pools {
        /// Both handles (a method, so closures capture the whole `Pools`).
        fn get(self) -> (*mut marconi_pool, *mut marconi_host_pool) {
            (self.0, self.1)
        }
    }

    let mut dev = ptr::null_mut();
    let cfg = pool_cfg(1, 4 << 20);
    // SAFETY: cfg whole; dev writable.
    ok(unsafe { marconi_pool_new(&cfg, &mut dev) });
    let mut hc = init(marconi_host_pool_config_init);
    hc.capacity_bytes = 4 << 20;
    hc.chunk_bytes = 64 << 10;
    hc.page_bytes = 4 << 10;
    hc.state_bytes = 16 << 10;
    let mut host = ptr::null_mut();
    // SAFETY: hc whole; host writable.
    ok(unsafe { marconi_host_pool_new(&hc, &mut host) });
    let pools = Pools(dev, host);
    let unit = |loc: &marconi_unit_location| {
        // SAFETY: a live unit's bytes stay mapped while its handle is live;
        // only the thread that allocated it touches them.
        unsafe { std::slice::from_raw_parts_mut(loc.address as *mut u8, loc.unit_bytes as usize) }
    };
    let (done, finished) = mpsc::channel();
    for t in 0..4u8 {
        let done = done.clone();
        std::thread::spawn(move || {
            let (dev, host) = pools.get();
            for round in 0..100u32 {
                let kind = u32::from((t + round as u8) % 2);
                let (mut d, mut h, mut back) = ([0u64; 2], [0u64; 2], [0u64; 2]);
                // SAFETY: live pools; two writable handles each.
                unsafe {
                    ok(marconi_pool_allocate(dev, kind, 2, d.as_mut_ptr(), 2));
                    ok(marconi_pool_allocate(dev, kind, 2, back.as_mut_ptr(), 2));
                    ok(marconi_host_pool_allocate(host, kind, 2, h.as_mut_ptr(), 2));
                }
                let mut dl = [marconi_unit_location::default(); 2];
                let mut bl = [marconi_unit_location::default(); 2];
                let mut hl = [marconi_unit_location::default(); 2];
                // SAFETY: two handles, two locations each.
                unsafe {
                    ok(marconi_pool_resolve(dev, d.as_ptr(), 2, dl.as_mut_ptr(), 2));
                    ok(marconi_pool_resolve(
                        dev,
                        back.as_ptr(),
                        2,
                        bl.as_mut_ptr(),
                        2,
                    ));
                    ok(marconi_host_pool_resolve(
                        host,
                        h.as_ptr(),
                        2,
                        hl.as_mut_ptr(),
                        2,
                    ));
                }
                for (i, l) in dl.iter().enumerate() {
                    unit(l).fill(
                        t.wrapping_mul(31)
                            .wrapping_add(round as u8)
                            .wrapping_add(i as u8),
                    );
                }
                let down = [0, 1].map(|i| marconi_unit_move {
                    src: d[i],
                    dst: h[i],
                });
                let up = [0, 1].map(|i| marconi_unit_move {
                    src: h[i],
                    dst: back[i],
                });
                let mut bytes = 0u64;
                // SAFETY: live pools; two readable pairs; bytes writable.
                unsafe {
                    ok(marconi_host_pool_demote(
                        host,
                        dev,
                        down.as_ptr(),
                        2,
                        &mut bytes,
                    ));
                    ok(marconi_host_pool_promote(
                        host,
                        dev,
                        up.as_ptr(),
                        2,
                        ptr::null_mut(),
                    ));
                }
                assert_eq!(bytes, 2 * dl[0].unit_bytes);
                for i in 0..2 {
                    assert!(
                        unit(&bl[i]) == unit(&dl[i]),
                        "thread {t} round {round}: bytes lost"
                    );
                }
                // SAFETY: live pools; the handles this thread allocated.
                unsafe {
                    ok(marconi_pool_free_units(dev, d.as_ptr(), 2));
                    ok(marconi_pool_free_units(dev, back.as_ptr(), 2));
                    ok(marconi_host_pool_free_units(host, h.as_ptr(), 2));
                }
            }
            done.send(()).expect("the test waits");
        });
    }
    // A fifth thread takes only the device pool's lock, as often as it can.
    let copier = done.clone();
    std::thread::spawn(move || {
        let (dev, _) = pools.get();
        let mut s = [0u64; 2];
        // SAFETY: live pool; two writable handles.
        ok(unsafe { marconi_pool_allocate(dev, 1, 2, s.as_mut_ptr(), 2) });
        let pair = marconi_state_copy {
            src_state: s[0],
            dst_state: s[1],
        };
        for _ in 0..400 {
            // SAFETY: live pool; one readable pair.
            ok(unsafe { marconi_pool_copy_states(dev, &pair, 1) });
        }
        // SAFETY: the two handles allocated above.
        ok(unsafe { marconi_pool_free_units(dev, s.as_ptr(), 2) });
        copier.send(()).expect("the test waits");
    });
    drop(done);
    for _ in 0..5 {
        finished
            .recv_timeout(Duration::from_secs(120))
            .expect("a thread did not finish within 120 s: deadlock or panic");
    }
    let mut st = versioned::<marconi_host_pool_stats>();
    // SAFETY: live pool; st writable.
    ok(unsafe { marconi_host_pool_get_stats(host, &mut st) });
    assert_eq!(
        (st.pages_live, st.states_live, st.units_moved),
        (0, 0, 4 * 100 * 4)
    );
    // SAFETY: every thread is done; freed once.
    unsafe {
        marconi_host_pool_free(host);
        marconi_pool_free(dev);
    }
}
