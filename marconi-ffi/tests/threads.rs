//! Several engine threads share one cache handle through the C ABI; the
//! request cycle keeps its invariants and every id handed over comes back
//! at most once.

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

fn ok(s: marconi_status) {
    assert_eq!(s, marconi_status::Ok, "{}", last_error());
}

fn last_error() -> String {
    let mut buf = vec![0u8; 512];
    // SAFETY: buf has 512 writable bytes.
    let n = unsafe { marconi::marconi_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    String::from_utf8_lossy(&buf[..n.min(511)]).into_owned()
}

fn new_cache(capacity: u64) -> *mut marconi_cache {
    let mut cfg = std::mem::MaybeUninit::<marconi_cache_config>::uninit();
    // SAFETY: cfg has sizeof(marconi_cache_config) writable bytes.
    ok(unsafe { marconi_cache_config_init(cfg.as_mut_ptr(), size_of::<marconi_cache_config>()) });
    // SAFETY: initialised by marconi_cache_config_init.
    let mut cfg = unsafe { cfg.assume_init() };
    cfg.capacity_bytes = capacity;
    cfg.page_size = PAGE;
    let mut cache = ptr::null_mut();
    // SAFETY: valid config and out pointer.
    ok(unsafe { marconi_cache_new(&cfg, &mut cache) });
    cache
}

fn stats(c: *mut marconi_cache) -> marconi_stats {
    let mut s = marconi_stats {
        struct_size: size_of::<marconi_stats>() as u32,
        ..Default::default()
    };
    // SAFETY: live handle, writable stats.
    ok(unsafe { marconi_cache_stats(c, &mut s) });
    s
}

#[test]
fn threads_share_a_cache() {
    // Small enough that evictions happen: about 30 states of paper-7b.
    let cache = new_cache(1_200_000_000);
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
                        // SAFETY: every buffer is passed with its length.
                        ok(unsafe {
                            marconi_cache_admit(
                                c,
                                l.lease,
                                full.as_ptr(),
                                full.len(),
                                states.as_ptr(),
                                states.len(),
                                kv.as_ptr(),
                                kv.len(),
                                taken.as_mut_ptr(),
                                &mut out,
                            )
                        });
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
    let s = stats(cache);
    assert_eq!(s.requests, u64::from(threads * per_thread));
    assert_eq!(s.leases, 0);
    assert!(s.evictions > 0, "capacity too large for the test: {s:?}");
    assert!(s.hit_requests > 0);
    assert!(s.used_bytes <= s.capacity_bytes);
    assert_eq!(s.evictable_bytes, s.used_bytes, "nothing is leased");

    // Every freed id was taken by the cache, and comes back once.
    let (mut np, mut ns) = (0usize, 0usize);
    // SAFETY: NULL buffers with capacity 0 ask for the sizes.
    let st = unsafe {
        marconi_cache_drain_freed(
            cache,
            ptr::null_mut(),
            0,
            &mut np,
            ptr::null_mut(),
            0,
            &mut ns,
        )
    };
    assert!(np > 0 && ns > 0, "evictions freed nothing");
    assert_eq!(st, marconi_status::BufferTooSmall);
    let mut pages = vec![0u32; np];
    let mut slots = vec![0u32; ns];
    // SAFETY: buffers of the sizes reported.
    ok(unsafe {
        marconi_cache_drain_freed(
            cache,
            pages.as_mut_ptr(),
            np,
            &mut np,
            slots.as_mut_ptr(),
            ns,
            &mut ns,
        )
    });
    let tp = taken_pages.lock().unwrap();
    let ts = taken_slots.lock().unwrap();
    assert_eq!(pages.iter().collect::<HashSet<_>>().len(), pages.len());
    assert_eq!(slots.iter().collect::<HashSet<_>>().len(), slots.len());
    assert!(pages.iter().all(|p| tp.contains(p)));
    assert!(slots.iter().all(|s| ts.contains(s)));
    // Cached states + freed slots = taken slots.
    assert_eq!(s.states as usize + slots.len(), ts.len());
    // SAFETY: drained: nothing pending now.
    ok(unsafe {
        marconi_cache_drain_freed(
            cache,
            ptr::null_mut(),
            0,
            &mut np,
            ptr::null_mut(),
            0,
            &mut ns,
        )
    });
    assert_eq!((np, ns), (0, 0));
    // SAFETY: no other thread uses the cache any more.
    unsafe { marconi_cache_free(cache) };
}

#[test]
fn a_stale_lease_never_reaches_another_cache() {
    let a = new_cache(1_000_000_000_000);
    let tokens: Vec<u32> = (0..40).collect();
    let mut l = marconi_lookup::default();
    // SAFETY: live handle.
    ok(unsafe {
        marconi_cache_lookup(a, 0, tokens.as_ptr(), tokens.len(), MARCONI_NO_SLOT, &mut l)
    });
    let stale = l.lease;
    // SAFETY: freed once, not used after.
    unsafe { marconi_cache_free(a) };
    let b = new_cache(1_000_000_000_000);
    // SAFETY: live handle.
    ok(unsafe {
        marconi_cache_lookup(b, 0, tokens.as_ptr(), tokens.len(), MARCONI_NO_SLOT, &mut l)
    });
    assert_ne!(l.lease, stale);
    let before = stats(b);
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
    assert_eq!(stats(b), before);
    // SAFETY: live handle.
    ok(unsafe { marconi_cache_release(b, l.lease) });
    // SAFETY: freed once.
    unsafe { marconi_cache_free(b) };
}
