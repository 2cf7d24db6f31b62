//! The trace format: both forms, streaming expansion, every malformed case
//! with its message, writer round trips.

use marconi_sim::trace::{Base, Trace, TraceReader};

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
        "trace line 2: token 0 is 4294967296, not below 2^32 (column 60)",
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
