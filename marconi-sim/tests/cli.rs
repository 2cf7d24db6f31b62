//! The binary end to end on a small generated trace: every subcommand runs,
//! `--json` has the documented fields, figures are written, bad input fails
//! with the line and reason.

use std::path::Path;
use std::process::{Command, Output};

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_marconi-sim"))
        .args(args)
        .output()
        .expect("runs")
}

fn ok(args: &[&str]) -> String {
    let o = sim(args);
    assert!(
        o.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn generate_replay_compare_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("chat.jsonl");
    ok(&[
        "trace",
        "synth",
        "--kind",
        "chat",
        "--sessions",
        "30",
        "--out",
        s(&trace),
    ]);
    let json = ok(&[
        "replay",
        "--trace",
        s(&trace),
        "--policy",
        "marconi",
        "--capacity",
        "0.5GB",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    for k in [
        "policy",
        "model",
        "capacity_bytes",
        "requests",
        "input_tokens",
        "hit_tokens",
        "token_hit_rate",
        "request_hit_rate",
        "flops_saved",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "evictions",
        "alpha",
        "wall_s",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {json}");
    }
    assert_eq!(v["capacity_bytes"], 500_000_000u64);
    assert_eq!(v["policy"], "marconi");
    assert!(v["requests"].as_u64().unwrap() > 30);

    let out = dir.path().join("out");
    let table = ok(&[
        "compare",
        "--trace",
        s(&trace),
        "--capacity",
        "1GiB",
        "--out-dir",
        s(&out),
        "--quiet",
    ]);
    for p in ["marconi", "sglang-plus", "vllm-plus", "no-cache", "oracle"] {
        assert!(
            table.lines().any(|l| l.starts_with(p)),
            "{p} missing:\n{table}"
        );
    }
    for f in ["hit_rate.svg", "ttft_cdf.svg", "hit_by_length.svg"] {
        let svg = std::fs::read_to_string(out.join(f)).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("marconi"), "{f}");
    }
    let sweep = ok(&[
        "sweep",
        "capacity",
        "--trace",
        s(&trace),
        "--capacities",
        "0.2GB,1GB",
        "--out-dir",
        s(&out),
        "--json",
        "--quiet",
    ]);
    let v: serde_json::Value = serde_json::from_str(&sweep).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 6);
    assert!(out.join("sweep_capacity.svg").exists());
}

#[test]
fn bad_input_fails_with_line_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"id\":0,\"session\":0,\"arrival_s\":0,\"input\":[1],\"output\":[]}\n\
         {\"id\":1,\"session\":0,\"arrival_s\":1,\"extends\":9,\"append\":[1],\"output\":[]}\n",
    )
    .unwrap();
    let o = sim(&["replay", "--trace", s(&trace), "--policy", "oracle"]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(
        err.contains("trace line 2: extends 9, which is not an earlier request than 1"),
        "{err}"
    );
    let o = sim(&[
        "replay",
        "--trace",
        s(&trace),
        "--policy",
        "marconi",
        "--capacity",
        "5 parsecs",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8(o.stderr)
        .unwrap()
        .contains("unknown unit"));
    let o = sim(&["compare", "--trace", s(&trace), "--model", "gpt-9"]);
    assert!(!o.status.success());
}

#[test]
fn avmp_table_matches_golden_when_the_data_is_there() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/avmp");
    let o = sim(&["avmp", "--dir", "/nonexistent/avmp"]);
    assert!(!o.status.success());
    assert!(String::from_utf8(o.stderr).unwrap().contains("traces.json"));
    if !dir.join("traces.json").exists() {
        eprintln!("skipped: no AVMP data at {}", dir.display());
        return;
    }
    let out = ok(&["avmp", "--dir", s(&dir), "--quiet"]);
    assert!(
        out.contains("| avmp_dynamic_b128 | 9.0 | 364.3 | 136.7 | 510.0 | 9.3 |"),
        "{out}"
    );
    assert!(out.contains("240/240 runs identical"), "{out}");
}
