//! `marconi-sim pools` and `marconi-sim plan` end to end on small inputs:
//! the static-vs-AVMP-vs-unified table prints with the best static split,
//! `--json` carries every row, the plan prints hand-checkable numbers, and
//! bad layouts fail with a reason.

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

const SMALL: &[&str] = &[
    "pools",
    "--workload",
    "chat",
    "--sessions",
    "4",
    "--capacity",
    "512MB",
    "--alpha",
    "1",
    "--fractions",
    "0.1,0.3",
    "--threads",
    "2",
    "-q",
];

#[test]
fn pools_prints_the_static_avmp_unified_table() {
    let out = ok(SMALL);
    for want in [
        "static:0.10",
        "static:0.30",
        "single",
        "avmp:0.50",
        "unified",
        "best static split: static:",
        "avmp:0.50 vs best static:",
    ] {
        assert!(out.contains(want), "no {want:?} in\n{out}");
    }
    let mut args = SMALL.to_vec();
    args.push("--json");
    let rows: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 5);
    for r in rows {
        for k in [
            "layout",
            "token_hit_rate",
            "refused",
            "migrations",
            "bytes_migrated",
        ] {
            assert!(r.get(k).is_some(), "no {k} in {r}");
        }
        let h = r["token_hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&h));
    }
}

#[test]
fn bad_layouts_fail_with_a_reason() {
    let o = sim(&["pools", "--pools", "static:1.5", "-q"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("(0, 1)"));
    let o = sim(&["pools", "--pools", "dynamic", "-q"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown layout"));
}

#[test]
fn plan_prints_the_start_up_numbers() {
    // Jamba-1.5-Mini at 10 GiB, 16-token pages: see marconi-gpu's
    // tests/plan.rs for the hand computation of these numbers.
    let out = ok(&[
        "plan",
        "--model",
        "jamba-1.5-mini",
        "--budget",
        "10GiB",
        "--fractions",
        "0.25",
        "--contexts",
        "8192",
    ]);
    assert!(out.contains("page 262144 B, state slot 9175040 B"), "{out}");
    assert!(
        out.contains("all KV: 655360 tokens; all states: 1170 slots"),
        "{out}"
    );
    assert!(out.contains("30720"), "{out}");
    assert!(out.contains("avmp 74"), "{out}");
    assert!(out.contains("static:0.25=60"), "{out}");
    let json = ok(&[
        "plan",
        "--budget",
        "4GB",
        "--converge",
        "--workload",
        "chat",
        "--sessions",
        "3",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let f = v["converged"]["final_fraction"].as_f64().unwrap();
    assert!(f > 0.0 && f < 1.0);
    assert!(v["plan"]["state_slot_bytes"].as_u64().unwrap() > 0);
}
