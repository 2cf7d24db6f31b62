//! Application checkpoint hints in trace files: the optional per-record
//! `checkpoints` field is read (both forms, streaming and in memory),
//! checked against the input length (a clear error with the line), kept in
//! memory, written back, and used by `marconi-hinted`; files without it
//! read and write as before.

use marconi_core::ModelSpec;
use marconi_sim::replay::{replay, Policy, ReplayConfig, Report};
use marconi_sim::synth::{generate, SynthConfig, SynthKind};
use marconi_sim::trace::{Trace, TraceReader};
use proptest::prelude::*;

fn bytes(t: &Trace) -> Vec<u8> {
    let mut b = Vec::new();
    t.write(&mut b).unwrap();
    b
}

fn full_bytes(t: &Trace) -> Vec<u8> {
    let mut b = Vec::new();
    t.write_full(&mut b).unwrap();
    b
}

/// Each request's checkpoints, as the streaming reader gives them.
fn streamed(text: &[u8]) -> Result<Vec<Vec<u32>>, String> {
    let mut r = TraceReader::new(text);
    let mut out = Vec::new();
    loop {
        match r.next_request() {
            Ok(Some(q)) => out.push(q.checkpoints.to_vec()),
            Ok(None) => return Ok(out),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Each request's checkpoints, from the in-memory trace.
fn kept(t: &Trace) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    t.for_each(|r| out.push(r.checkpoints.to_vec()));
    out
}

#[test]
fn checkpoints_are_read_in_both_forms_and_written_back() {
    let text = concat!(
        r#"{"id": 0, "session": 1, "arrival_s": 0.5, "input": [1, 2, 3, 4], "output": [5], "checkpoints": [3]}"#,
        "\n",
        // Positions of the full input: 4 + 1 + 2 = 7 tokens.
        r#"{"id": 1, "session": 1, "arrival_s": 1, "extends": 0, "append": [6, 7], "output": [8], "checkpoints": [7, 4]}"#,
        "\n",
        r#"{"id": 2, "session": 2, "arrival_s": 2, "input": [1, 2], "output": []}"#,
        "\n",
    );
    let want = vec![vec![3], vec![7, 4], vec![]];
    assert_eq!(streamed(text.as_bytes()).unwrap(), want);
    let t = Trace::read(text.as_bytes()).unwrap();
    assert_eq!(kept(&t), want);
    assert_eq!(t.records[2].checkpoints, Vec::<u32>::new());
    // Written back in both forms, read back the same; a record without
    // checkpoints is written without the field.
    for b in [bytes(&t), full_bytes(&t)] {
        let text = String::from_utf8(b.clone()).unwrap();
        assert_eq!(text.matches("checkpoints").count(), 2, "{text}");
        let back = Trace::read(b.as_slice()).unwrap();
        assert_eq!(kept(&back), want);
    }
    assert_eq!(Trace::read(bytes(&t).as_slice()).unwrap(), t);
}

#[test]
fn a_file_without_checkpoints_reads_and_writes_as_before() {
    let text = concat!(
        r#"{"id":0,"session":1,"arrival_s":0.5,"input":[1,2],"output":[3]}"#,
        "\n",
        r#"{"id":1,"session":1,"arrival_s":1.0,"extends":0,"append":[4],"output":[]}"#,
        "\n",
    );
    let t = Trace::read(text.as_bytes()).unwrap();
    assert!(t.records.iter().all(|r| r.checkpoints.is_empty()));
    assert_eq!(String::from_utf8(bytes(&t)).unwrap(), text);
}

#[track_caller]
fn check_err(text: &str, expect: &str) {
    assert_eq!(
        streamed(text.as_bytes()).expect_err("bad checkpoints accepted"),
        expect
    );
    let got = Trace::read(text.as_bytes()).expect_err("bad checkpoints accepted");
    assert_eq!(got.to_string(), expect);
}

#[test]
fn a_checkpoint_outside_the_input_is_an_error_of_its_line() {
    let ok = r#"{"id": 0, "session": 1, "arrival_s": 0, "input": [1, 2, 3], "output": [4]}"#;
    check_err(
        &format!(
            "{ok}\n{}\n",
            r#"{"id": 1, "session": 2, "arrival_s": 1, "input": [1, 2], "output": [], "checkpoints": [1, 3]}"#
        ),
        "trace line 2: checkpoint 3 is not a position of the input: checkpoints are in 1..=2 (the input length)",
    );
    // The compact form counts from the start of the expanded input (3 + 1
    // + 1 = 5 tokens): 5 is in, 6 is not.
    check_err(
        &format!(
            "{ok}\n{}\n",
            r#"{"id": 1, "session": 1, "arrival_s": 1, "extends": 0, "append": [5], "output": [], "checkpoints": [5, 6]}"#
        ),
        "trace line 2: checkpoint 6 is not a position of the input: checkpoints are in 1..=5 (the input length)",
    );
    check_err(
        &format!(
            "{}\n",
            r#"{"id": 0, "session": 1, "arrival_s": 0, "input": [1], "output": [], "checkpoints": [0]}"#
        ),
        "trace line 1: checkpoint 0 is not a position of the input: checkpoints are in 1..=1 (the input length)",
    );
    for (bad, what) in [
        ("[-1]", "integer `-1`"),
        ("[4294967296]", "integer `4294967296`"),
        ("[1.5]", "floating point `1.5`"),
        ("3", "integer `3`"),
    ] {
        let line = format!(
            r#"{{"id": 0, "session": 1, "arrival_s": 0, "input": [1], "output": [], "checkpoints": {bad}}}"#
        );
        let e = Trace::read(line.as_bytes()).unwrap_err().to_string();
        assert!(e.starts_with("trace line 1: "), "{e}");
        assert!(e.contains(what), "{bad}: {e}");
    }
}

/// A record: a fresh input, or one that extends the session's previous
/// request; checkpoints drawn within the input.
fn arb_trace() -> impl Strategy<Value = String> {
    prop::collection::vec(
        (
            0u64..3,
            any::<bool>(),
            prop::collection::vec(0u32..50, 1..20),
            prop::collection::vec(0u32..50, 0..5),
            prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        ),
        1..30,
    )
    .prop_map(|recs| {
        let mut len_of: std::collections::HashMap<u64, (u64, usize)> = Default::default();
        let mut text = String::new();
        for (id, (session, extend, tokens, output, picks)) in recs.into_iter().enumerate() {
            let (form, input_len) = match len_of.get(&session) {
                Some(&(prev, n)) if extend => (
                    format!(r#""extends": {prev}, "append": {tokens:?}"#),
                    n + tokens.len(),
                ),
                _ => (format!(r#""input": {tokens:?}"#), tokens.len()),
            };
            let cps: Vec<usize> = picks.iter().map(|i| 1 + i.index(input_len)).collect();
            let cps = if cps.is_empty() {
                String::new()
            } else {
                format!(r#", "checkpoints": {cps:?}"#)
            };
            text.push_str(&format!(
                r#"{{"id": {id}, "session": {session}, "arrival_s": {id}, {form}, "output": {output:?}{cps}}}"#
            ));
            text.push('\n');
            len_of.insert(session, (id as u64, input_len + output.len()));
        }
        text
    })
}

proptest! {
    /// write → read keeps every request's checkpoints (compact and full
    /// forms), and the streaming reader sees the same.
    #[test]
    fn checkpoints_survive_a_round_trip(text in arb_trace()) {
        let t = Trace::read(text.as_bytes()).unwrap();
        let want = streamed(text.as_bytes()).unwrap();
        prop_assert_eq!(&kept(&t), &want);
        prop_assert!(want.iter().any(|c| !c.is_empty()) || !text.contains("checkpoints"));
        for b in [bytes(&t), full_bytes(&t)] {
            let back = Trace::read(b.as_slice()).unwrap();
            prop_assert_eq!(&kept(&back), &want);
            prop_assert_eq!(&streamed(&b).unwrap(), &want);
        }
    }
}

fn report(trace: &Trace, policy: Policy, capacity: u64) -> Report {
    let mut cfg = ReplayConfig::new(policy, ModelSpec::preset("paper-7b").unwrap(), capacity);
    cfg.alpha = Some(0.0);
    let mut r = replay(trace, &cfg, &mut |_| {}).unwrap().report;
    r.wall_s = 0.0;
    r
}

/// A generated trace written with its application checkpoints
/// (`trace synth --checkpoints`) replays under `marconi-hinted` as the
/// generated trace does; written without them it replays as `marconi`;
/// the hints are the ones `Trace::hints` gave in memory.
#[test]
fn marconi_hinted_uses_a_loaded_traces_checkpoints() {
    let mut c = SynthConfig::new(SynthKind::Chat);
    c.sessions = 60;
    let generated = generate(&c);
    let mut hints = Vec::new();
    generated.for_each(|r| hints.push(generated.hints(&r)));
    let with = generated.clone().with_app_checkpoints();
    assert!(with.app_prefixes.is_empty());
    let mut written_hints = Vec::new();
    with.for_each(|r| written_hints.push(with.hints(&r)));
    assert_eq!(written_hints, hints);
    assert!(hints.iter().any(|h| !h.is_empty()));
    let loaded = Trace::read(bytes(&with).as_slice()).unwrap();
    assert_eq!(loaded, with);
    let bare = Trace::read(bytes(&generated).as_slice()).unwrap();
    assert!(bare.records.iter().all(|r| r.checkpoints.is_empty()));
    for cap in [300_000_000, 2_000_000_000] {
        let in_memory = report(&generated, Policy::MarconiHinted, cap);
        assert_eq!(report(&loaded, Policy::MarconiHinted, cap), in_memory);
        let plain = report(&bare, Policy::Marconi, cap);
        let mut bare_hinted = report(&bare, Policy::MarconiHinted, cap);
        bare_hinted.policy = plain.policy.clone();
        assert_eq!(bare_hinted, plain);
        assert!(in_memory.hit_tokens > plain.hit_tokens, "{cap}");
    }
}
