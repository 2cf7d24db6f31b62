//! The module store through the C ABI from several threads at once: one
//! handle, four threads looking up and admitting the prompts of two
//! schemas; the counters add up and the budget holds.

use std::ptr::null_mut;

use marconi::marconi_status;
use marconi::pml::*;
use marconi::pml_cache::*;

mod common;
use common::{blank_segment, init, ok, pml_layout, versioned};

const FIG2: &str = include_str!("../../marconi-pml/tests/fixtures/figure2_schema.xml");
/// Figure 2's prompt with an argument that fits 2 bytes.
const FIG2_PROMPT: &str =
    r#"<prompt schema="cities"><trip-plan duration="3d"/><miami/>Surf?</prompt>"#;
const TRAVEL: &str = include_str!("../../marconi-pml/tests/fixtures/travel_schema.xml");
const TRAVEL_PROMPT: &str = include_str!("../../marconi-pml/tests/fixtures/travel_prompt.xml");

fn schema(xml: &str) -> *mut marconi_pml_schema {
    let mut out = null_mut();
    // SAFETY: valid buffers; NULL tokenizer (bytes) and error.
    ok(unsafe {
        marconi_pml_schema_new(
            xml.as_ptr(),
            xml.len(),
            None,
            null_mut(),
            &mut out,
            null_mut(),
        )
    });
    out
}

fn layout(s: *const marconi_pml_schema, xml: &str) -> Vec<marconi_pml_segment> {
    let mut segs = vec![blank_segment(); 64];
    let mut toks = vec![0u32; 4096];
    ok(pml_layout(s, xml, None, &mut segs, &mut toks, null_mut()));
    segs
}

/// A handle shared by threads (the ABI documents it as thread-safe).
#[derive(Clone, Copy)]
struct Shared(*mut marconi_pml_cache);
// SAFETY: marconi_pml_cache takes an internal lock on every call.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

#[test]
fn threads_share_one_store() {
    let mut cfg = init(marconi_pml_cache_config_init);
    cfg.capacity_bytes = 1 << 20;
    cfg.kv_bytes_per_token = 64;
    cfg.state_bytes = 1000;
    cfg.operator_bytes = 500;
    let mut c = null_mut();
    // SAFETY: valid config and output.
    ok(unsafe { marconi_pml_cache_new(&cfg, &mut c) });
    let (f, t) = (schema(FIG2), schema(TRAVEL));
    let (mut fid, mut tid) = (0u64, 0u64);
    // SAFETY: live handles.
    ok(unsafe { marconi_pml_cache_register(c, f, &mut fid) });
    // SAFETY: live handles.
    ok(unsafe { marconi_pml_cache_register(c, t, &mut tid) });
    let jobs = [
        (fid, layout(f, FIG2_PROMPT)),
        (tid, layout(t, TRAVEL_PROMPT)),
    ];
    let shared = Shared(c);
    let rounds = 50u64;
    std::thread::scope(|s| {
        for k in 0..4usize {
            let (id, segs) = &jobs[k % 2];
            s.spawn(move || {
                let c = shared;
                for _ in 0..rounds {
                    let mut out = vec![
                        marconi_pml_served {
                            how: marconi_pml_served_how::Computed,
                            kind: marconi_pml_segment_kind::Text,
                            start: 0,
                            len: 0,
                            recomputed: 0,
                            module: 0,
                            in_run: false,
                            entry: 0,
                        };
                        segs.len()
                    ];
                    let mut n = 0usize;
                    // SAFETY: a live handle; buffers of the lengths given.
                    ok(unsafe {
                        marconi_pml_cache_lookup(
                            c.0,
                            *id,
                            segs.as_ptr(),
                            segs.len(),
                            marconi_pml_reuse_mode::Composed as u32,
                            2,
                            out.as_mut_ptr(),
                            out.len(),
                            &mut n,
                        )
                    });
                    assert_eq!(n, segs.len());
                    for (i, o) in out.iter().enumerate() {
                        if o.how != marconi_pml_served_how::Miss {
                            continue;
                        }
                        let mut e = 0u64;
                        // SAFETY: a live handle and valid buffers.
                        let st = unsafe {
                            if o.in_run {
                                marconi_pml_cache_admit_exact(
                                    c.0,
                                    *id,
                                    segs.as_ptr(),
                                    segs.len(),
                                    i,
                                    &mut e,
                                )
                            } else {
                                marconi_pml_cache_admit(
                                    c.0,
                                    *id,
                                    o.kind as u32,
                                    o.module as u32,
                                    &mut e,
                                )
                            }
                        };
                        ok(st);
                        assert_ne!(e, 0);
                    }
                }
            });
        }
    });
    let mut st = versioned::<marconi_pml_cache_stats>();
    // SAFETY: a live handle, a whole stats struct.
    ok(unsafe { marconi_pml_cache_get_stats(c, &mut st) });
    assert_eq!(st.lookups, 4 * rounds);
    assert!(st.used_bytes <= st.capacity_bytes);
    assert!(st.hits > 0);
    // Every cacheable segment of every lookup is a hit or a miss (composed).
    let cacheable: u64 = jobs
        .iter()
        .map(|(_, s)| s.iter().filter(|g| g.cached).count() as u64)
        .sum();
    assert_eq!(st.hits + st.misses, 2 * rounds * cacheable);
    // SAFETY: live handles, freed once.
    unsafe {
        ok(marconi_pml_cache_free(c));
        assert_eq!(marconi_pml_cache_free(c), marconi_status::InvalidArgument);
        marconi_pml_schema_free(f);
        marconi_pml_schema_free(t);
    }
}
