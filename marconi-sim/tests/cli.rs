//! The binary end to end on a small generated trace: every subcommand runs,
//! `--json` has the documented fields, figures are written, bad input fails
//! with the line and reason, bad flags and empty traces fail before any
//! output.

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
fn avmp_table_matches_the_built_in_golden_runs() {
    // Without --dir: the data built into marconi-gpu, nothing outside the
    // repository.
    let out = ok(&["avmp", "--quiet"]);
    assert!(
        out.contains("| avmp_dynamic_b128 | 9.0 | 364.3 | 136.7 | 510.0 | 9.3 |"),
        "{out}"
    );
    assert!(
        out.contains("240/240 runs identical to the built-in golden runs"),
        "{out}"
    );
    // With --dir: that directory's files.
    let o = sim(&["avmp", "--dir", "/nonexistent/avmp"]);
    assert!(!o.status.success());
    assert!(String::from_utf8(o.stderr).unwrap().contains("traces.json"));
}

/// A valid two-request trace in `dir`.
fn tiny_trace(dir: &Path) -> std::path::PathBuf {
    let trace = dir.join("tiny.jsonl");
    std::fs::write(
        &trace,
        "{\"id\":0,\"session\":0,\"arrival_s\":0,\"input\":[1,2,3],\"output\":[4]}\n\
         {\"id\":1,\"session\":0,\"arrival_s\":1,\"extends\":0,\"append\":[5],\"output\":[6]}\n",
    )
    .unwrap();
    trace
}

#[track_caller]
fn fails_with(args: &[&str], expect: &str) {
    let o = sim(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{args:?} succeeded");
    assert!(err.contains(expect), "{args:?}: {err:?} lacks {expect:?}");
    assert!(o.stdout.is_empty(), "{args:?} printed {:?}", o.stdout);
}

#[test]
fn an_empty_or_blank_trace_fails_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    for (name, text) in [("empty", ""), ("blank", "\n  \n\t\n")] {
        let p = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&p, text).unwrap();
        let want = "the trace has no request";
        fails_with(&["replay", "--trace", s(&p), "--policy", "oracle"], want);
        fails_with(
            &["compare", "--trace", s(&p), "--out-dir", s(&out), "-q"],
            want,
        );
        fails_with(
            &[
                "sweep",
                "capacity",
                "--trace",
                s(&p),
                "--out-dir",
                s(&out),
                "-q",
            ],
            want,
        );
    }
    assert!(!out.exists(), "figures written for an empty trace");
}

#[test]
fn numeric_flags_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let t = tiny_trace(dir.path());
    let out = dir.path().join("gen.jsonl");
    // `--flag=value`: clap would take a separate "-1" for a flag.
    let replay = |flag: &'static str, v: &'static str| {
        let t = s(&t).to_string();
        move || {
            let arg = format!("{flag}={v}");
            fails_with(
                &["replay", "--trace", &t, "--policy", "marconi", &arg],
                flag,
            );
        }
    };
    for (flag, v) in [
        ("--gpu-flops", "0"),
        ("--gpu-flops", "-1"),
        ("--gpu-flops", "inf"),
        ("--gpu-efficiency", "0"),
        ("--gpu-efficiency", "1.5"),
        ("--gpu-efficiency", "nan"),
        ("--decode-ms", "nan"),
        ("--decode-ms", "-1"),
        ("--alpha", "nan"),
        ("--alpha", "-0.5"),
        ("--alpha", "inf"),
        ("--block-size", "0"),
        ("--capacity", "0"),
        ("--capacity", "0.1"),
    ] {
        replay(flag, v)();
    }
    let o = s(&out);
    for (args, flag) in [
        (
            vec![
                "trace",
                "synth",
                "--kind",
                "chat",
                "--out",
                o,
                "--sessions",
                "0",
            ],
            "--sessions",
        ),
        (
            vec![
                "trace",
                "synth",
                "--kind",
                "chat",
                "--out",
                o,
                "--session-rate",
                "0",
            ],
            "--session-rate",
        ),
        (
            vec![
                "trace",
                "synth",
                "--kind",
                "chat",
                "--out",
                o,
                "--session-rate",
                "nan",
            ],
            "--session-rate",
        ),
        (
            vec![
                "trace",
                "synth",
                "--kind",
                "chat",
                "--out",
                o,
                "--max-input",
                "0",
            ],
            "--max-input",
        ),
        (
            vec!["trace", "sharegpt", "--out", o, "--sessions", "0"],
            "--sessions",
        ),
        (
            vec!["trace", "sharegpt", "--out", o, "--session-rate=-2"],
            "--session-rate",
        ),
        (
            vec!["trace", "sharegpt", "--out", o, "--think-s=-1"],
            "--think-s",
        ),
        (
            vec!["trace", "sharegpt", "--out", o, "--think-s", "inf"],
            "--think-s",
        ),
        (
            vec![
                "sweep",
                "capacity",
                "--capacities",
                "1GB,0",
                "--trace",
                s(&t),
            ],
            "--capacities",
        ),
        (
            vec!["sweep", "state-dim", "--dims", "0", "--trace", s(&t)],
            "--dims",
        ),
        (vec!["paper", "--seeds", "0"], "--seeds"),
    ] {
        fails_with(&args, flag);
    }
    assert!(!out.exists());
}

#[test]
fn configuration_errors_come_before_the_trace() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.jsonl");
    // The model is checked before the (missing) trace is read.
    for cmd in ["replay", "compare"] {
        let mut args = vec![cmd, "--trace", s(&missing), "--model", "gpt-9"];
        if cmd == "replay" {
            args.extend(["--policy", "marconi"]);
        }
        fails_with(&args, "unknown model \"gpt-9\"");
        let err = String::from_utf8(sim(&args).stderr).unwrap();
        assert!(!err.contains("missing.jsonl"), "{err}");
    }
}

#[test]
fn messages_say_what_is_wrong_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let t = tiny_trace(dir.path());
    let t = s(&t);
    let replay = |extra: &[&str], want: &str| {
        let mut args = vec!["replay", "--trace", t, "--policy", "marconi"];
        args.extend(extra);
        fails_with(&args, want);
    };
    replay(&["--capacity", "0"], "a capacity of 0 holds nothing");
    // A separate "-5GB" reaches the parser instead of reading as a flag.
    replay(&["--capacity", "-5GB"], "-5GB is negative");
    replay(&["--model", "jamba"], "did you mean jamba-1.5-mini?");
    replay(&["--model", "paper7b"], "did you mean paper-7b?");
    // No preset is near: no suggestion of an unrelated one, and the way to
    // name any model (its config.json) is said.
    let far = |extra: &[&str]| {
        let mut args = vec!["replay", "--trace", t, "--policy", "marconi"];
        args.extend(extra);
        let err = String::from_utf8(sim(&args).stderr).unwrap();
        assert!(!err.contains("did you mean"), "{err}");
        assert!(err.contains("config.json"), "{err}");
    };
    far(&["--model", "llama-3-8b"]);
    // A Hugging Face config.json by path is a model; a broken one says why.
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"model_type": "jamba", "hidden_size": 64, "num_hidden_layers": 4,
        "attn_layer_period": 4, "attn_layer_offset": 1, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}"#,
    )
    .unwrap();
    let out = sim(&[
        "replay",
        "--trace",
        t,
        "--policy",
        "marconi",
        "--model",
        s(&config),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&config, "{\"model_type\": \"jamba\"}").unwrap();
    replay(&["--model", s(&config)], "model config");
    let array = dir.path().join("array.json");
    std::fs::write(&array, "[{\"id\": 0, \"conversations\": []}]\n").unwrap();
    fails_with(
        &["replay", "--trace", s(&array), "--policy", "marconi"],
        "trace line 1: a JSON array: a trace is JSON lines",
    );
    // An unusable --out-dir fails before any replay (nothing on stdout).
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let under = file.join("figures");
    for (out, want) in [
        (s(&file), "a file of that name exists"),
        (s(&under), "cannot create the directory"),
    ] {
        fails_with(&["compare", "--trace", t, "--out-dir", out, "-q"], want);
        fails_with(
            &["sweep", "state-dim", "--trace", t, "--out-dir", out, "-q"],
            want,
        );
    }
}

#[test]
fn the_table_says_what_its_columns_and_alpha_mean() {
    let dir = tempfile::tempdir().unwrap();
    let t = tiny_trace(dir.path());
    let out = dir.path().join("out");
    let help = ok(&["compare", "--help"]);
    for col in ["rejected", "evictions", "sim req/s", "sim Mtok/s", "alpha"] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(col)),
            "{col} undefined in:\n{help}"
        );
    }
    assert!(help.contains("the simulator's own speed"), "{help}");
    let compare = |extra: &[&str]| {
        let mut args = vec!["compare", "--trace", s(&t), "--out-dir", s(&out), "-q"];
        args.extend(extra);
        ok(&args)
    };
    let table = compare(&[]);
    // The alpha column is the fifth from the right.
    let alpha_of = |policy: &str| {
        let row = table.lines().find(|l| l.starts_with(policy)).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        cols[cols.len() - 4].to_owned()
    };
    assert_eq!(alpha_of("marconi"), "0.00", "{table}");
    for p in ["sglang-plus", "vllm-plus", "no-cache", "oracle"] {
        assert_eq!(alpha_of(p), "-", "{table}");
    }
    // Two requests: nothing evicted, so α was never tuned, and the table says so.
    assert!(
        table.contains("note: marconi's alpha was never tuned: nothing was evicted"),
        "{table}"
    );
    assert!(!compare(&["--alpha", "0.5"]).contains("never tuned"));
    // replay and compare share the default capacity.
    let json = ok(&["replay", "--trace", s(&t), "--policy", "marconi", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["capacity_bytes"], 10_000_000_000u64);
    assert!(table.contains("capacity 10 GB"), "{table}");
}

/// Seed lists take half-open ranges; an empty or malformed one fails
/// before any trace is made, saying which item is wrong.
#[test]
fn battery_seeds_take_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let out = ok(&[
        "battery",
        "-q",
        "--no-sharegpt",
        "--quick",
        "--seeds",
        "2..4,7",
        "--fractions",
        "0.2",
        "--out-dir",
        s(dir.path()),
    ]);
    for seed in ["| 2 |", "| 3 |", "| 7 |"] {
        assert!(out.contains(seed), "{seed} missing:\n{out}");
    }
    assert!(
        !out.contains("| 4 |"),
        "the range's end is excluded:\n{out}"
    );
    // Three seeds per workload: the per-cell means are printed.
    assert!(out.contains("| agentic | 20% | 3 |"), "{out}");
    assert!(
        out.contains("3 cells (workload × capacity, at least 3 seeds each)"),
        "{out}"
    );
    fails_with(&["battery", "--seeds", "4..4"], "4..4: an empty range");
    fails_with(&["battery", "--seeds", "1,x"], "\"x\" is not a seed");
}

#[test]
fn a_missing_trace_is_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.jsonl");
    let m = s(&missing);
    for args in [
        vec!["replay", "--trace", m, "--policy", "marconi"],
        vec!["compare", "--trace", m],
        vec!["route", "--trace", m],
        vec!["pools", "--trace", m],
    ] {
        let o = sim(&args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8(o.stderr).unwrap();
        assert_eq!(err.matches("missing.jsonl").count(), 1, "{args:?}: {err}");
        assert!(err.contains("No such file"), "{args:?}: {err}");
    }
}

#[test]
fn route_takes_quiet() {
    let o = sim(&["route", "--help"]);
    let help = String::from_utf8(o.stdout).unwrap();
    assert!(help.contains("-q, --quiet"), "{help}");
}

#[test]
fn pools_help_explains_every_column() {
    let help = String::from_utf8(sim(&["pools", "--help"]).stdout).unwrap();
    for col in [
        "refused",
        "ssm frac",
        "moved",
        "migrations",
        "rejected",
        "tok hit",
    ] {
        assert!(
            help.contains(&format!("  {col} ")),
            "{col} not explained:\n{help}"
        );
    }
}
