//! The trace format: both forms, streaming expansion, every malformed case
//! with its message, writer round trips.

use marconi_sim::trace::{Base, Expander, Trace, TraceReader};

/// `(id, session, input, output)` of a request.
type Expanded = (u64, u64, Vec<u32>, Vec<u32>);

/// Reads `text` with the streaming reader, or the error message.
fn read(text: &str) -> Result<Vec<Expanded>, String> {
    let mut r = TraceReader::new(text.as_bytes());
    let mut out = Vec::new();
    loop {
        match r.next_request() {
            Ok(Some(q)) => out.push((q.id, q.session, q.input().to_vec(), q.output().to_vec())),
            Ok(None) => return Ok(out),
            Err(e) => return Err(e.to_string()),
        }
    }
}

#[track_caller]
fn check_err(text: &str, expect: &str) {
    let got = read(text).expect_err("malformed trace accepted");
    assert_eq!(got, expect);
    // The in-memory loader reports the same.
    let got = Trace::read(text.as_bytes()).expect_err("malformed trace accepted");
    assert_eq!(got.to_string(), expect);
}

#[test]
fn full_and_compact_forms_expand_alike() {
    let text = r#"{"id": 0, "session": 3, "arrival_s": 1.25, "input": [1, 2, 3], "output": [4, 5]}
{"id": 1, "session": 4, "arrival_s": 2, "input": [9], "output": [8]}

{"id": 7, "session": 3, "arrival_s": 9.5, "extends": 0, "append": [6], "output": [7]}
{"id": 8, "session": 3, "arrival_s": 9.5, "input": [1, 2, 3, 4, 5, 6, 7, 10], "output": []}
{"id": 9, "session": 5, "arrival_s": 10, "extends": 1, "append": [], "output": [1]}
"#;
    let got = read(text).unwrap();
    assert_eq!(
        got,
        vec![
            (0, 3, vec![1, 2, 3], vec![4, 5]),
            (1, 4, vec![9], vec![8]),
            (7, 3, vec![1, 2, 3, 4, 5, 6], vec![7]),
            (8, 3, vec![1, 2, 3, 4, 5, 6, 7, 10], vec![]),
            (9, 5, vec![9, 8], vec![1]),
        ]
    );
    // The loader stores a full input that continues its session as extends.
    let t = Trace::read(text.as_bytes()).unwrap();
    let bases: Vec<Base> = t.records.iter().map(|r| r.base).collect();
    assert_eq!(
        bases,
        [
            Base::Full,
            Base::Full,
            Base::Extends(0),
            Base::Extends(7),
            Base::Extends(1)
        ]
    );
    assert_eq!(t.records[3].tokens, vec![10]);
    let mut again = Vec::new();
    t.for_each(|r| again.push((r.id, r.session, r.input().to_vec(), r.output().to_vec())));
    assert_eq!(again, got);
    // Writing and reading back gives the same trace.
    let mut buf = Vec::new();
    t.write(&mut buf).unwrap();
    let back = Trace::read(buf.as_slice()).unwrap();
    assert_eq!(back, t);
    // The full form reads back to the same compact trace.
    let mut full = Vec::new();
    t.write_full(&mut full).unwrap();
    let text_full = String::from_utf8(full.clone()).unwrap();
    assert!(!text_full.contains("extends"));
    // Same requests; compaction finds same-session continuations only, so
    // the cross-session fork (id 9) is stored in full.
    let back_full = Trace::read(full.as_slice()).unwrap();
    let mut expanded = Vec::new();
    back_full
        .for_each(|r| expanded.push((r.id, r.session, r.input().to_vec(), r.output().to_vec())));
    assert_eq!(expanded, got);
    assert_eq!(back_full.records[..4], t.records[..4]);
    assert_eq!(back_full.records[4].base, Base::Full);
    let first = String::from_utf8(buf).unwrap();
    assert_eq!(
        first.lines().nth(2).unwrap(),
        r#"{"id":7,"session":3,"arrival_s":9.5,"extends":0,"append":[6],"output":[7]}"#
    );
}

#[test]
fn streaming_keeps_one_context_per_session() {
    // 1000 turns of one session: the reader holds one growing buffer.
    let mut text = String::from(r#"{"id":0,"session":0,"arrival_s":0,"input":[1],"output":[2]}"#);
    text.push('\n');
    for i in 1..1000u32 {
        text.push_str(&format!(
            "{{\"id\":{i},\"session\":0,\"arrival_s\":{i},\"extends\":{},\"append\":[{i}],\"output\":[{i}]}}\n",
            i - 1
        ));
    }
    let mut r = TraceReader::new(text.as_bytes());
    let mut n = 0;
    while let Some(q) = r.next_request().unwrap() {
        assert_eq!(q.full.len(), 2 + 2 * n);
        n += 1;
    }
    assert_eq!(n, 1000);
    assert_eq!(r.retained_tokens(), 2 + 2 * 999);
}

#[test]
fn malformed_lines_are_rejected_with_line_and_reason() {
    let ok = r#"{"id": 0, "session": 1, "arrival_s": 0.5, "input": [1, 2], "output": [3]}"#;
    let two = |second: &str| format!("{ok}\n{second}\n");
    check_err(
        &two(
            r#"{"id": 1, "session": 1, "arrival_s": 1, "extends": 5, "append": [1], "output": []}"#,
        ),
        "trace line 2: extends 5, which is not an earlier request than 1",
    );
    check_err(
        &format!(
            "{ok}\n{}\n{}\n",
            r#"{"id": 1, "session": 2, "arrival_s": 1, "input": [7], "output": []}"#,
            r#"{"id": 4, "session": 2, "arrival_s": 1, "extends": 3, "append": [1], "output": []}"#
        ),
        "trace line 3: extends 3: no such request is retained (unknown id, or no longer the latest request of its session)",
    );
    // A superseded turn cannot be extended: only the latest of a session is kept.
    check_err(
        &format!(
            "{ok}\n{}\n{}\n",
            r#"{"id": 1, "session": 1, "arrival_s": 1, "extends": 0, "append": [4], "output": []}"#,
            r#"{"id": 2, "session": 1, "arrival_s": 1, "extends": 0, "append": [5], "output": []}"#
        ),
        "trace line 3: extends 0: no such request is retained (unknown id, or no longer the latest request of its session)",
    );
    check_err(
        &two(r#"{"id": 0, "session": 1, "arrival_s": 1, "input": [1], "output": []}"#),
        "trace line 2: id 0 after id 0: ids must increase along the trace",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 0.25, "input": [1], "output": []}"#),
        "trace line 2: arrival_s 0.25 is before the previous request's 0.5: the trace must be sorted by arrival",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [1, 2.5], "output": []}"#),
        "trace line 2: token 1 is not an integer (2.5) (column 56)",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [1, "x"], "output": []}"#),
        "trace line 2: invalid type: string \"x\", expected token 1 to be an integer in 0..2^32 (column 56)",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [4294967296], "output": []}"#),
        "trace line 2: token 0 is 4294967296, out of range: token ids are integers in 0..2^32 (column 60)",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [4294967295], "output": [-1]}"#),
        "trace line 2: token 0 is negative (-1) (column 76)",
    );
    check_err(
        &two(
            r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [1], "extends": 0, "append": [2], "output": []}"#,
        ),
        "trace line 2: both `input` and `extends`/`append`: use one form",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "extends": 0, "output": []}"#),
        "trace line 2: `extends` without `append`",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "append": [1], "output": []}"#),
        "trace line 2: `append` without `extends`",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "output": []}"#),
        "trace line 2: neither `input` nor `extends` + `append`",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [], "output": []}"#),
        "trace line 2: empty `input`",
    );
    check_err(
        &two(r#"{"session": 1, "arrival_s": 1, "input": [1], "output": []}"#),
        "trace line 2: missing `id`",
    );
    check_err(
        &two(r#"{"id": 1, "arrival_s": 1, "input": [1], "output": []}"#),
        "trace line 2: missing `session`",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "input": [1], "output": []}"#),
        "trace line 2: missing `arrival_s`",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [1]}"#),
        "trace line 2: missing `output`",
    );
    // Another format's key names: the error says which keys were not read.
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "prompt": [1], "output": []}"#),
        "trace line 2: neither `input` nor `extends` + `append`; this line also has `prompt` \
         (did you mean `input`?), which a trace does not read (keys: id, session, arrival_s, \
         input or extends + append, output, checkpoints; docs/simulator.md)",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "prompt": [1], "completion": [2]}"#),
        "trace line 2: neither `input` nor `extends` + `append`; this line also has \
         `completion` (did you mean `output`?), `prompt` (did you mean `input`?), which a trace \
         does not read (keys: id, session, arrival_s, input or extends + append, output, \
         checkpoints; docs/simulator.md)",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [1], "note": "x"}"#),
        "trace line 2: missing `output`; this line also has `note`, which a trace does not read \
         (keys: id, session, arrival_s, input or extends + append, output, checkpoints; \
         docs/simulator.md)",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": -1, "input": [1], "output": []}"#),
        "trace line 2: arrival_s -1 is not a time >= 0",
    );
    check_err(
        &two(r#"{"id": 1, "session": 1, "arrival_s": 1, "input": [1], "output": [2]"#),
        "trace line 2: EOF while parsing an object (column 67)",
    );
    check_err(&two("not json"), "trace line 2: expected ident (column 2)");
}

/// Reads raw bytes with both readers; both must give the same error.
#[track_caller]
fn check_err_bytes(bytes: &[u8], expect: &str) {
    let mut r = TraceReader::new(bytes);
    let got = loop {
        match r.next_request() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("malformed trace accepted"),
            Err(e) => break e.to_string(),
        }
    };
    assert_eq!(got, expect);
    let got = Trace::read(bytes).expect_err("malformed trace accepted");
    assert_eq!(got.to_string(), expect);
}

#[test]
fn invalid_utf8_is_reported_with_its_line() {
    let mut bytes =
        br#"{"id": 0, "session": 1, "arrival_s": 0.5, "input": [1, 2], "output": [3]}"#.to_vec();
    bytes.extend_from_slice(b"\n{\"id\": 1, \"session\": \"\xff\"}\n");
    check_err_bytes(&bytes, "trace line 2: invalid UTF-8 (column 23)");
}

#[test]
fn a_leading_byte_order_mark_is_skipped() {
    let text =
        "\u{feff}{\"id\": 0, \"session\": 1, \"arrival_s\": 0, \"input\": [1], \"output\": [2]}\n";
    assert_eq!(read(text).unwrap(), vec![(0, 1, vec![1], vec![2])]);
    assert_eq!(Trace::read(text.as_bytes()).unwrap().len(), 1);
    // Only at the start of the file: elsewhere it is a stray character.
    let ok = r#"{"id": 0, "session": 1, "arrival_s": 0, "input": [1], "output": [2]}"#;
    check_err(
        &format!("{ok}\n\u{feff}{ok}\n"),
        "trace line 2: expected value (column 1)",
    );
}

#[test]
fn numbers_beyond_64_bits_are_out_of_range_by_field() {
    let line = |field: &str, value: &str| {
        let mut v = vec![
            ("id", "1".to_string()),
            ("session", "1".to_string()),
            ("arrival_s", "1".to_string()),
            ("extends", "0".to_string()),
            ("append", "[7]".to_string()),
            ("output", "[8]".to_string()),
        ];
        for (k, x) in &mut v {
            if *k == field {
                *x = value.to_string();
            }
        }
        let body: Vec<String> = v.iter().map(|(k, x)| format!("\"{k}\": {x}")).collect();
        format!(
            "{{\"id\": 0, \"session\": 1, \"arrival_s\": 0, \"input\": [1], \"output\": [2]}}\n{{{}}}\n",
            body.join(", ")
        )
    };
    let big = "18446744073709551616"; // 2^64
    check_err(
        &line("id", big),
        "trace line 2: `id` is out of range: ids are integers in 0..2^64 (column 27)",
    );
    check_err(
        &line("session", big),
        "trace line 2: `session` is out of range: ids are integers in 0..2^64 (column 41)",
    );
    check_err(
        &line("extends", big),
        "trace line 2: `extends` is out of range: ids are integers in 0..2^64 (column 71)",
    );
    check_err(
        &line("append", &format!("[1, {big}]")),
        "trace line 2: token 1 is out of range: token ids are integers in 0..2^32 (column 88)",
    );
    check_err(
        &line("output", &format!("[{big}0]")),
        "trace line 2: token 0 is out of range: token ids are integers in 0..2^32 (column 101)",
    );
    check_err(
        &line("id", "-1"),
        "trace line 2: `id` is negative (-1) (column 9)",
    );
    check_err(
        &line("session", "2.5"),
        "trace line 2: `session` is not an integer (2.5) (column 24)",
    );
    // The largest ids still fit.
    let max = u64::MAX.to_string();
    let text = line("session", &max);
    assert_eq!(read(&text).unwrap()[1].1, u64::MAX);
}

#[test]
fn an_empty_or_blank_trace_is_an_error() {
    for text in ["", "\n", "  \n\t\n\n", "\u{feff}", "\u{feff}\n \n"] {
        check_err(
            text,
            "the trace has no request (empty, or only blank lines)",
        );
    }
}

/// A trace of `forks` sessions that each extend request 0, a `prompt`-token
/// prompt, with one appended and one output token each.
fn forks(prompt: u32, forks: u32) -> String {
    let tokens: Vec<String> = (0..prompt).map(|t| t.to_string()).collect();
    let mut text = format!(
        "{{\"id\":0,\"session\":0,\"arrival_s\":0,\"input\":[{}],\"output\":[1]}}\n",
        tokens.join(",")
    );
    for i in 1..=forks {
        text.push_str(&format!(
            "{{\"id\":{i},\"session\":{i},\"arrival_s\":1,\"extends\":0,\"append\":[{i}],\"output\":[{i}]}}\n"
        ));
    }
    // The forks continue: session 1 twice more (its own context grows).
    let n = forks + 1;
    text.push_str(&format!(
        "{{\"id\":{n},\"session\":1,\"arrival_s\":2,\"extends\":1,\"append\":[5],\"output\":[6]}}\n"
    ));
    text.push_str(&format!(
        "{{\"id\":{},\"session\":1,\"arrival_s\":3,\"extends\":{n},\"append\":[7],\"output\":[8]}}\n",
        n + 1
    ));
    text
}

#[test]
fn forks_share_their_context() {
    let (prompt, n) = (20_000u32, 300u32);
    let text = forks(prompt, n);
    let expect_input = |i: u32| -> Vec<u32> {
        let mut v: Vec<u32> = (0..prompt).collect();
        v.extend([1, i]);
        v
    };
    // Streaming: every request expands right, and the reader holds the
    // distinct tokens (the prompt once, two per fork) plus one working copy.
    let mut r = TraceReader::new(text.as_bytes());
    let mut seen = 0;
    let mut peak = 0;
    while let Some(q) = r.next_request().unwrap() {
        match q.id {
            0 => assert_eq!(q.input(), (0..prompt).collect::<Vec<_>>()),
            i if i <= u64::from(n) => {
                assert_eq!(q.input(), expect_input(i as u32));
                assert_eq!(q.output(), [i as u32]);
            }
            i if i == u64::from(n) + 1 => {
                let mut want = expect_input(1);
                want.extend([1, 5]);
                assert_eq!(q.input(), want);
            }
            _ => {
                let mut want = expect_input(1);
                want.extend([1, 5, 6, 7]);
                assert_eq!(q.input(), want);
                assert_eq!(q.output(), [8]);
            }
        }
        seen += 1;
        peak = peak.max(r.retained_tokens());
    }
    assert_eq!(seen, n + 3);
    // The prompt (and request 0's output) at most twice, stored and in the
    // working copy; two tokens per fork; session 1's later turns.
    let bound = 2 * (prompt as usize + 1) + 2 * n as usize + 16;
    assert!(peak <= bound, "reader held {peak} tokens, bound {bound}");
    // The in-memory trace and its expansion alike.
    let t = Trace::read(text.as_bytes()).unwrap();
    assert!(t.stored_tokens() <= u64::from(prompt) + 2 * u64::from(n) + 8);
    let mut ex = Expander::new();
    let mut peak = 0;
    for rec in &t.records {
        let q = ex.expand(rec).unwrap();
        if q.id == 7 {
            assert_eq!(q.input(), expect_input(7));
        }
        peak = peak.max(ex.retained_tokens());
    }
    assert!(peak <= bound, "expander held {peak} tokens, bound {bound}");
}

#[test]
fn a_long_chain_of_forks_expands_and_drops() {
    // Two sessions that each extend the other's latest request: every
    // request links to the previous one, 200,000 links deep. Expanding
    // copies only what each adds, and dropping must not recurse per link.
    use marconi_sim::trace::Record;
    let rec =
        |id: u64, session: u64, extends: Option<u64>, tokens: Vec<u32>, output: Vec<u32>| Record {
            id,
            session,
            arrival_s: 0.0,
            base: extends.map_or(Base::Full, Base::Extends),
            tokens,
            output,
            checkpoints: Vec::new(),
        };
    let mut ex = Expander::new();
    let mut len = 0;
    for id in 0..200_000u64 {
        let extends = id.checked_sub(1);
        let output = if id % 1000 == 0 { vec![] } else { vec![7] };
        len += 1 + output.len();
        let q = ex
            .expand(&rec(id, id % 2, extends, vec![id as u32], output))
            .unwrap();
        assert_eq!(q.full.len(), len);
        assert_eq!(q.input()[q.input_len - 1], id as u32);
    }
    assert!(ex.retained_tokens() <= 2 * len + 1);
    drop(ex);
    // A fork that adds nothing shares its parent's storage.
    let mut ex = Expander::new();
    ex.expand(&rec(0, 0, None, vec![1, 2], vec![3])).unwrap();
    let before = ex.retained_tokens();
    assert_eq!(
        ex.expand(&rec(1, 1, Some(0), vec![], vec![])).unwrap().full,
        [1, 2, 3]
    );
    assert_eq!(ex.retained_tokens(), before);
}
