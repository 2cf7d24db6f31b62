//! Memory planning (`marconi_gpu::plan`) checked against hand computations
//! for two real hybrids, and the split AVMP reaches on a replay.

use marconi_core::{AlphaMode, CacheConfig, ModelSpec};
use marconi_gpu::plan::{converged_split, plan};
use marconi_gpu::pooled::PoolLayout;

const GIB: u64 = 1 << 30;

#[test]
fn jamba_1_5_mini_at_10_gib_by_hand() {
    let m = ModelSpec::preset("jamba-1.5-mini").unwrap();
    let p = plan(&m, 16, 10 * GIB).unwrap();
    // KV: 4 attention layers × 2 (K and V) × 8 KV heads × 128 dims × 2 B
    // = 16 384 B a token; a 16-token page 262 144 B (already 128-aligned).
    assert_eq!(p.kv_bytes_per_token, 16_384);
    assert_eq!(p.kv_page_bytes, 262_144);
    // State: 28 Mamba layers × (8192 channels × 16 state + 8192 conv
    // channels × 4 columns) × 2 B = 28 × 327 680 = 9 175 040 B (≈ 8.75 MiB,
    // 128-aligned).
    assert_eq!(p.state_slot_bytes, 9_175_040);
    // Whole budget, 10 · 2^30 = 10 737 418 240 B: 40 960 pages = 655 360
    // tokens, or floor(10 737 418 240 / 9 175 040) = 1170 slots.
    assert_eq!(p.max_kv_tokens, 655_360);
    assert_eq!(p.max_state_slots, 1170);
    // Padded unified: units of the larger size (a slot), 1170 of them.
    assert_eq!((p.unified_unit_bytes, p.unified_units), (9_175_040, 1170));
    // Static split with 25% for states: 2 684 354 560 B → 292 slots
    // (292.57); 8 053 063 680 B of KV → 30 720 pages = 491 520 tokens.
    let s = p.split(0.25).unwrap();
    assert_eq!(
        (s.kv_pages, s.kv_tokens, s.state_slots),
        (30_720, 491_520, 292)
    );
    // Batch of 8192-token sequences: 512 pages + 1 slot each =
    // 134 217 728 + 9 175 040 = 143 392 768 B. AVMP: floor(10 737 418 240 /
    // 143 392 768) = 74 (74.9); static 25%: min(30 720 / 512, 292) = 60;
    // unified: floor(1170 / 513) = 2.
    assert_eq!(
        p.max_batch(8192, PoolLayout::Avmp { ssm_fraction: 0.5 })
            .unwrap(),
        74
    );
    assert_eq!(
        p.max_batch(8192, PoolLayout::Static { ssm_fraction: 0.25 })
            .unwrap(),
        60
    );
    assert_eq!(p.max_batch(8192, PoolLayout::Unified).unwrap(), 2);
    // The state share of such a batch: 9 175 040 / 143 392 768 ≈ 0.064.
    assert!((p.fraction_for_context(8192) - 0.063_985).abs() < 1e-5);
    // Longest context for 64 sequences under AVMP: 10 737 418 240 / 64 =
    // 167 772 160 B each, less a slot = 158 597 120 B = 605 pages = 9680
    // tokens.
    assert_eq!(
        p.max_context(64, PoolLayout::Avmp { ssm_fraction: 0.5 })
            .unwrap(),
        9680
    );
}

#[test]
fn nemotron_h_8b_at_80_gb_by_hand() {
    let m = ModelSpec::preset("nemotron-h-8b").unwrap();
    let p = plan(&m, 16, 80_000_000_000).unwrap();
    // KV: 4 attention layers × 2 × 8 KV heads × 128 × 2 B = 16 384 B a token.
    assert_eq!(p.kv_page_bytes, 262_144);
    // State: 24 Mamba-2 layers × (8192 × 128 state + (8192 + 2·8·128) conv
    // channels × 4) × 2 B = 24 × (1 048 576 + 40 960) × 2 = 24 × 2 179 072 =
    // 52 297 728 B (≈ 49.9 MiB).
    assert_eq!(p.state_slot_bytes, 52_297_728);
    // floor(80e9 / 52 297 728) = 1529 slots if all went to states.
    assert_eq!(p.max_state_slots, 1529);
    // 10% for states: 8e9 B → 152 slots (152.97); 72e9 B → 274 658 pages
    // (274 658.2) = 4 394 528 tokens.
    let s = p.split(0.1).unwrap();
    assert_eq!(
        (s.kv_pages, s.kv_tokens, s.state_slots),
        (274_658, 4_394_528, 152)
    );
    // 32 768-token sequences: 2048 pages (536 870 912 B) + one slot =
    // 589 168 640 B. AVMP: floor(80e9 / 589 168 640) = 135 (135.8); static
    // 10%: min(floor(274 658 / 2048) = 134, 152) = 134; unified: 1529 units
    // of a slot's size, 2049 a sequence: 0.
    assert_eq!(
        p.max_batch(32_768, PoolLayout::Avmp { ssm_fraction: 0.5 })
            .unwrap(),
        135
    );
    assert_eq!(
        p.max_batch(32_768, PoolLayout::Static { ssm_fraction: 0.1 })
            .unwrap(),
        134
    );
    assert_eq!(p.max_batch(32_768, PoolLayout::Unified).unwrap(), 0);
    // A static split starved of states holds few sequences: with 1% for
    // states, floor(8e8 / 52 297 728) = 15 slots, so 15 sequences.
    assert_eq!(
        p.max_batch(32_768, PoolLayout::Static { ssm_fraction: 0.01 })
            .unwrap(),
        15
    );
}

#[test]
fn plans_refuse_what_cannot_be_laid_out() {
    let m = ModelSpec::preset("jamba-1.5-mini").unwrap();
    assert!(plan(&m, 0, GIB).is_err());
    assert!(plan(&m, 16, 1000).is_err());
    assert!(plan(&ModelSpec::preset("paper-7b-attn").unwrap(), 16, GIB).is_err());
    let p = plan(&m, 16, GIB).unwrap();
    assert!(p.split(0.0).is_err() && p.split(1.0).is_err() && p.split(f64::NAN).is_err());
}

#[test]
fn avmp_moves_the_split_toward_what_the_trace_needs() {
    // paper-7b states are large next to its KV; long unique sequences need
    // pages. Starting with 90% of the budget for states, AVMP gives pages
    // capacity back.
    let m = ModelSpec::preset("paper-7b").unwrap();
    let mut cfg = CacheConfig::sglang_plus(m, 1);
    cfg.page_size = 16;
    cfg.alpha = AlphaMode::Fixed(0.0);
    let seqs: Vec<(usize, Vec<u32>)> = (0..40u32)
        .map(|s| {
            let full: Vec<u32> = (0..2000).map(|t| s * 10_000 + t).collect();
            (1900, full)
        })
        .collect();
    let budget = 2 * GIB;
    let c = converged_split(
        &cfg,
        budget,
        0.9,
        seqs.iter().map(|(n, s)| (*n, s.as_slice())),
    )
    .unwrap();
    assert!(c.final_fraction < 0.9, "{c:?}");
    assert!(c.stats.migrations > 0 && c.stats.bytes_migrated > 0);
    assert_eq!(c.stats.refused, 0);
}

#[test]
fn contexts_beyond_the_budget_fit_no_batch_and_keep_the_fraction_in_range() {
    // Contexts up to u64::MAX tokens, where pages · page bytes exceeds 64
    // bits: no sequence fits (batch 0 under every layout, never a wrapped
    // product or a division by zero) and the state fraction stays in (0, 1].
    let m = ModelSpec::preset("jamba-1.5-mini").unwrap();
    for page in [1, 16, 4096] {
        let p = plan(&m, page, 10 * GIB).unwrap();
        for context in [
            p.max_kv_tokens + 1,
            1 << 40,
            1 << 60,
            u64::MAX - 1,
            u64::MAX,
        ] {
            for layout in [
                PoolLayout::Static { ssm_fraction: 0.5 },
                PoolLayout::Avmp { ssm_fraction: 0.5 },
                PoolLayout::Unified,
            ] {
                assert_eq!(
                    p.max_batch(context, layout).unwrap(),
                    0,
                    "{context} {layout:?}"
                );
            }
            let f = p.fraction_for_context(context);
            assert!(f > 0.0 && f <= 1.0, "page {page} context {context}: {f}");
        }
        for batch in [u64::MAX, 1 << 40] {
            assert_eq!(
                p.max_context(batch, PoolLayout::Avmp { ssm_fraction: 0.5 })
                    .unwrap(),
                0
            );
        }
    }
    // A page larger than the budget, or one whose size exceeds 64 bits, is
    // refused rather than aligned past 2^64.
    let mut wide = m.clone();
    wide.kv_heads = 1 << 20;
    wide.n_heads = 1 << 20;
    wide.head_dim = 1 << 16;
    assert!(plan(&wide, u32::MAX, u64::MAX).is_err());
    assert!(plan(&m, u32::MAX, GIB).is_err());
}
