//! Through the C ABI: what adversarial use of the header found mishandled.
//! The final state under all-blocks admission with blocks larger than pages
//! (plain cache and cache over pools), planning far beyond the budget,
//! model paths that are not regular files, impossible models, and a drain
//! with nothing a subscriber sees.
#![expect(
    deprecated,
    reason = "also drives the deprecated marconi_pooled_cache_* / marconi_tiered_* forwarders, kept one release"
)]

use std::ffi::CString;
use std::ptr;

use marconi::cache::*;
use marconi::config::*;
use marconi::events::*;
use marconi::gguf::{marconi_model_spec_from_gguf, marconi_model_spec_from_gguf_bytes};
use marconi::hf_config::marconi_model_spec_from_hf_config;
use marconi::plan::*;
use marconi::pool::*;
use marconi::pooled::*;
use marconi::status::marconi_status;

mod common;
use common::*;

/// An all-blocks configuration: blocks of 8 tokens over pages of 4.
fn all_blocks_config() -> marconi_cache_config {
    let mut cfg = init(marconi_cache_config_init);
    cfg.capacity_bytes = 1 << 40;
    cfg.page_size = 4;
    cfg.admission = marconi_admission::AllBlocks as u32;
    cfg.block_size = 8;
    cfg
}

/// A cache of one-token pages admitting by the Marconi policy.
fn marconi_cache_of_single_pages() -> *mut marconi_cache {
    let mut cfg = all_blocks_config();
    cfg.page_size = 1;
    cfg.admission = marconi_admission::Marconi as u32;
    new_cache(&cfg)
}

/// The KV page list of a live lease, read with room for `cap` ids.
fn lease_kv_pages(cache: *const marconi_cache, lease: u64, cap: usize) -> Vec<u32> {
    let mut got = vec![0u32; cap];
    let mut n = 0usize;
    // SAFETY: got has cap writable ids.
    ok(unsafe { marconi_cache_lease_kv_pages(cache, lease, got.as_mut_ptr(), cap, &mut n) });
    got.truncate(n);
    got
}

#[test]
fn all_blocks_admits_the_final_state_between_block_boundaries() {
    let cfg = all_blocks_config();
    let cache = new_cache(&cfg);
    let input: Vec<u32> = (0..20).collect();
    let full: Vec<u32> = (0..30).collect();
    let l = lookup(cache, &input);
    // 30 tokens end at 28 (pages of 4), between the blocks 24 and 32.
    let s = states(&[8, 16, 24, 28], &[1, 2, 3, 4]);
    let mut taken = [0u8; 4];
    let mut out = marconi_admit_result::default();
    ok(admit(cache, l.lease, &full, &s, &[], &mut taken, &mut out));
    assert_eq!((out.states_taken, taken), (4, [1; 4]));
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_release(cache, l.lease) });
    let next: Vec<u32> = (0..40).collect();
    let l = lookup(cache, &next);
    assert_eq!((l.hit_tokens, l.state_slot), (28, 4));
    // SAFETY: live handle and lease; the handle is freed once.
    unsafe {
        ok(marconi_cache_release(cache, l.lease));
        marconi_cache_free(cache);
    }
}

#[test]
fn all_blocks_over_pools_admits_the_final_state() {
    let cfg = all_blocks_config();
    let mut pool = init(marconi_pool_config_init);
    pool.budget_bytes = 8 << 30; // backend NONE: handles only, no memory
    let mut pc = ptr::null_mut();
    // SAFETY: valid configs and out pointer.
    ok(unsafe { marconi_pooled_cache_new(&cfg, &pool, &mut pc) });
    let input: Vec<u32> = (0..20).collect();
    let full: Vec<u32> = (0..30).collect();
    let mut l = marconi_pooled_lookup::default();
    // SAFETY: live handle, valid buffers.
    ok(unsafe { marconi_pooled_cache_lookup(pc, 0, input.as_ptr(), input.len(), &mut l) });
    let (mut pages, mut slots) = ([0u64; 7], [0u64; 4]);
    // SAFETY: live handle; buffers of the given capacities.
    ok(unsafe {
        marconi_pooled_cache_reserve(pc, 7, 4, pages.as_mut_ptr(), 7, slots.as_mut_ptr(), 4)
    });
    let s = pooled_states(&[8, 16, 24, 28], &slots);
    let mut taken = [0u8; 4];
    let mut out = marconi_admit_result::default();
    // SAFETY: live handle, valid buffers and lengths.
    ok(unsafe {
        marconi_pooled_cache_admit(
            pc,
            l.lease,
            full.as_ptr(),
            full.len(),
            s.as_ptr(),
            s.len(),
            pages.as_ptr(),
            pages.len(),
            taken.as_mut_ptr(),
            &mut out,
        )
    });
    assert_eq!((out.states_taken, taken), (4, [1; 4]));
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_pooled_cache_release(pc, l.lease) });
    let next: Vec<u32> = (0..40).collect();
    // SAFETY: live handle, valid buffers.
    ok(unsafe { marconi_pooled_cache_lookup(pc, 0, next.as_ptr(), next.len(), &mut l) });
    assert_eq!((l.hit_tokens, l.state_handle), (28, slots[3]));
    // SAFETY: live handle and lease; the handle is freed once.
    unsafe {
        ok(marconi_pooled_cache_release(pc, l.lease));
        marconi_pooled_cache_free(pc);
    }
}

fn plan_request(context: u64, batch: u64) -> marconi_plan_request {
    let mut r = init(marconi_plan_request_init);
    r.budget_bytes = 10 << 30;
    r.context_tokens = context;
    r.batch = batch;
    r
}

fn plan(r: &marconi_plan_request) -> (marconi_status, marconi_memory_plan) {
    let mut out = versioned::<marconi_memory_plan>();
    // SAFETY: valid request and output struct of its declared size.
    let st = unsafe { marconi_plan(r, &mut out) };
    (st, out)
}

#[test]
fn plans_beyond_the_budget_fit_nothing_and_never_panic() {
    for context in [1 << 40, 1 << 62, u64::MAX - 1, u64::MAX] {
        for page in [1, 16, 1 << 20] {
            let mut r = plan_request(context, u64::MAX);
            r.page_size = page;
            let (st, p) = plan(&r);
            assert_ne!(st, marconi_status::Panic, "{}", last_error());
            if st != marconi_status::Ok {
                assert_eq!(st, marconi_status::InvalidConfig, "{}", last_error());
                continue;
            }
            assert!(
                p.fraction_for_context > 0.0 && p.fraction_for_context <= 1.0,
                "context {context} page {page}: {}",
                p.fraction_for_context
            );
            assert_eq!(
                (p.max_batch_static, p.max_batch_avmp, p.max_batch_unified),
                (0, 0, 0),
                "context {context} page {page}"
            );
            assert_eq!(
                (
                    p.max_context_static,
                    p.max_context_avmp,
                    p.max_context_unified
                ),
                (0, 0, 0)
            );
        }
    }
    // A page of u32::MAX tokens exceeds the budget: a refusal, not a panic.
    let mut r = plan_request(1, 1);
    r.page_size = u32::MAX;
    assert_eq!(plan(&r).0, marconi_status::InvalidConfig);
}

/// A path in a fresh directory under the system temp dir.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("marconi-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn gguf_path(p: &std::path::Path) -> (marconi_status, marconi_model_spec) {
    let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let mut out = marconi_model_spec::default();
    // SAFETY: NUL-terminated path, writable out.
    let st = unsafe { marconi_model_spec_from_gguf(c.as_ptr(), &mut out) };
    (st, out)
}

#[test]
fn a_model_path_that_is_not_a_regular_file_is_refused_without_blocking() {
    let dir = TempDir::new("fifo");
    let fifo = dir.0.join("m.gguf");
    let c = CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // The call runs on a thread so that a regression fails here instead of
    // hanging the test run: a FIFO without a writer blocks a plain open.
    let (tx, rx) = std::sync::mpsc::channel();
    let paths = [
        fifo.clone(),
        dir.0.clone(),
        "/dev/zero".into(),
        "/dev/null".into(),
    ];
    std::thread::spawn(move || {
        for p in paths {
            let (st, out) = gguf_path(&p);
            tx.send((p, st, out, last_error())).unwrap();
        }
    });
    for _ in 0..4 {
        let (p, st, out, e) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the reader returns within 10 s");
        assert_eq!(st, marconi_status::InvalidArgument, "{p:?}: {e}");
        assert!(e.contains("not a regular file"), "{p:?}: {e}");
        assert_eq!(out, marconi_model_spec::default());
    }
    // A writer that never closes used to make the reads wait for ever: the
    // writer's end is opened first (non-blocking needs a reader, so this
    // opens both ends of the FIFO on the test's side).
    let reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags_nonblock()
        .open(&fifo)
        .unwrap();
    let _writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (st, _) = gguf_path(&fifo);
        tx.send(st).unwrap();
    });
    let st = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the reader returns within 10 s");
    assert_eq!(st, marconi_status::InvalidArgument);
    drop(reader);
}

/// `OpenOptions::custom_flags(O_NONBLOCK)` under a short name.
trait NonBlock {
    fn custom_flags_nonblock(&mut self) -> &mut Self;
}

impl NonBlock for std::fs::OpenOptions {
    fn custom_flags_nonblock(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_NONBLOCK)
    }
}

/// A GGUF v3 file of a Mamba-2 with `u32s` (keys without the `mamba2.`
/// prefix) replacing its keys.
fn mamba2_gguf(u32s: &[(&str, u32)]) -> Vec<u8> {
    let mut keys = vec![
        ("block_count", 2),
        ("embedding_length", 64),
        ("ssm.conv_kernel", 4),
        ("ssm.inner_size", 128),
        ("ssm.state_size", 16),
        ("ssm.group_count", 1),
    ];
    for &(k, v) in u32s {
        keys.retain(|(o, _)| *o != k);
        keys.push((k, v));
    }
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(keys.len() as u64 + 1).to_le_bytes());
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend_from_slice(&(x.len() as u64).to_le_bytes());
        b.extend_from_slice(x.as_bytes());
    };
    s(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    s(&mut b, "mamba2");
    for (k, v) in keys {
        s(&mut b, &format!("mamba2.{k}"));
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

#[test]
fn impossible_models_are_invalid_config() {
    let mut out = marconi_model_spec::default();
    let b = mamba2_gguf(&[]);
    // SAFETY: valid buffers.
    ok(unsafe { marconi_model_spec_from_gguf_bytes(b.as_ptr(), b.len(), &mut out) });
    for bad in [
        ("ssm.group_count", 0),
        ("ssm.conv_kernel", 0),
        // Well formed, but no model: the header says INVALID_CONFIG.
        ("embedding_length", 0),
        ("ssm.state_size", 0),
    ] {
        let b = mamba2_gguf(&[bad]);
        let mut out = marconi_model_spec::default();
        // SAFETY: valid buffers.
        let st = unsafe { marconi_model_spec_from_gguf_bytes(b.as_ptr(), b.len(), &mut out) };
        assert_eq!(
            st,
            marconi_status::InvalidConfig,
            "{bad:?}: {}",
            last_error()
        );
        assert_eq!(out, marconi_model_spec::default());
    }
    let jamba = r#"{"model_type": "jamba", "hidden_size": 64, "num_hidden_layers": 4,
        "attn_layer_period": 4, "attn_layer_offset": 1, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}"#;
    let hf = |json: &str| {
        let mut out = marconi_model_spec::default();
        // SAFETY: valid buffers.
        let st = unsafe {
            marconi_model_spec_from_hf_config(json.as_ptr().cast(), json.len(), &mut out)
        };
        (st, last_error())
    };
    assert_eq!(hf(jamba).0, marconi_status::Ok);
    for (from, to) in [
        (r#""mamba_d_conv": 4"#, r#""mamba_d_conv": 0"#),
        (r#""num_experts_per_tok": 2"#, r#""num_experts_per_tok": 0"#),
        (r#""num_experts_per_tok": 2"#, r#""num_experts_per_tok": 5"#),
        (r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 8"#),
    ] {
        let (st, e) = hf(&jamba.replace(from, to));
        assert_eq!(st, marconi_status::InvalidConfig, "{to}: {e}");
    }
    // A hand-written spec goes through the same validation.
    let mut cfg = all_blocks_config();
    cfg.model_preset = ptr::null();
    // SAFETY: valid buffers.
    ok(unsafe {
        marconi_model_spec_from_hf_config(jamba.as_ptr().cast(), jamba.len(), &mut cfg.model)
    });
    cfg.model.kv_heads = cfg.model.n_heads + 1;
    let mut cache = ptr::null_mut();
    // SAFETY: valid config and out pointer.
    assert_eq!(
        unsafe { marconi_cache_new(&cfg, &mut cache) },
        marconi_status::InvalidConfig
    );
    assert!(cache.is_null());
}

#[test]
fn a_drain_with_only_state_changes_and_state_events_off_is_empty() {
    let mut cfg = all_blocks_config();
    cfg.admission = marconi_admission::Marconi as u32;
    let cache = new_cache(&cfg);
    let mut ecfg = init(marconi_events_config_init);
    ecfg.states = 0;
    let mut events = ptr::null_mut();
    // SAFETY: live cache, valid config and out pointer.
    ok(unsafe { marconi_events_new(cache, &ecfg, &mut events) });
    let mut buf = vec![0u8; 4096];
    let mut len = usize::MAX;
    let drain = |len: &mut usize, buf: &mut [u8]| {
        // SAFETY: live handles, buf of its length, writable len.
        ok(unsafe { marconi_events_drain(events, cache, 1.0, buf.as_mut_ptr(), buf.len(), len) });
    };
    // First turn: KV and a state; the drain carries the KV blocks.
    let seq: Vec<u32> = (0..16).collect();
    let mut out = marconi_admit_result::default();
    let l = lookup(cache, &seq);
    let s = states(&[16], &[1]);
    ok(admit(cache, l.lease, &seq, &s, &[], &mut [], &mut out));
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_release(cache, l.lease) });
    drain(&mut len, &mut buf);
    assert!(len > 12, "the KV blocks make a batch ({len} bytes)");
    // Second: the same 16 tokens again, a state at 12 only (a state
    // change, no new KV): nothing a subscriber without states sees.
    let l = lookup(cache, &seq[..13]);
    let s = states(&[12], &[2]);
    ok(admit(
        cache,
        l.lease,
        &seq[..13],
        &s,
        &[],
        &mut [],
        &mut out,
    ));
    // SAFETY: live handle and lease.
    ok(unsafe { marconi_cache_release(cache, l.lease) });
    assert_eq!(out.states_taken, 1, "the state at 12 is new");
    len = usize::MAX;
    drain(&mut len, &mut buf);
    assert_eq!(len, 0, "no batch, not an empty one");
    // SAFETY: live handles, each freed once.
    unsafe {
        marconi_events_free(events, cache);
        marconi_cache_free(cache);
    }
}

/// Each of `ptrs` (a pointer, what it points at) is no handle of the kind
/// `call` and `free` take: `call` on it is refused with INVALID_ARGUMENT
/// naming a handle, and `free` of it is a no-op.
fn no_handle_of_kind<T>(
    ptrs: &[(*mut T, &str)],
    mut call: impl FnMut(*mut T) -> marconi_status,
    free: impl Fn(*mut T),
) {
    for &(p, what) in ptrs {
        not_a_handle(call(p), what, "handle");
        free(p);
    }
}

/// A handle of one kind passed where another is expected, or a pointer to
/// something that is no handle at all, is refused with INVALID_ARGUMENT
/// (and a free of it is a no-op) instead of being used as that kind.
#[test]
fn handles_of_another_kind_are_refused() {
    let cfg = all_blocks_config();
    let cache = new_cache(&cfg);
    let mut pcfg = init(marconi_pool_config_init);
    pcfg.budget_bytes = 1 << 30;
    pcfg.kv_page_bytes = 4096;
    pcfg.state_slot_bytes = 4096;
    let mut pool = ptr::null_mut();
    // SAFETY: valid config and out pointer.
    ok(unsafe { marconi_pool_new(&pcfg, &mut pool) });
    let mut pc = ptr::null_mut();
    let mut units_from_model = pcfg;
    // Units sized from the model; backend NONE: handles only, no memory.
    units_from_model.kv_page_bytes = 0;
    units_from_model.state_slot_bytes = 0;
    units_from_model.budget_bytes = 8 << 30;
    // SAFETY: valid configs and out pointer.
    ok(unsafe { marconi_pooled_cache_new(&cfg, &units_from_model, &mut pc) });
    let ecfg = init(marconi_events_config_init);
    let mut events = ptr::null_mut();
    // SAFETY: live cache, valid config and out pointer.
    ok(unsafe { marconi_events_new(cache, &ecfg, &mut events) });

    // Plain memory the size of any handle, filled with a pattern: no handle.
    let mut junk = vec![0x5a5a_5a5a_5a5a_5a5a_u64; 64];
    let junk = junk.as_mut_ptr();
    let mut stats = versioned::<marconi_stats>();
    // SAFETY (every call on a pointer below): each pointer is readable for
    // a handle's size and each output writable; a refused free must leave
    // the memory alone.
    no_handle_of_kind(
        &[
            (pool.cast::<marconi_cache>(), "a pool as a cache"),
            (events.cast(), "an events handle as a cache"),
            (junk.cast(), "plain memory as a cache"),
        ],
        |p| unsafe { marconi_cache_stats(p, &mut stats) },
        |p| unsafe { marconi_cache_free(p) },
    );
    // A cache over pools is a cache (marconi_cache_config.pools): the
    // common calls take it; a plain cache given to a pooled call is a cache
    // without pools, refused as such.
    // SAFETY: live handles.
    ok(unsafe { marconi_cache_stats(pc.cast(), &mut stats) });
    let mut qstats0 = versioned::<marconi_pooled_stats>();
    // SAFETY: a live plain cache.
    let st = unsafe { marconi_pooled_cache_stats(cache.cast(), &mut qstats0) };
    unsupported(st, &["marconi_cache_config.pools"]);
    let mut pstats = versioned::<marconi_pool_stats>();
    no_handle_of_kind(
        &[
            (cache.cast::<marconi_pool>(), "a cache as a pool"),
            (junk.cast(), "plain memory as a pool"),
        ],
        |p| unsafe { marconi_pool_get_stats(p, &mut pstats) },
        |p| unsafe { marconi_pool_free(p) },
    );
    let mut qstats = versioned::<marconi_pooled_stats>();
    no_handle_of_kind(
        &[
            (
                pool.cast::<marconi_pooled_cache>(),
                "a pool as a cache over pools",
            ),
            (junk.cast(), "plain memory as a cache over pools"),
        ],
        |p| unsafe { marconi_pooled_cache_stats(p, &mut qstats) },
        |p| unsafe { marconi_pooled_cache_free(p) },
    );
    {
        use marconi::host_pool::*;
        let mut hstats = versioned::<marconi_host_pool_stats>();
        no_handle_of_kind(
            &[
                (
                    pool.cast::<marconi_host_pool>(),
                    "a device pool as a host pool",
                ),
                (junk.cast(), "plain memory as a host pool"),
            ],
            |p| unsafe { marconi_host_pool_get_stats(p, &mut hstats) },
            |p| unsafe { marconi_host_pool_free(p) },
        );
    }
    {
        use marconi::pml::*;
        let (mut n_modules, mut total, mut ns) = (0usize, 0u32, 0u64);
        no_handle_of_kind(
            &[
                (
                    cache.cast::<marconi_pml_schema>(),
                    "a cache as a PML schema",
                ),
                (junk.cast(), "plain memory as a PML schema"),
            ],
            |p| unsafe { marconi_pml_schema_info(p, &mut n_modules, &mut total, &mut ns) },
            |p| unsafe { marconi_pml_schema_free(p) },
        );
    }
    let mut buf = [0u8; 64];
    let mut len = 0usize;
    no_handle_of_kind(
        &[
            (cache.cast::<marconi_events>(), "a cache as events"),
            (junk.cast(), "plain memory as events"),
        ],
        |p| unsafe { marconi_events_drain(p, cache, 0.0, buf.as_mut_ptr(), buf.len(), &mut len) },
        |p| unsafe { marconi_events_free(p, ptr::null()) },
    );
    // The real handles still work after all of that, and free normally.
    // SAFETY: live handles.
    unsafe {
        ok(marconi_cache_stats(cache, &mut stats));
        ok(marconi_pool_get_stats(pool, &mut pstats));
        ok(marconi_pooled_cache_stats(pc, &mut qstats));
        ok(marconi_events_drain(
            events,
            cache,
            0.0,
            buf.as_mut_ptr(),
            buf.len(),
            &mut len,
        ));
        marconi_events_free(events, cache);
        marconi_pooled_cache_free(pc);
        marconi_pool_free(pool);
        marconi_cache_free(cache);
    }
}

/// The int64 entry points read ids as their uint32 twins do (the same
/// lookups and admissions), and refuse an id outside [0, 2^32 - 1] naming
/// it, with nothing changed.
#[test]
fn int64_ids_are_the_uint32_ids_and_out_of_range_ones_are_refused() {
    let cache = marconi_cache_of_single_pages();
    let seq: Vec<i64> = (0..16).map(|t| t * 1000).collect();
    let pages: Vec<i64> = (100..116).collect();
    let mut l = marconi_lookup::default();
    let mut out = marconi_admit_result::default();
    // SAFETY: live handle, valid buffers and lengths throughout.
    unsafe {
        ok(marconi_cache_lookup_i64(
            cache,
            0,
            seq.as_ptr(),
            seq.len(),
            MARCONI_NO_SLOT,
            &mut l,
        ));
        assert_eq!(l.hit_tokens, 0);
        // A page id above 2^32 - 1, then a negative token: refused, nothing admitted.
        let mut bad = pages.clone();
        bad[5] = 1 << 32;
        let s = states(&[16], &[7]);
        let st = admit_i64(cache, l.lease, &seq, &s, &bad, None, &mut out);
        assert_eq!(st, marconi_status::InvalidArgument);
        assert!(
            last_error().contains("kv_pages[5] = 4294967296"),
            "{}",
            last_error()
        );
        let mut neg = seq.clone();
        neg[3] = -1;
        let st = admit_i64(cache, l.lease, &neg, &s, &pages, None, &mut out);
        assert_eq!(st, marconi_status::InvalidArgument);
        assert!(last_error().contains("tokens[3] = -1"), "{}", last_error());
        ok(admit_i64(cache, l.lease, &seq, &s, &pages, None, &mut out));
        assert_eq!(out.states_taken, 1);
        assert_eq!((out.kv_pages_taken_start, out.kv_pages_taken_end), (0, 16));
        ok(marconi_cache_release(cache, l.lease));
        // The same sequence as uint32 ids (and one more token) hits what
        // the int64 admission cached, with its pages.
        let mut again: Vec<u32> = seq.iter().map(|&t| t as u32).collect();
        again.push(7);
        ok(marconi_cache_lookup(
            cache,
            0,
            again.as_ptr(),
            again.len(),
            MARCONI_NO_SLOT,
            &mut l,
        ));
        assert_eq!(l.hit_tokens, 16);
        let got = lease_kv_pages(cache, l.lease, 16);
        assert_eq!(got, (100..116).collect::<Vec<u32>>());
        ok(marconi_cache_release(cache, l.lease));
        // A lookup with an id out of range: refused, no lease issued.
        let before = cache_stats(cache).requests;
        let far = [1i64, i64::MAX];
        let st = marconi_cache_lookup_i64(cache, 0, far.as_ptr(), 2, MARCONI_NO_SLOT, &mut l);
        assert_eq!(st, marconi_status::InvalidArgument);
        assert!(last_error().contains("tokens[1]"), "{}", last_error());
        // NULL with a length, and an empty input, as marconi_cache_lookup.
        let st = marconi_cache_lookup_i64(cache, 0, ptr::null(), 3, MARCONI_NO_SLOT, &mut l);
        assert_eq!(st, marconi_status::NullArgument);
        let st = marconi_cache_lookup_i64(cache, 0, far.as_ptr(), 0, MARCONI_NO_SLOT, &mut l);
        assert_eq!(st, marconi_status::EmptyTokens);
        assert_eq!(cache_stats(cache).requests, before);
        marconi_cache_free(cache);
    }
}

/// marconi_cache_lookup_i64_flags: MARCONI_LOOKUP_WHOLE_INPUT lets the hit
/// cover the whole input (the default leaves the last token), and
/// MARCONI_LOOKUP_NO_KV_PAGES reports no pages at the lookup while
/// marconi_cache_lease_kv_pages still lists the same ids; flags 0 is
/// marconi_cache_lookup_i64. Unknown bits, NULL and empty inputs are
/// refused with no lease issued.
#[test]
fn lookup_flags_hit_the_whole_input_and_defer_the_page_list() {
    let cache = marconi_cache_of_single_pages();
    let seq: Vec<i64> = (0..16).map(|t| t * 1000 + 1).collect();
    let pages: Vec<i64> = (200..216).collect();
    let mut l = marconi_lookup::default();
    let mut out = marconi_admit_result::default();
    let lookup = |flags: u32, n: usize, l: &mut marconi_lookup| {
        // SAFETY: live handle, seq has at least n readable ids.
        unsafe {
            marconi_cache_lookup_i64_flags(cache, 0, seq.as_ptr(), n, MARCONI_NO_SLOT, flags, l)
        }
    };
    let both = MARCONI_LOOKUP_WHOLE_INPUT | MARCONI_LOOKUP_NO_KV_PAGES;
    // SAFETY: live handle, valid buffers and lengths throughout.
    unsafe {
        ok(lookup(both, 16, &mut l));
        assert_eq!(l.hit_tokens, 0);
        let s = states(&[16], &[7]);
        ok(admit_i64(cache, l.lease, &seq, &s, &pages, None, &mut out));
        assert_eq!(out.states_taken, 1);
        ok(marconi_cache_release(cache, l.lease));
        // Default (flags 0): the last token is left to compute, so the state
        // at 16 is no hit for a 16-token input; the pages are copied.
        ok(lookup(0, 16, &mut l));
        assert_eq!(l.hit_tokens, 0);
        ok(marconi_cache_release(cache, l.lease));
        // Whole input: the state at 16 is the hit; the pages are listed.
        ok(lookup(MARCONI_LOOKUP_WHOLE_INPUT, 16, &mut l));
        assert_eq!((l.hit_tokens, l.n_kv_pages, l.n_plan), (16, 16, 0));
        assert_eq!(l.state_slot, 7);
        assert_eq!(
            lease_kv_pages(cache, l.lease, 16),
            (200..216).collect::<Vec<u32>>()
        );
        ok(marconi_cache_release(cache, l.lease));
        // No page list at the lookup: n_kv_pages is 0, the size query and the
        // list come from the lease, the same ids.
        ok(lookup(both, 16, &mut l));
        assert_eq!((l.hit_tokens, l.n_kv_pages, l.state_slot), (16, 0, 7));
        let mut n = 0usize;
        let st = marconi_cache_lease_kv_pages(cache, l.lease, ptr::null_mut(), 0, &mut n);
        assert_eq!((st, n), (marconi_status::BufferTooSmall, 16));
        let mut got = lease_kv_pages(cache, l.lease, 16);
        assert_eq!(got, (200..216).collect::<Vec<u32>>());
        ok(marconi_cache_release(cache, l.lease));
        // Released: the deferred list is refused as a stale lease.
        let st = marconi_cache_lease_kv_pages(cache, l.lease, got.as_mut_ptr(), got.len(), &mut n);
        assert_eq!(st, marconi_status::UnknownLease);
        // Refusals: unknown bits, NULL with a length, empty; no lease issued.
        let before = cache_stats(cache).requests;
        let st = lookup(4, 16, &mut l);
        assert_eq!(st, marconi_status::InvalidArgument);
        assert!(
            last_error().contains("unknown bits 0x4"),
            "{}",
            last_error()
        );
        let st =
            marconi_cache_lookup_i64_flags(cache, 0, ptr::null(), 3, MARCONI_NO_SLOT, both, &mut l);
        assert_eq!(st, marconi_status::NullArgument);
        assert_eq!(lookup(both, 0, &mut l), marconi_status::EmptyTokens);
        let st = marconi_cache_lookup_i64_flags(
            cache,
            0,
            seq.as_ptr(),
            16,
            MARCONI_NO_SLOT,
            both,
            ptr::null_mut(),
        );
        assert_eq!(st, marconi_status::NullArgument);
        let far = [1i64, -5];
        let st = marconi_cache_lookup_i64_flags(
            cache,
            0,
            far.as_ptr(),
            2,
            MARCONI_NO_SLOT,
            both,
            &mut l,
        );
        assert_eq!(st, marconi_status::InvalidArgument);
        let st = marconi_cache_lookup_i64_flags(
            ptr::null(),
            0,
            seq.as_ptr(),
            16,
            MARCONI_NO_SLOT,
            both,
            &mut l,
        );
        assert_eq!(st, marconi_status::NullArgument);
        assert_eq!(cache_stats(cache).requests, before);
        marconi_cache_free(cache);
    }
}

/// A pointer is used only once the live-handle registry holds it with the
/// expected kind; nothing behind it is read before. Checked on pointers
/// into a page mapped without access (a read would kill the process) and on
/// a forged block that holds a cache's kind tag where a cache keeps it (a
/// check that read the tag took it for a cache), for every handle kind,
/// and on a handle freed twice.
#[test]
fn freed_handles_are_refused_without_being_read() {
    use marconi::pml_cache::*;
    use marconi::store::*;
    use marconi::tiered::*;
    let page = NoAccessPage::new();
    // "mccache1", the kind tag a cache keeps in its first field, then junk.
    let mut forged = vec![0x5a5a_5a5a_5a5a_5a5a_u64; 64];
    forged[0] = 0x6d63_6361_6368_6531;
    let forged = forged.as_mut_ptr().cast::<u8>();
    let refused = |s, what: &str| not_a_handle(s, what, "handle");
    for (p, place) in [
        (page.ptr::<u8>(), "an inaccessible page"),
        (forged, "a forged cache"),
    ] {
        let mut stats = versioned::<marconi_stats>();
        // SAFETY: the calls under test take any pointer and must not read it.
        unsafe {
            refused(marconi_cache_stats(p.cast(), &mut stats), place);
            refused(marconi_cache_check(p.cast()), place);
            refused(marconi_pooled_cache_check(p.cast()), place);
            refused(marconi_tiered_check(p.cast()), place);
            refused(marconi_pml_cache_free(p.cast()), place);
            marconi_cache_free(p.cast());
            marconi_pool_free(p.cast());
            marconi_pooled_cache_free(p.cast());
            marconi_store_free(p.cast());
            marconi_tiered_free(p.cast());
            marconi_events_free(p.cast(), ptr::null());
        }
    }
}
