//! Data-driven admission and lookup cases: each script is a list of
//! requests `input / output` (token ranges `a..b` and single ids), served in
//! order; the rendering shows what each lookup found and planned.

use insta::assert_snapshot;
use marconi_core::{AdmissionPolicy, CacheConfig, ModelSpec, PrefixCache};

fn toks(s: &str) -> Vec<u32> {
    let mut v = Vec::new();
    for part in s.split_whitespace() {
        if let Some((a, b)) = part.split_once("..") {
            v.extend(a.parse::<u32>().unwrap()..b.parse::<u32>().unwrap());
        } else {
            v.push(part.parse().unwrap());
        }
    }
    v
}

/// Serves every line of `script` and renders one line per request, then the
/// tree's size.
fn check(cfg: CacheConfig, script: &str) -> String {
    let mut cache = PrefixCache::new(cfg).unwrap();
    let mut out = String::new();
    for line in script.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (input, output) = line.split_once('/').unwrap_or((line, ""));
        let (input, output) = (toks(input), toks(output));
        let s = cache.serve(0, &input, &output).unwrap();
        cache.check_invariants();
        out += &format!(
            "in={} kv={} hit={} plan={:?}\n",
            input.len(),
            s.kv_matched_tokens,
            s.hit_tokens,
            s.planned
        );
    }
    let st = cache.stats();
    out += &format!(
        "nodes={} states={} unusable={}",
        st.nodes, st.states, st.kv_matched_unusable_tokens
    );
    out
}

/// Marconi admission as the paper has it: these scripts share prefixes of
/// a few tokens, which the default `min_branch_depth` would not checkpoint.
fn marconi() -> CacheConfig {
    CacheConfig {
        min_branch_depth: 0,
        ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), u64::MAX / 2)
    }
}

#[test]
fn shared_prefix_of_eight_becomes_a_branch_and_then_hits() {
    // A cached 20-token sequence; a prompt sharing its first 8 tokens plans a
    // checkpoint at the branch (8); the next one sharing those 8 hits 8.
    assert_snapshot!(check(marconi(), "
        0..20
        0..8 100..112
        0..8 200..210
    "), @r"
    in=20 kv=0 hit=0 plan=[]
    in=20 kv=8 hit=0 plan=[8]
    in=18 kv=8 hit=8 plan=[]
    nodes=4 states=4 unusable=8
    ");
}

#[test]
fn a_match_ending_inside_an_edge_reuses_nothing() {
    assert_snapshot!(check(marconi(), "
        0..20
        0..15 99
    "), @r"
    in=20 kv=0 hit=0 plan=[]
    in=16 kv=15 hit=0 plan=[15]
    nodes=3 states=3 unusable=15
    ");
}

#[test]
fn same_prompt_different_answer_branches_at_the_prompt_end() {
    // Prompt 0..10 answered with 100..105, then the same prompt answered with
    // 200..205: the branch is at the end of the prompt (10), not inside the
    // first answer; a third request with that prompt then hits 10.
    assert_snapshot!(check(marconi(), "
        0..10 / 100..105
        0..10 / 200..205
        0..10 300 / 400
    "), @r"
    in=10 kv=0 hit=0 plan=[]
    in=10 kv=10 hit=0 plan=[10]
    in=11 kv=10 hit=10 plan=[]
    nodes=4 states=4 unusable=9
    ");
}

#[test]
fn multi_turn_chat_extends_the_previous_turn() {
    // Each turn's input is the whole history; it hits the previous turn's
    // final state (after its last decoded token) and plans nothing.
    assert_snapshot!(check(marconi(), "
        0..50 / 1000..1010
        0..50 1000..1010 2000..2020 / 3000..3030
        0..50 1000..1010 2000..2020 3000..3030 4000..4005 / 5000..5001
    "), @r"
    in=50 kv=0 hit=0 plan=[]
    in=80 kv=60 hit=60 plan=[]
    in=115 kv=110 hit=110 plan=[]
    nodes=3 states=3 unusable=0
    ");
}

#[test]
fn whole_input_cached_still_recomputes_the_last_token() {
    // The input equals a cached sequence with a state at its end: the hit
    // stops at the deepest state before the last token (here 8), because the
    // last token must run to produce the first output's logits.
    assert_snapshot!(check(marconi(), "
        0..20
        0..8 100..112
        0..8 200..210
        0..20
    "), @r"
    in=20 kv=0 hit=0 plan=[]
    in=20 kv=8 hit=0 plan=[8]
    in=18 kv=8 hit=8 plan=[]
    in=20 kv=20 hit=8 plan=[]
    nodes=4 states=4 unusable=19
    ");
}

#[test]
fn checkpoint_grid_rounds_branches_inside_the_prefill() {
    // Chunked state passing with chunks of 16: a branch at 40 is saved at 32
    // (paper §4.1: "checkpoint the state at token 64" for a branch at 80).
    let cfg = CacheConfig {
        checkpoint_grid: 16,
        ..marconi()
    };
    assert_snapshot!(check(cfg, "
        0..100
        0..40 500..560
        0..40 600..660
    "), @r"
    in=100 kv=0 hit=0 plan=[]
    in=100 kv=40 hit=0 plan=[32]
    in=100 kv=40 hit=32 plan=[]
    nodes=5 states=4 unusable=48
    ");
}

#[test]
fn all_blocks_saves_a_state_every_block() {
    let cfg = CacheConfig::vllm_plus(ModelSpec::preset("paper-7b").unwrap(), u64::MAX / 2, 32);
    assert_snapshot!(check(cfg, "
        0..100 / 100..110
        0..70 900..950
    "), @r"
    in=100 kv=0 hit=0 plan=[32, 64, 96]
    in=120 kv=70 hit=64 plan=[96]
    nodes=7 states=4 unusable=6
    ");
}

#[test]
fn attention_only_models_hit_any_matched_prefix() {
    let cfg = CacheConfig::marconi(ModelSpec::preset("paper-7b-attn").unwrap(), u64::MAX / 2);
    assert_snapshot!(check(cfg, "
        0..20
        0..15 99
        0..20
    "), @r"
    in=20 kv=0 hit=0 plan=[]
    in=16 kv=15 hit=15 plan=[]
    in=20 kv=20 hit=19 plan=[]
    nodes=3 states=0 unusable=0
    ");
}

#[test]
fn pages_align_matches_and_splits() {
    // Page size 4: matches, plans and splits land on page boundaries.
    let cfg = CacheConfig {
        page_size: 4,
        ..marconi()
    };
    assert_snapshot!(check(cfg, "
        0..21
        0..10 100..110
        0..10 200..210
    "), @r"
    in=21 kv=0 hit=0 plan=[]
    in=20 kv=8 hit=0 plan=[8]
    in=20 kv=8 hit=8 plan=[]
    nodes=4 states=4 unusable=8
    ");
}

#[test]
fn oracle_reuses_every_matched_token() {
    let cfg = CacheConfig::oracle(ModelSpec::preset("paper-7b").unwrap());
    assert_snapshot!(check(cfg, "
        0..20 / 20..25
        0..13 77
    "), @r"
    in=20 kv=0 hit=0 plan=[]
    in=14 kv=13 hit=13 plan=[]
    nodes=3 states=0 unusable=0
    ");
}

#[test]
fn admission_policy_names_roundtrip() {
    // AllBlocks with a block size that is not a page multiple is refused.
    let cfg = CacheConfig {
        page_size: 16,
        admission: AdmissionPolicy::AllBlocks { block_size: 24 },
        ..marconi()
    };
    assert!(PrefixCache::new(cfg).is_err());
}
