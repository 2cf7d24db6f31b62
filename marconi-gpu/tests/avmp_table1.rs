//! Reproduces the AVMP paper's Table 1: all 240 runs of the authors' prototype
//! (`marconi-gpu/data/avmp/golden.jsonl`, built into the crate) from its 12 traces, to the integer.

use marconi_gpu::avmp::{self, RunResult};

fn key(r: &RunResult) -> (String, String, String, u64, u64) {
    (
        r.variant.clone(),
        r.workload.clone(),
        r.model.clone(),
        r.tb_gib,
        r.seed,
    )
}

#[test]
fn table1_reproduces_all_240_runs() {
    let golden = avmp::builtin_golden();
    assert_eq!(golden.len(), 240);
    let ours = avmp::run_sweep_on(&avmp::builtin_traces()).unwrap();
    assert_eq!(ours.len(), 240);

    let by_key: std::collections::HashMap<_, _> = ours.iter().map(|r| (key(r), r)).collect();
    let (mut oom, mut reb, mut mib, mut ratio) = (0, 0, 0, 0);
    let mut diffs = Vec::new();
    for g in &golden {
        let o = by_key
            .get(&key(g))
            .unwrap_or_else(|| panic!("run {:?} not in the grid", key(g)));
        oom += usize::from(o.oom == g.oom);
        reb += usize::from(o.rebalance_count == g.rebalance_count);
        mib += usize::from(o.bytes_migrated_mib == g.bytes_migrated_mib);
        ratio += usize::from((o.completion_ratio - g.completion_ratio).abs() < 1e-9);
        if *o != g {
            diffs.push(format!("ours {o:?}\n gold {g:?}"));
        }
    }
    eprintln!("matches of 240: oom {oom}, rebalance_count {reb}, bytes_migrated_MiB {mib}, completion_ratio {ratio}");
    assert!(
        diffs.is_empty(),
        "{} runs differ:\n{}",
        diffs.len(),
        diffs.join("\n")
    );

    // The paper's headline numbers follow from the rows.
    let total = |v: &str| {
        ["uniform_short", "mixed_long", "agentic_burst"]
            .iter()
            .map(|w| avmp::table_value(&ours, v, w))
            .sum::<f64>()
    };
    assert_eq!(total("avmp_dynamic_b128"), 510.0);
    assert_eq!(total("fixed_dual_mr05"), 552.0);
    let table = avmp::render_table(&ours);
    assert!(
        table.contains("| avmp_dynamic_b128 | 9.0 | 364.3 | 136.7 | 510.0 | 9.3 |"),
        "{table}"
    );
    assert!(
        table.contains("| padded_unified | 482.7 | 573.0 | 512.0 | 1567.7 | 313.7 |"),
        "{table}"
    );
}

/// Beyond the paper: demand-sized migration in 2 MiB-chunk steps after a failed
/// eviction ([`marconi_gpu::policy`]), on the same traces with the same 1× budget.
#[test]
fn demand_policy_beats_the_paper_trigger() {
    let traces = avmp::builtin_traces();
    let cells = avmp::grid(&[avmp::Variant::AvmpDynamicB128, avmp::Variant::AvmpDemand]);
    let rows = avmp::run_cells(&traces, &cells).unwrap();
    let total = |v: &str| {
        ["uniform_short", "mixed_long", "agentic_burst"]
            .iter()
            .map(|w| avmp::table_value(&rows, v, w))
            .sum::<f64>()
    };
    eprintln!("{}", avmp::render_table(&rows));
    let (paper, ours) = (total("avmp_dynamic_b128"), total("avmp_demand"));
    eprintln!("synthetic OOM total: paper's trigger {paper:.1}, demand-sized {ours:.1}");
    assert_eq!(paper, 510.0);
    assert!(
        ours < paper,
        "demand-sized migration {ours} vs the paper's {paper}"
    );
    assert!(
        avmp::table_value(&rows, "avmp_demand", "sharegpt_replay")
            <= avmp::table_value(&rows, "avmp_dynamic_b128", "sharegpt_replay")
    );
    // Same inputs, same numbers.
    assert_eq!(rows, avmp::run_cells(&traces, &cells).unwrap());
}

/// The files on disk and the copy built into the crate are the same data.
#[test]
fn builtin_data_matches_the_files() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/avmp");
    assert_eq!(
        avmp::load_traces(&dir.join("traces.json")).unwrap(),
        avmp::builtin_traces()
    );
    assert_eq!(avmp::builtin_traces().len(), 12);
    assert_eq!(
        avmp::load_golden(&dir.join("golden.jsonl")).unwrap(),
        avmp::builtin_golden()
    );
}
