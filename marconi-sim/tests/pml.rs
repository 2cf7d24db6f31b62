//! `marconi-sim pml` end to end: the JSON layout of hand-checked schemas
//! and prompts, the table as a snapshot, and bad input failing with
//! `file:line:column` and a non-zero exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../marconi-pml/tests/fixtures")
        .join(name)
}

fn pml(schema: &Path, prompt: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_marconi-sim"))
        .arg("pml")
        .arg("--schema")
        .arg(schema)
        .arg("--prompt")
        .arg(prompt)
        .args(extra)
        .output()
        .expect("runs")
}

/// `(name, kind, start, len, cached)` per segment of `--json`.
fn segments(o: &Output) -> Vec<(Option<String>, String, u64, u64, bool)> {
    assert!(
        o.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let obj = v.as_object().unwrap();
    assert_eq!(obj.keys().collect::<Vec<_>>(), ["segments"]);
    obj["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let s = s.as_object().unwrap();
            assert_eq!(s.len(), 5, "{s:?}");
            (
                s["name"].as_str().map(String::from),
                s["kind"].as_str().unwrap().to_string(),
                s["start"].as_u64().unwrap(),
                s["len"].as_u64().unwrap(),
                s["cached"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn seg(
    name: Option<&str>,
    kind: &str,
    start: u64,
    len: u64,
    cached: bool,
) -> (Option<String>, String, u64, u64, bool) {
    (name.map(String::from), kind.to_string(), start, len, cached)
}

#[test]
fn travel_bytes_json() {
    // Hand-computed in marconi-pml's tests/layout.rs (nested modules).
    let o = pml(
        &fixture("travel_schema.xml"),
        &fixture("travel_prompt.xml"),
        &["--json"],
    );
    assert_eq!(
        segments(&o),
        [
            seg(None, "anonymous", 0, 15, true),
            seg(Some("travel-plan"), "module", 15, 8, true),
            seg(Some("days"), "param", 23, 2, false),
            seg(Some("travel-plan"), "module", 27, 6, true),
            seg(Some("overseas"), "module", 33, 7, true),
            seg(Some("rome"), "module", 40, 12, true),
            seg(Some("overseas"), "module", 52, 9, true),
            seg(Some("travel-plan"), "module", 61, 4, true),
            seg(None, "anonymous", 65, 15, true),
            seg(None, "text", 80, 9, false),
        ]
    );
}

#[test]
fn figure2_tiktoken_json() {
    // cl100k_base: "Plan a trip of " 5 tokens (the space before the
    // parameter is text, its own token), "3 days" 2, "." 1; the union
    // (tokyo 9 tokens, miami 7) starts at 8 and ends at 17; the prompt's
    // text follows miami's end.
    let o = pml(
        &fixture("figure2_schema.xml"),
        &fixture("figure2_prompt.xml"),
        &["--json", "--tokenizer", "tiktoken"],
    );
    assert_eq!(
        segments(&o),
        [
            seg(Some("trip-plan"), "module", 0, 5, true),
            seg(Some("duration"), "param", 5, 2, false),
            seg(Some("trip-plan"), "module", 7, 1, true),
            seg(Some("miami"), "module", 8, 7, true),
            seg(None, "text", 15, 5, false),
        ]
    );
}

#[test]
fn figure2_tiktoken_table() {
    let o = pml(
        &fixture("figure2_schema.xml"),
        &fixture("figure2_prompt.xml"),
        &["--tokenizer", "tiktoken"],
    );
    assert!(o.status.success());
    insta::assert_snapshot!(String::from_utf8(o.stdout).unwrap());
}

fn fails(schema: &str, prompt: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (s, p) = (dir.path().join("s.xml"), dir.path().join("p.xml"));
    std::fs::write(&s, schema).unwrap();
    std::fs::write(&p, prompt).unwrap();
    let o = pml(&s, &p, &["--json"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(o.stdout.is_empty());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    err.replace(dir.path().to_str().unwrap(), "DIR")
}

#[test]
fn bad_input_names_file_line_and_column() {
    let ok_schema =
        "<schema name='s'>\n<module name='a'><param name='p' len='2'/></module>\n</schema>";
    assert_eq!(
        fails(
            "<schema name='s'>\n  <module name='a'><param name='p' len='0'/></module>\n</schema>",
            "<prompt schema='s'/>"
        ),
        "marconi-sim: DIR/s.xml:2:36: len=\"0\" of param 'p' is not a positive integer\n"
    );
    assert_eq!(
        fails(ok_schema, "<prompt schema='s'>\n\n   <b/></prompt>"),
        "marconi-sim: DIR/p.xml:3:4: unknown module 'b' in schema 's'; expected one of: <a>, <system>, <user>, <assistant> or text\n"
    );
    assert_eq!(
        fails(ok_schema, "<prompt schema='s'><a p='abc'/></prompt>"),
        "marconi-sim: DIR/p.xml:1:23: argument for param 'p' of module 'a' is 3 tokens; its len is 2\n"
    );
    assert_eq!(
        fails(ok_schema, "<prompt schema='t'/>"),
        "marconi-sim: DIR/p.xml:1:9: prompt uses schema 't' but the schema given is 's'\n"
    );
    assert_eq!(
        fails(ok_schema, "<prompt schema='s'>"),
        "marconi-sim: DIR/p.xml:1:1: malformed XML: the root node was opened but never closed\n"
    );
}

#[test]
fn unreadable_and_non_utf8_files() {
    let dir = tempfile::tempdir().unwrap();
    let (s, p) = (dir.path().join("s.xml"), dir.path().join("p.xml"));
    std::fs::write(&s, b"<schema name='s'>\n  caf\xe9</schema>").unwrap();
    std::fs::write(&p, "<prompt schema='s'/>").unwrap();
    let o = pml(&s, &p, &[]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(
        err,
        format!("marconi-sim: {}:2:6: not UTF-8\n", s.display())
    );
    let o = pml(&dir.path().join("missing.xml"), &p, &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8(o.stderr)
        .unwrap()
        .contains("missing.xml: No such file"));
}

fn replay_json(args: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_marconi-sim"))
        .arg("pml-replay")
        .args(args)
        .arg("--json")
        .output()
        .expect("runs");
    assert!(
        o.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn replay_two_prompts_by_hand() {
    // Figure 2 twice, cl100k_base: 20 tokens each, 13 of module content.
    // The second prompt's two imports hit. Exact: trip-plan's first piece
    // (0..5; the argument ends the run). Composed, window 16: the later
    // pieces are 1 and 7 tokens long, all recomputed.
    let (s, p) = (fixture("figure2_schema.xml"), fixture("figure2_prompt.xml"));
    let v = replay_json(&[
        "--schema",
        s.to_str().unwrap(),
        "--prompt",
        p.to_str().unwrap(),
        "--prompt",
        p.to_str().unwrap(),
        "--tokenizer",
        "tiktoken",
    ]);
    let n = |k: &str| v[k].as_u64().unwrap();
    assert_eq!(
        [
            n("prompts"),
            n("tokens"),
            n("module_tokens"),
            n("imports"),
            n("module_hits")
        ],
        [2, 40, 26, 4, 2]
    );
    assert_eq!(
        [
            n("reused_attention"),
            n("reused_exact"),
            n("reused_composed")
        ],
        [26, 10, 10]
    );
    assert_eq!(v["module_hit_rate"].as_f64(), Some(0.5));
}

#[test]
fn replay_generated_prompts() {
    let (a, b) = (fixture("travel_schema.xml"), fixture("figure2_schema.xml"));
    let args = [
        "--schema",
        a.to_str().unwrap(),
        "--schema",
        b.to_str().unwrap(),
        "--synth",
        "300",
        "--seed",
        "7",
        "--window",
        "2",
    ];
    let v = replay_json(&args);
    assert_eq!(v, replay_json(&args), "seeded: same figures");
    let n = |k: &str| v[k].as_u64().unwrap();
    assert_eq!(n("prompts"), 300);
    assert!(n("imports") > 300 && n("module_hits") < n("imports"));
    assert!(n("reused_exact") <= n("reused_composed"));
    assert!(n("reused_composed") <= n("reused_attention"));
    assert_eq!(n("reused_attention"), n("module_tokens"));
    assert!(n("module_tokens") < n("tokens"));
    assert!(n("reused_exact") > 0);
}

#[test]
fn replay_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.xml");
    std::fs::write(&p, "<prompt schema='nope'/>").unwrap();
    let s = fixture("figure2_schema.xml");
    let o = Command::new(env!("CARGO_BIN_EXE_marconi-sim"))
        .args([
            "pml-replay",
            "--schema",
            s.to_str().unwrap(),
            "--prompt",
            p.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8(o.stderr).unwrap(),
        format!(
            "marconi-sim: {}:1:9: prompt uses schema 'nope', which is not registered (registered: cities)\n",
            p.display()
        )
    );
    let o = Command::new(env!("CARGO_BIN_EXE_marconi-sim"))
        .args(["pml-replay", "--schema", s.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8(o.stderr).unwrap().contains("no prompt"));
}

#[test]
fn replay_through_the_module_store_shows_pinning_and_eviction() {
    // paper-7b-attn: 512 KiB of KV per token. Under tiktoken the two
    // schemas' modules take 34 MiB together: at 30 MiB both cannot be
    // pinned at once.
    let (a, b) = (fixture("travel_schema.xml"), fixture("figure2_schema.xml"));
    let run = |budget: &str| {
        replay_json(&[
            "--schema",
            a.to_str().unwrap(),
            "--schema",
            b.to_str().unwrap(),
            "--synth",
            "300",
            "--seed",
            "7",
            "--tokenizer",
            "tiktoken",
            "--model",
            "paper-7b-attn",
            "--budget-mib",
            budget,
        ])
    };
    let roomy = run("64");
    let st = &roomy["store"];
    assert_eq!(st["mode"], "attention");
    assert_eq!(st["all_modules_bytes"].as_u64(), Some(35_651_584));
    let (pinned, per_prompt) = (&st["runs"][0], &st["runs"][1]);
    assert_eq!(pinned["registration"], "pinned");
    assert_eq!(pinned["schemas_registered"].as_u64(), Some(2));
    assert_eq!(pinned["evictions"].as_u64(), Some(0));
    // With room for everything, both registrations serve the same.
    assert_eq!(pinned["hits"], per_prompt["hits"]);
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    // Attention mode reuses every module token once it is resident.
    assert!(n(pinned, "reused_tokens") <= n(&roomy, "module_tokens"));
    assert!(n(pinned, "hits") > 0 && n(pinned, "misses") > 0);

    let tight = run("30");
    let (pinned, per_prompt) = (&tight["store"]["runs"][0], &tight["store"]["runs"][1]);
    // Pinned: figure 2 does not fit beside travel; its prompts go unserved.
    assert_eq!(n(pinned, "schemas_refused"), 1);
    assert!(n(pinned, "unserved") > 0);
    assert_eq!(n(pinned, "evictions"), 0);
    // Per prompt: both served in turn, unpinned modules evicted for room.
    assert_eq!(n(per_prompt, "schemas_refused"), 0);
    assert!(n(per_prompt, "evictions") > 0);
    assert!(n(per_prompt, "hits") > n(pinned, "hits"));
    for run in [pinned, per_prompt] {
        assert!(n(run, "used_bytes") <= 30 << 20);
    }
}

#[test]
fn replay_store_refuses_a_mode_the_model_lacks() {
    let s = fixture("figure2_schema.xml");
    let o = Command::new(env!("CARGO_BIN_EXE_marconi-sim"))
        .args([
            "pml-replay",
            "--schema",
            s.to_str().unwrap(),
            "--synth",
            "3",
            "--budget-mib",
            "64",
            "--model",
            "paper-7b-attn",
            "--mode",
            "composed",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8(o.stderr)
        .unwrap()
        .contains("--mode composed does not apply to paper-7b-attn (attention-only)"));
}
