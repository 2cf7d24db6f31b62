//! The PML functions through the C ABI: layouts with the byte tokenizer and
//! a caller's callback, errors with line and column in `marconi_pml_error`,
//! NULL and length checks, buffers too small, a failing tokenizer.

use std::ffi::{c_void, CStr};
use std::ptr::{null, null_mut};

use marconi::marconi_status;
use marconi::pml::*;

mod common;
use common::{blank_segment, pml_layout};

const SCHEMA: &str = include_str!("../../marconi-pml/tests/fixtures/figure2_schema.xml");
const PROMPT: &str = include_str!("../../marconi-pml/tests/fixtures/figure2_prompt.xml");

/// One token per whitespace-separated word (the id is the word's length).
unsafe extern "C" fn words(
    _: *mut c_void,
    text: *const u8,
    len: usize,
    out: *mut u32,
    cap: usize,
) -> i64 {
    // SAFETY: the library passes `len` readable bytes.
    let t = std::str::from_utf8(unsafe { std::slice::from_raw_parts(text, len) }).unwrap();
    let ids: Vec<u32> = t.split_whitespace().map(|w| w.len() as u32).collect();
    if ids.len() <= cap {
        // SAFETY: cap writable u32s.
        unsafe { std::ptr::copy_nonoverlapping(ids.as_ptr(), out, ids.len()) };
    }
    ids.len() as i64
}

unsafe extern "C" fn failing(
    user: *mut c_void,
    _: *const u8,
    _: usize,
    _: *mut u32,
    _: usize,
) -> i64 {
    // SAFETY: the test passes a pointer to an i64.
    unsafe { *user.cast::<i64>() }
}

fn new_error() -> marconi_pml_error {
    marconi_pml_error {
        line: 0,
        col: 0,
        message: [0; MARCONI_PML_ERROR_MESSAGE_BYTES],
    }
}

fn message(e: &marconi_pml_error) -> String {
    // SAFETY: the library NUL-terminates the message.
    unsafe { CStr::from_ptr(e.message.as_ptr()) }
        .to_str()
        .unwrap()
        .to_string()
}

fn schema(xml: &str, tok: marconi_pml_tokenize_fn) -> Result<*mut marconi_pml_schema, Failure> {
    let mut out = null_mut();
    let mut err = new_error();
    // SAFETY: valid buffers.
    let st = unsafe {
        marconi_pml_schema_new(xml.as_ptr(), xml.len(), tok, null_mut(), &mut out, &mut err)
    };
    if st == marconi_status::Ok {
        Ok(out)
    } else {
        Err(Box::new((st, err)))
    }
}

type Layout = (Vec<marconi_pml_segment>, Vec<u32>);

/// A refused call: its status and error (boxed: the error holds 256 bytes).
type Failure = Box<(marconi_status, marconi_pml_error)>;

fn layout(
    s: *const marconi_pml_schema,
    xml: &str,
    tok: marconi_pml_tokenize_fn,
) -> Result<Layout, Failure> {
    let mut segs = vec![blank_segment(); 64];
    let mut toks = vec![0u32; 4096];
    let mut err = new_error();
    let st = pml_layout(s, xml, tok, &mut segs, &mut toks, &mut err);
    if st != marconi_status::Ok {
        return Err(Box::new((st, err)));
    }
    Ok((segs, toks))
}

fn name(s: *const marconi_pml_schema, module: i32, param: i32) -> String {
    let mut buf = [0 as std::ffi::c_char; 64];
    // SAFETY: 64 writable bytes.
    let n = unsafe { marconi_pml_name(s, module, param, buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by the library.
    let got = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(n, got.len());
    got
}

#[test]
fn figure2_with_a_word_tokenizer_callback() {
    let s = schema(SCHEMA, Some(words)).unwrap();
    let (mut n, mut total, mut ns) = (0usize, 0u32, 0u64);
    // SAFETY: live handle, writable outputs.
    assert_eq!(
        unsafe { marconi_pml_schema_info(s, &mut n, &mut total, &mut ns) },
        marconi_status::Ok
    );
    assert_eq!((n, total), (3, 14));
    assert_ne!(ns, 0);
    let (segs, toks) = layout(s, PROMPT, Some(words)).unwrap();
    let got: Vec<String> = segs
        .iter()
        .map(|g| {
            let who = if g.module < 0 {
                "-".to_string()
            } else {
                name(s, g.module, g.param)
            };
            format!(
                "{:?} {who} {}+{} {} @{}",
                g.kind, g.start, g.len, g.cached, g.tokens_offset
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            "Module trip-plan 0+4 true @0",
            "Param duration 4+2 false @4",
            "Module trip-plan 6+1 true @6",
            "Module miami 7+6 true @7",
            "Text - 13+4 false @13",
        ]
    );
    // "3 days": word lengths 1 and 4.
    assert_eq!(&toks[4..6], [1, 4]);
    assert_eq!(toks.len(), 17);
    assert_eq!(name(s, 99, -1), "");
    assert_eq!(name(s, 0, 7), "");
    // SAFETY: a live handle, freed once; NULL is a no-op.
    unsafe {
        marconi_pml_schema_free(s);
        marconi_pml_schema_free(null_mut());
    }
}

#[test]
fn bad_pml_gets_line_column_and_reason() {
    let (st, e) = *schema(
        "<schema name='s'>\n  <module name='a'><param name='p' len='x'/></module></schema>",
        None,
    )
    .unwrap_err();
    assert_eq!(st, marconi_status::InvalidArgument);
    assert_eq!((e.line, e.col), (2, 36));
    assert_eq!(
        message(&e),
        "len=\"x\" of param 'p' is not a positive integer"
    );

    let s = schema(SCHEMA, None).unwrap();
    let (st, e) = *layout(s, PROMPT, None).unwrap_err();
    assert_eq!(st, marconi_status::InvalidArgument);
    assert_eq!((e.line, e.col), (2, 14));
    assert_eq!(
        message(&e),
        "argument for param 'duration' of module 'trip-plan' is 6 tokens; its len is 2"
    );

    let (_, e) = *layout(s, "<prompt schema='cities'><tokyo/><miami/></prompt>", None).unwrap_err();
    assert_eq!((e.line, e.col), (1, 33));
    assert_eq!(
        message(&e),
        "modules 'tokyo' and 'miami' are members of one <union>; import at most one"
    );

    let (_, e) = *layout(s, "<prompt schema='cities'>\n\u{e9}\u{0}", None).unwrap_err();
    assert_eq!(e.line, 2);

    let bad = b"<prompt schema='cities'>\n ab\xff</prompt>";
    let mut err = new_error();
    let (mut ns, mut nt) = (0, 0);
    // SAFETY: valid buffers; NULL outputs with capacity 0.
    let st = unsafe {
        marconi_pml_layout(
            s,
            bad.as_ptr(),
            bad.len(),
            None,
            null_mut(),
            null_mut(),
            0,
            &mut ns,
            null_mut(),
            0,
            &mut nt,
            &mut err,
        )
    };
    assert_eq!(st, marconi_status::InvalidArgument);
    assert_eq!(
        (err.line, err.col, message(&err).as_str()),
        (2, 4, "not UTF-8")
    );

    // A long reason is truncated to the buffer, NUL-terminated.
    let long = format!(
        "<schema name='s'><module name='{}'/><module name='{0}'/></schema>",
        "m".repeat(400)
    );
    let (_, e) = *schema(&long, None).unwrap_err();
    assert_eq!(message(&e).len(), MARCONI_PML_ERROR_MESSAGE_BYTES - 1);
    // SAFETY: a live handle, freed once.
    unsafe { marconi_pml_schema_free(s) };
}

#[test]
fn null_lengths_and_small_buffers() {
    let mut out = null_mut();
    // SAFETY: deliberate NULLs; the library checks them.
    unsafe {
        assert_eq!(
            marconi_pml_schema_new(null(), 5, None, null_mut(), &mut out, null_mut()),
            marconi_status::NullArgument
        );
        assert_eq!(
            marconi_pml_schema_new(
                SCHEMA.as_ptr(),
                SCHEMA.len(),
                None,
                null_mut(),
                null_mut(),
                null_mut()
            ),
            marconi_status::NullArgument
        );
        assert_eq!(
            marconi_pml_schema_new(SCHEMA.as_ptr(), 0, None, null_mut(), &mut out, null_mut()),
            marconi_status::EmptyTokens
        );
    }
    assert!(out.is_null());
    let s = schema(SCHEMA, Some(words)).unwrap();
    let (mut ns, mut nt) = (0usize, 0usize);
    let mut seg = [blank_segment(); 2];
    // The prompt's layout into `segs` of `cap` segments and no token
    // buffer, no error out.
    let mut prompt_layout = |s, tok, segs, cap| {
        // SAFETY: deliberate NULLs and short buffers.
        unsafe {
            marconi_pml_layout(
                s,
                PROMPT.as_ptr(),
                PROMPT.len(),
                tok,
                null_mut(),
                segs,
                cap,
                &mut ns,
                null_mut(),
                0,
                &mut nt,
                null_mut(),
            )
        }
    };
    for (what, s, tok, segs, cap, want) in [
        (
            "NULL schema",
            null(),
            None,
            null_mut(),
            0,
            marconi_status::NullArgument,
        ),
        (
            "NULL segments, 3",
            s,
            None,
            null_mut(),
            3,
            marconi_status::NullArgument,
        ),
        (
            "2 segments, no token buffer",
            s,
            Some(words as _),
            seg.as_mut_ptr(),
            seg.len(),
            marconi_status::BufferTooSmall,
        ),
    ] {
        assert_eq!(prompt_layout(s, tok, segs, cap), want, "{what}");
    }
    assert_eq!((ns, nt), (5, 17));
    let mut n = 0usize;
    let mut total = 0u32;
    // SAFETY: NULL schema is refused.
    assert_eq!(
        unsafe { marconi_pml_schema_info(null(), &mut n, &mut total, &mut 0) },
        marconi_status::NullArgument
    );
    // SAFETY: NULL schema gives 0.
    assert_eq!(unsafe { marconi_pml_name(null(), 0, -1, null_mut(), 0) }, 0);
    // SAFETY: a live handle, freed once.
    unsafe { marconi_pml_schema_free(s) };
}

#[test]
fn a_failing_tokenizer_fails_the_call() {
    for answer in [-1i64, i64::MAX, i64::MIN] {
        let mut user = answer;
        let mut out = null_mut();
        let mut err = new_error();
        // SAFETY: valid buffers; `user` points to an i64 as `failing` expects.
        let st = unsafe {
            marconi_pml_schema_new(
                SCHEMA.as_ptr(),
                SCHEMA.len(),
                Some(failing),
                (&raw mut user).cast(),
                &mut out,
                &mut err,
            )
        };
        assert_eq!(st, marconi_status::InvalidArgument, "{answer}");
        assert!(out.is_null());
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

    /// Arbitrary bytes as a schema or a prompt: OK or INVALID_ARGUMENT
    /// with a place, never a panic.
    #[test]
    fn arbitrary_bytes_are_refused_cleanly(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 1..300)) {
        let mut out = null_mut();
        let mut err = new_error();
        // SAFETY: valid buffers.
        let st = unsafe { marconi_pml_schema_new(bytes.as_ptr(), bytes.len(), None, null_mut(), &mut out, &mut err) };
        proptest::prop_assert!(st == marconi_status::Ok || st == marconi_status::InvalidArgument, "{st:?}");
        if st == marconi_status::Ok {
            // SAFETY: a live handle, freed once.
            unsafe { marconi_pml_schema_free(out) };
        } else {
            proptest::prop_assert!(err.line >= 1 && err.col >= 1);
        }
        let s = schema(SCHEMA, None).unwrap();
        let (mut ns, mut nt) = (0, 0);
        // SAFETY: valid buffers; empty outputs.
        let st = unsafe { marconi_pml_layout(s, bytes.as_ptr(), bytes.len(), None, null_mut(), null_mut(), 0, &mut ns, null_mut(), 0, &mut nt, &mut err) };
        proptest::prop_assert!(matches!(st, marconi_status::Ok | marconi_status::InvalidArgument | marconi_status::BufferTooSmall), "{st:?}");
        // SAFETY: a live handle, freed once.
        unsafe { marconi_pml_schema_free(s) };
    }
}
