//! Shapes and sizes that adversarial testing found mishandled:
//! pages larger than one token, byte products that overflow 64 bits,
//! positions near 2^32, models without attention layers.

use marconi_core::{
    AdmissionPolicy, AlphaMode, CacheConfig, Lookup, ModelSpec, PrefixCache, SavedState,
    TunerConfig,
};

const KV: u64 = 65_536;
const STATE: u64 = 26_787_840;

fn paper() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..b).collect()
}

fn paged(page_size: u32, alpha: AlphaMode) -> PrefixCache {
    PrefixCache::new(CacheConfig {
        page_size,
        alpha,
        ..CacheConfig::marconi(paper(), u64::MAX / 2)
    })
    .unwrap()
}

#[test]
fn an_input_ending_less_than_a_page_into_a_cached_edge_admits_along_that_edge() {
    // Page 4: [1..=8] is cached. An input [1, 2] matches less than a page of
    // that edge, so its lookup reuses nothing; its output continues along
    // the edge, so the admission must find the edge, not insert it again.
    for alpha in [
        AlphaMode::Fixed(0.0),
        AlphaMode::Auto(TunerConfig::default()),
    ] {
        let mut c = paged(4, alpha);
        c.serve(0, &range(1, 9), &[]).unwrap();
        c.check_invariants();
        let s = c.serve(0, &[1, 2], &range(3, 9)).unwrap();
        assert_eq!((s.hit_tokens, s.kv_matched_tokens), (0, 0));
        c.check_invariants();
        let st = c.stats();
        assert_eq!((st.kv_bytes, st.states, st.nodes), (8 * KV, 1, 1));
        // Continuing past the edge extends it.
        c.serve(0, &[1, 2], &range(3, 13)).unwrap();
        c.check_invariants();
        let st = c.stats();
        assert_eq!((st.kv_bytes, st.states, st.nodes), (12 * KV, 2, 2));
        // Diverging inside the first page branches at the root.
        c.serve(0, &[1, 2], &[7, 7, 7, 7, 7, 7]).unwrap();
        c.check_invariants();
        assert_eq!(c.stats().kv_bytes, 20 * KV);
    }
}

#[test]
fn truncated_to_is_set_only_when_tokens_were_cut() {
    // All-blocks every 4 tokens, room for 16 tokens and one state. The whole
    // input is already cached (no new KV); two new states are offered and
    // only one fits: states were dropped, no token was cut.
    let cfg = CacheConfig::vllm_plus(paper(), 16 * KV + STATE, 4);
    let mut c = PrefixCache::new(cfg).unwrap();
    let seq = range(0, 16);
    let l = c.lookup(0, &seq).unwrap();
    c.admit(l.lease, &seq, &[], &[]).unwrap();
    c.release(l.lease).unwrap();
    let l = c.lookup(0, &seq).unwrap();
    let st = |position, slot| SavedState {
        position,
        slot: Some(slot),
    };
    let out = c.admit(l.lease, &seq, &[st(4, 1), st(8, 2)], &[]).unwrap();
    c.release(l.lease).unwrap();
    assert_eq!(out.states_taken, vec![4]);
    assert_eq!(out.slots_returned, vec![2]);
    assert_eq!(out.new_kv_tokens, 0);
    assert_eq!(out.rejected, None);
    assert_eq!(out.truncated_to, None);
    c.check_invariants();
}

fn huge_kv_model() -> ModelSpec {
    // 2^61 KV bytes a token: valid, but 8 tokens overflow 64 bits.
    ModelSpec {
        name: "huge-kv".into(),
        attn_layers: 1,
        ssm_layers: 0,
        kv_heads: 1 << 59,
        n_heads: 1 << 59,
        head_dim: 1,
        dtype_bytes: 2,
        ..ModelSpec::preset("paper-7b-attn").unwrap()
    }
}

#[test]
fn model_dims_whose_products_overflow_are_refused() {
    let m = paper();
    let refused = |m: ModelSpec| {
        let e = PrefixCache::new(CacheConfig::marconi(m, 1 << 40)).unwrap_err();
        assert!(e.to_string().contains("overflow"), "{e}");
    };
    // 2 · kv_heads wraps to 0 bytes a token.
    refused(ModelSpec {
        kv_heads: 1 << 63,
        ..m.clone()
    });
    // The FLOP formula's query width n_heads · head_dim.
    refused(ModelSpec {
        n_heads: 1 << 40,
        head_dim: 1 << 30,
        kv_heads: 1,
        ..m.clone()
    });
    // Dims of a layer kind the model does not have still feed the formulas.
    refused(ModelSpec {
        attn_layers: 0,
        kv_heads: u64::MAX,
        ..m
    });
    assert!(huge_kv_model().validate().is_ok());
}

#[test]
fn an_admission_whose_bytes_overflow_is_cut_never_wrapped() {
    let kv = huge_kv_model().kv_bytes_per_token();
    assert_eq!(kv, 1 << 61);
    let mut c = PrefixCache::new(CacheConfig::sglang_plus(huge_kv_model(), 1 << 63)).unwrap();
    // 4 tokens fit exactly.
    let s = c.serve(0, &range(0, 4), &[]).unwrap();
    assert!(!s.rejected);
    assert_eq!(c.used_bytes(), 1 << 63);
    c.check_invariants();
    // 16 tokens need 2^65 bytes: the old entry goes, and 4 tokens are kept.
    let seq = range(100, 116);
    let l = c.lookup(0, &seq).unwrap();
    let out = c.admit(l.lease, &seq, &[], &[]).unwrap();
    c.release(l.lease).unwrap();
    assert_eq!(out.truncated_to, Some(4));
    assert_eq!(out.new_kv_tokens, 4);
    assert_eq!(c.used_bytes(), 1 << 63);
    c.check_invariants();
}

fn lookup_with(hit_tokens: u32) -> Lookup {
    Lookup {
        lease: 1,
        hit_tokens,
        kv_matched_tokens: hit_tokens,
        state_slot: None,
        kv_pages: Vec::new(),
        plan: Vec::new(),
    }
}

#[test]
fn block_positions_near_two_to_the_32_end() {
    // Block 2^31: k · block wraps to 0 at k = 2 in u32.
    let block = 1u32 << 31;
    let c = PrefixCache::new(CacheConfig::vllm_plus(paper(), 1 << 40, block)).unwrap();
    let max = u32::MAX as usize - 1;
    let positions = |hit, len| -> Vec<u32> {
        c.states_to_save(&lookup_with(hit), len)
            .iter()
            .map(|s| s.position)
            .collect()
    };
    assert_eq!(positions(0, max), vec![block]);
    assert_eq!(positions(block, max), Vec::<u32>::new());
    assert_eq!(positions(0, usize::MAX), vec![block]);
    // Marconi: a length past u32 is not truncated to its low bits.
    let c = PrefixCache::new(CacheConfig::marconi(paper(), 1 << 40)).unwrap();
    let finals: Vec<u32> = c
        .states_to_save(&lookup_with(0), (1usize << 32) + 8)
        .iter()
        .map(|s| s.position)
        .collect();
    assert!(finals.iter().all(|&p| p >= u32::MAX - 1), "{finals:?}");
}

fn ssm_only(cfg: fn(ModelSpec, u64) -> CacheConfig, capacity: u64, page: u32) -> PrefixCache {
    let m = ModelSpec::preset("paper-7b-ssm").unwrap();
    assert_eq!(m.kv_bytes_per_token(), 0);
    PrefixCache::new(CacheConfig {
        page_size: page,
        // Branches off the checkpoint grid leave nodes without states.
        checkpoint_grid: 32,
        alpha: AlphaMode::Fixed(1.0),
        ..cfg(m, capacity)
    })
    .unwrap()
}

/// Requests over a few shared prefixes that end off the checkpoint grid, so
/// that branch nodes without states appear.
fn branching(i: u32) -> (Vec<u32>, Vec<u32>) {
    let mut input = range(0, 64 * (i % 3 + 1) + 20);
    input.extend(range(10_000 + i * 100, 10_000 + i * 100 + 48));
    (input, range(500_000 + i * 10, 500_000 + i * 10 + 16))
}

#[test]
fn evicting_everything_empties_an_attention_free_tree() {
    type Make = fn(ModelSpec, u64) -> CacheConfig;
    let configs: [Make; 2] = [CacheConfig::marconi, CacheConfig::sglang_plus];
    for make in configs {
        for page in [1, 16] {
            let mut c = ssm_only(make, u64::MAX / 2, page);
            assert_eq!(c.token_bytes(), marconi_core::TOKEN_ID_BYTES);
            for i in 0..30 {
                let (input, output) = branching(i);
                c.serve(0, &input, &output).unwrap();
            }
            // A held lease keeps its path.
            let l = c.lookup(0, &branching(4).0).unwrap();
            c.evict(u64::MAX);
            c.check_invariants();
            c.release(l.lease).unwrap();
            c.evict(u64::MAX);
            c.check_invariants();
            let st = c.stats();
            assert_eq!(
                (st.nodes, st.states, c.used_bytes()),
                (0, 0, 0),
                "page {page}"
            );
        }
    }
}

#[test]
fn capacity_bounds_the_node_count_of_an_attention_free_model() {
    // An engine may admit KV without states (nothing to resume from); for a
    // model without attention such nodes hold no KV bytes, yet each costs at
    // least a page of token ids, so 4 000 bytes hold at most 62 of them.
    let page = 16u32;
    let capacity = 4_000;
    let mut c = ssm_only(CacheConfig::marconi, capacity, page);
    for i in 0..200 {
        let (input, _) = branching(i);
        let l = c.lookup(0, &input).unwrap();
        c.admit(l.lease, &input, &[], &[]).unwrap();
        c.release(l.lease).unwrap();
        c.check_invariants();
        let nodes = c.stats().nodes;
        assert!(nodes <= 62, "request {i}: {nodes} nodes");
    }
}

#[test]
fn all_blocks_plans_are_bounded_by_the_input() {
    // The lookup's plan uses the same positions as states_to_save.
    let mut c = PrefixCache::new(CacheConfig {
        admission: AdmissionPolicy::AllBlocks { block_size: 8 },
        ..CacheConfig::vllm_plus(paper(), 1 << 40, 8)
    })
    .unwrap();
    let l = c.lookup(0, &range(0, 30)).unwrap();
    assert_eq!(l.plan, vec![8, 16, 24]);
    assert_eq!(
        c.states_to_save(&l, 33)
            .iter()
            .map(|s| s.position)
            .collect::<Vec<_>>(),
        vec![8, 16, 24, 32]
    );
}

#[test]
fn a_refused_serve_leaves_no_lease_behind() {
    // An engine admitted with page ids; a whole-request serve (no page ids)
    // is refused, and must not have looked up first (lease, counters).
    let mut c = paged(4, AlphaMode::Fixed(0.0));
    let seq = range(0, 8);
    let l = c.lookup(0, &seq).unwrap();
    c.admit(l.lease, &seq, &[], &[10, 11]).unwrap();
    c.release(l.lease).unwrap();
    let before = c.stats();
    let e = c.serve(0, &range(0, 4), &range(4, 12)).unwrap_err();
    assert!(
        matches!(e, marconi_core::CacheError::BadPageList { .. }),
        "{e}"
    );
    assert_eq!(c.stats(), before);
    c.check_invariants();
}

#[test]
fn a_mismatched_pinned_prefix_is_reported_before_a_bad_page_list() {
    // Found by fuzz_abi after the fingerprint began to cover only the input
    // past the pinned hit: an admission whose hit tokens differ from the
    // lookup's input, and which is also wrong in another way (no page ids in
    // a page-tracking cache), was refused as BadPageList, not PrefixMismatch.
    let mut c = paged(4, AlphaMode::Fixed(0.0));
    let seq = range(0, 8);
    let l = c.lookup(0, &seq).unwrap();
    c.admit(
        l.lease,
        &seq,
        &[SavedState {
            position: 8,
            slot: Some(1),
        }],
        &[10, 11],
    )
    .unwrap();
    c.release(l.lease).unwrap();
    let input = range(0, 12);
    let l = c.lookup(0, &input).unwrap();
    assert_eq!(l.hit_tokens, 8);
    let mut other = input.clone();
    other[1] = 99; // inside the pinned hit
    other.extend(12..16);
    for pages in [&[][..], &[20, 21, 22, 23][..]] {
        let e = c.admit(l.lease, &other, &[], pages).unwrap_err();
        assert!(
            matches!(
                e,
                marconi_core::CacheError::PrefixMismatch { input_len: 12 }
            ),
            "{e}"
        );
    }
    c.check_invariants();
    c.release(l.lease).unwrap();
}

#[test]
fn the_final_state_is_admissible_between_block_boundaries() {
    // Block 8 over pages of 4: a 30-token sequence ends at 28 (rounded down
    // to the page), between the block boundaries 24 and 32. The final state
    // is admissible under every policy, so the admission keeps it and the
    // next turn resumes there.
    let mut c = PrefixCache::new(CacheConfig {
        page_size: 4,
        ..CacheConfig::vllm_plus(paper(), u64::MAX / 2, 8)
    })
    .unwrap();
    let l = c.lookup(0, &range(0, 20)).unwrap();
    assert_eq!(l.plan, vec![8, 16]);
    let states: Vec<SavedState> = [8, 16, 24, 28]
        .iter()
        .zip(1..)
        .map(|(&position, slot)| SavedState {
            position,
            slot: Some(slot),
        })
        .collect();
    let a = c.admit(l.lease, &range(0, 30), &states, &[]).unwrap();
    assert!(a.slots_returned.is_empty(), "{a:?}");
    c.release(l.lease).unwrap();
    let l = c.lookup(0, &range(0, 40)).unwrap();
    assert_eq!((l.hit_tokens, l.state_slot), (28, Some(4)));
    c.release(l.lease).unwrap();
    // Off the grid and not final: still refused, naming the final position.
    let l = c.lookup(0, &range(100, 130)).unwrap();
    let e = c
        .admit(
            l.lease,
            &range(100, 130),
            &[SavedState {
                position: 12,
                slot: Some(9),
            }],
            &[],
        )
        .unwrap_err();
    assert!(
        matches!(e, marconi_core::CacheError::NotPlanned { position: 12, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("final position 28"), "{e}");
    c.release(l.lease).unwrap();
}
