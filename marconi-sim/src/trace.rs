//! Request traces: JSON lines, one request per line, sorted by arrival.
//!
//! ```text
//! {"id": 0, "session": 3, "arrival_s": 1.25, "input": [1, 2, 3], "output": [4, 5]}
//! {"id": 7, "session": 3, "arrival_s": 9.5, "extends": 0, "append": [6], "output": [7]}
//! ```
//!
//! `input` is the full prompt. The compact form means
//! `input = input(extends) + output(extends) + append`, so multi-turn traces
//! stay linear in size. Ids (`id`, `session`, `extends`) are integers in
//! 0..2^64, token ids integers in 0..2^32, `arrival_s` a number >= 0.
//!
//! A record may carry `"checkpoints": [positions]`: application checkpoint
//! hints, positions of its full input (after expansion, so counted from the
//! start of the conversation in the compact form too) that the application
//! declares shared with later requests (the end of a system prompt, of tool
//! definitions, of a document). Each is an integer in 1..=input length; a
//! position past the input is an error of its line. The `marconi-hinted`
//! policy passes them to `PrefixCache::lookup_hinted`; the others ignore
//! them. Absent means none: files without the field read as before, and
//! the writer omits it when a record has none.
//!
//! **Memory bound.** Reading is streaming: the reader keeps, for every
//! session, only the full token sequence of that session's latest request,
//! so memory is independent of the trace's length. Sequences are shared, not
//! copied: a request that `extends` another session's request (a fork)
//! stores only its own `append` and `output` after a link to the sequence it
//! extends, so memory follows the distinct tokens of the retained sequences,
//! not the number of forks (2,000 forks of one 200 k-token prompt hold that
//! prompt once), plus one working copy of the current request. The price is
//! a format rule: `extends` must name a request that is still the latest of
//! its session (in practice, the previous turn of a conversation, or the
//! latest turn of another session that forks it). A reference to an older
//! request is rejected as unknown.
//!
//! A file may start with a UTF-8 byte order mark; a file without any request
//! (empty, or only blank lines) is an error.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, Write};
use std::path::Path;
use std::sync::Arc;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// Where a record's input starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    /// `tokens` is the full input.
    Full,
    /// The input is the full sequence (input + output) of this request id,
    /// followed by `tokens`.
    Extends(u64),
}

/// One trace line as stored: compact, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Request id, strictly increasing along the trace.
    pub id: u64,
    /// Conversation (or agent run) the request belongs to.
    pub session: u64,
    /// Arrival time in seconds, non-decreasing along the trace.
    pub arrival_s: f64,
    /// What `tokens` is appended to.
    pub base: Base,
    /// The full input ([`Base::Full`]) or the appended tokens ([`Base::Extends`]).
    pub tokens: Vec<u32>,
    /// The decoded output.
    pub output: Vec<u32>,
    /// Application checkpoint hints: positions of the full input, each in
    /// 1..=input length (checked when the record is expanded); empty when
    /// the line has none.
    pub checkpoints: Vec<u32>,
}

/// An expanded request: its full sequence (input then output).
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// Request id.
    pub id: u64,
    /// Session id.
    pub session: u64,
    /// Arrival time in seconds.
    pub arrival_s: f64,
    /// Input tokens followed by output tokens.
    pub full: &'a [u32],
    /// Length of the input within `full`.
    pub input_len: usize,
    /// The record's application checkpoint hints (positions of the input,
    /// each in 1..=`input_len`).
    pub checkpoints: &'a [u32],
    /// Where `full` is stored, for [`share`](Self::share).
    seg: &'a Arc<Seg>,
}

impl PartialEq for Request<'_> {
    fn eq(&self, o: &Self) -> bool {
        (
            self.id,
            self.session,
            self.arrival_s,
            self.full,
            self.input_len,
            self.checkpoints,
        ) == (
            o.id,
            o.session,
            o.arrival_s,
            o.full,
            o.input_len,
            o.checkpoints,
        )
    }
}

impl Request<'_> {
    /// The input (prompt) tokens.
    pub fn input(&self) -> &[u32] {
        &self.full[..self.input_len]
    }
    /// The output (decoded) tokens.
    pub fn output(&self) -> &[u32] {
        &self.full[self.input_len..]
    }
    /// The full sequence as a handle that outlives the request without
    /// copying it (e.g. to hold while the request is in flight).
    pub fn share(&self) -> SharedSequence {
        SharedSequence(Arc::clone(self.seg))
    }
}

/// A request's full sequence, shared with the reader that expanded it: a
/// reference count, not a copy. While it is held, the session it belongs to
/// stores its later turns after a link instead of in place.
#[derive(Clone, Debug)]
pub struct SharedSequence(Arc<Seg>);

impl SharedSequence {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the sequence has no token (never, for a valid trace).
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }

    /// Replaces `out`'s contents with the sequence.
    pub fn copy_to(&self, out: &mut Vec<u32>) {
        out.clear();
        for s in self.0.chain() {
            out.extend_from_slice(&s.own);
        }
    }
}

/// Stored tokens: the whole sequence of `parent` (if any), then `own`. A
/// sequence that forks another links to it instead of copying it.
///
/// `own` only ever grows, and only while nothing else holds the segment
/// (`Arc::get_mut`), so a segment that is linked to or shared never changes:
/// a child's `base` stays its parent's length, and `(serial, len)` names the
/// same tokens for the segment's whole life.
struct Seg {
    /// Unique within the process: names this storage in the working copy.
    serial: u64,
    parent: Option<Arc<Seg>>,
    /// Links above this segment (0 for a root).
    depth: usize,
    /// Tokens before `own` (the parent's length).
    base: usize,
    own: Vec<u32>,
}

impl Seg {
    fn new(parent: Option<Arc<Seg>>, own: Vec<u32>) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        Seg {
            serial: SERIAL.fetch_add(1, Ordering::Relaxed),
            depth: parent.as_ref().map_or(0, |p| p.depth + 1),
            base: parent.as_ref().map_or(0, |p| p.len()),
            parent,
            own,
        }
    }

    fn len(&self) -> usize {
        self.base + self.own.len()
    }

    /// The segments of the sequence, root first.
    fn chain(&self) -> Vec<&Seg> {
        let mut v = vec![self];
        while let Some(p) = v[v.len() - 1].parent.as_deref() {
            v.push(p);
        }
        v.reverse();
        v
    }
}

impl fmt::Debug for Seg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the chain: it may be long.
        f.debug_struct("Seg")
            .field("serial", &self.serial)
            .field("depth", &self.depth)
            .field("base", &self.base)
            .field("own", &self.own.len())
            .finish()
    }
}

impl Drop for Seg {
    fn drop(&mut self) {
        // Unlink iteratively: dropping a long chain of forks must not
        // recurse once per link.
        let mut next = self.parent.take();
        while let Some(p) = next {
            next = Arc::try_unwrap(p).ok().and_then(|mut s| s.parent.take());
        }
    }
}

/// A malformed trace, with the 1-based line where it was found.
#[derive(Debug)]
pub enum TraceError {
    /// The line could not be read.
    Io(io::Error),
    /// The line is not a valid request.
    Line {
        /// 1-based line number.
        line: u64,
        /// Why it was rejected.
        reason: String,
    },
    /// The trace holds no request: an empty file, or only blank lines.
    Empty,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io(e) => write!(f, "reading trace: {e}"),
            TraceError::Line { line, reason } => write!(f, "trace line {line}: {reason}"),
            TraceError::Empty => {
                f.write_str("the trace has no request (empty, or only blank lines)")
            }
        }
    }
}

impl std::error::Error for TraceError {}

impl From<io::Error> for TraceError {
    fn from(e: io::Error) -> Self {
        TraceError::Io(e)
    }
}

/// Token ids as they appear in JSON, checked one by one so that a bad token
/// is reported with its index and value rather than as a generic type error.
struct Tokens(Vec<u32>);

impl<'de> Deserialize<'de> for Tokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Tokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of token ids (integers in 0..2^32)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Tokens, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(Tok(t)) = seq.next_element_seed(TokSeed(v.len()))? {
                    v.push(t);
                }
                Ok(Tokens(v))
            }
        }
        d.deserialize_seq(V)
    }
}

struct Tok(u32);
struct TokSeed(usize);

impl<'de> de::DeserializeSeed<'de> for TokSeed {
    type Value = Tok;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Tok, D::Error> {
        struct V(usize);
        impl Visitor<'_> for V {
            type Value = Tok;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "token {} to be an integer in 0..2^32", self.0)
            }
            fn visit_u64<E: de::Error>(self, x: u64) -> Result<Tok, E> {
                u32::try_from(x).map(Tok).map_err(|_| {
                    E::custom(format!(
                        "token {} is {x}, out of range: token ids are integers in 0..2^32",
                        self.0
                    ))
                })
            }
            fn visit_i64<E: de::Error>(self, x: i64) -> Result<Tok, E> {
                if x < 0 {
                    Err(E::custom(format!("token {} is negative ({x})", self.0)))
                } else {
                    self.visit_u64(x as u64)
                }
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<Tok, E> {
                // serde_json reads an integer beyond 64 bits as a float.
                Err(E::custom(match float_kind(x, 4_294_967_296.0) {
                    FloatKind::Negative => format!("token {} is negative ({x})", self.0),
                    FloatKind::Large => format!(
                        "token {} is out of range: token ids are integers in 0..2^32",
                        self.0
                    ),
                    FloatKind::Fraction => format!("token {} is not an integer ({x})", self.0),
                }))
            }
        }
        let idx = self.0;
        d.deserialize_any(V(idx))
    }
}

/// What a JSON number that serde_json could only read as a float is.
enum FloatKind {
    Negative,
    /// An integer out of range (too large for 64 bits, or written with an
    /// exponent).
    Large,
    Fraction,
}

/// `limit`: the first integer out of range.
fn float_kind(x: f64, limit: f64) -> FloatKind {
    if x < 0.0 {
        FloatKind::Negative
    } else if x.fract() == 0.0 && x >= limit {
        FloatKind::Large
    } else {
        FloatKind::Fraction
    }
}

/// Deserializes an id field (`id`, `session`, `extends`), naming the field
/// in errors.
fn id_field<'de, D: Deserializer<'de>>(d: D, field: &'static str) -> Result<Option<u64>, D::Error> {
    struct V(&'static str);
    impl Visitor<'_> for V {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "`{}` to be an integer in 0..2^64", self.0)
        }
        fn visit_u64<E: de::Error>(self, x: u64) -> Result<u64, E> {
            Ok(x)
        }
        fn visit_i64<E: de::Error>(self, x: i64) -> Result<u64, E> {
            u64::try_from(x).map_err(|_| E::custom(format!("`{}` is negative ({x})", self.0)))
        }
        fn visit_f64<E: de::Error>(self, x: f64) -> Result<u64, E> {
            // serde_json reads an integer beyond 64 bits as a float.
            Err(E::custom(
                match float_kind(x, 18_446_744_073_709_551_616.0) {
                    FloatKind::Negative => format!("`{}` is negative ({x})", self.0),
                    FloatKind::Large => {
                        format!("`{}` is out of range: ids are integers in 0..2^64", self.0)
                    }
                    FloatKind::Fraction => format!("`{}` is not an integer ({x})", self.0),
                },
            ))
        }
    }
    d.deserialize_any(V(field)).map(Some)
}

fn de_id<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    id_field(d, "id")
}
fn de_session<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    id_field(d, "session")
}
fn de_extends<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    id_field(d, "extends")
}

#[derive(Deserialize)]
struct RawLine {
    #[serde(default, deserialize_with = "de_id")]
    id: Option<u64>,
    #[serde(default, deserialize_with = "de_session")]
    session: Option<u64>,
    arrival_s: Option<f64>,
    input: Option<Tokens>,
    #[serde(default, deserialize_with = "de_extends")]
    extends: Option<u64>,
    append: Option<Tokens>,
    output: Option<Tokens>,
    checkpoints: Option<Vec<u32>>,
}

#[derive(Serialize)]
struct OutLine<'a> {
    id: u64,
    session: u64,
    arrival_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    input: Option<&'a [u32]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    extends: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    append: Option<&'a [u32]>,
    output: &'a [u32],
    #[serde(skip_serializing_if = "<[u32]>::is_empty")]
    checkpoints: &'a [u32],
}

/// Parses and checks lines one at a time (order of ids and arrivals, shape);
/// `extends` targets are checked by the [`Expander`].
#[derive(Debug, Default)]
pub struct LineParser {
    line: u64,
    last: Option<(u64, f64)>,
}

impl LineParser {
    /// A parser at line 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The 1-based number of the last line given to [`parse`](Self::parse).
    pub fn line(&self) -> u64 {
        self.line
    }

    /// Parses the next line, given as bytes: invalid UTF-8 is reported
    /// with the line. `Ok(None)` for a blank line.
    pub fn parse_bytes(&mut self, bytes: &[u8]) -> Result<Option<Record>, TraceError> {
        match std::str::from_utf8(bytes) {
            Ok(text) => self.parse(text),
            Err(e) => {
                self.line += 1;
                Err(TraceError::Line {
                    line: self.line,
                    reason: format!("invalid UTF-8 (column {})", e.valid_up_to() + 1),
                })
            }
        }
    }

    /// Parses the next line. `Ok(None)` for a blank line. A byte order mark
    /// is skipped at the start of the first line (and only there).
    pub fn parse(&mut self, text: &str) -> Result<Option<Record>, TraceError> {
        let text = match self.line {
            0 => text.strip_prefix('\u{feff}').unwrap_or(text),
            _ => text,
        };
        self.line += 1;
        if text.trim().is_empty() {
            return Ok(None);
        }
        let err = |reason: String| TraceError::Line {
            line: self.line,
            reason,
        };
        if self.last.is_none() && text.trim_start().starts_with('[') {
            return Err(err(
                "a JSON array: a trace is JSON lines, one request object per line \
                 (see docs/simulator.md, trace format); `marconi-sim trace sharegpt --path FILE` \
                 turns the ShareGPT data set into one"
                    .into(),
            ));
        }
        let raw: RawLine =
            serde_json::from_str(text.trim_end()).map_err(|e| err(json_reason(&e)))?;
        // A missing field is often a field under another name (`prompt`
        // for `input`): say which keys of the line were not read.
        let err = |reason: String| {
            let hint = unread_keys_hint(text);
            err(format!("{reason}{hint}"))
        };
        let id = raw.id.ok_or_else(|| err("missing `id`".into()))?;
        let session = raw.session.ok_or_else(|| err("missing `session`".into()))?;
        let arrival_s = raw
            .arrival_s
            .ok_or_else(|| err("missing `arrival_s`".into()))?;
        if !arrival_s.is_finite() || arrival_s < 0.0 {
            return Err(err(format!("arrival_s {arrival_s} is not a time >= 0")));
        }
        let (base, tokens) = match (raw.input, raw.extends, raw.append) {
            (Some(i), None, None) => (Base::Full, i.0),
            (None, Some(x), Some(a)) => {
                if x >= id {
                    return Err(err(format!(
                        "extends {x}, which is not an earlier request than {id}"
                    )));
                }
                (Base::Extends(x), a.0)
            }
            (Some(_), _, _) => {
                return Err(err(
                    "both `input` and `extends`/`append`: use one form".into()
                ))
            }
            (None, Some(_), None) => return Err(err("`extends` without `append`".into())),
            (None, None, Some(_)) => return Err(err("`append` without `extends`".into())),
            (None, None, None) => {
                return Err(err("neither `input` nor `extends` + `append`".into()))
            }
        };
        if base == Base::Full && tokens.is_empty() {
            return Err(err("empty `input`".into()));
        }
        let output = raw.output.ok_or_else(|| err("missing `output`".into()))?.0;
        if let Some((pid, parr)) = self.last {
            if id <= pid {
                return Err(err(format!(
                    "id {id} after id {pid}: ids must increase along the trace"
                )));
            }
            if arrival_s < parr {
                return Err(err(format!(
                    "arrival_s {arrival_s} is before the previous request's {parr}: \
                     the trace must be sorted by arrival"
                )));
            }
        }
        self.last = Some((id, arrival_s));
        Ok(Some(Record {
            id,
            session,
            arrival_s,
            base,
            tokens,
            output,
            checkpoints: raw.checkpoints.unwrap_or_default(),
        }))
    }
}

/// The keys a trace line may have.
const TRACE_KEYS: [&str; 8] = [
    "id",
    "session",
    "arrival_s",
    "input",
    "extends",
    "append",
    "output",
    "checkpoints",
];

/// For an error about a line that parsed as JSON: the line's keys that a
/// trace does not read, each with the key it probably means, or "" when
/// every key is known.
fn unread_keys_hint(text: &str) -> String {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str(text.trim_end()) else {
        return String::new();
    };
    let unread: Vec<String> = map
        .keys()
        .filter(|k| !TRACE_KEYS.contains(&k.as_str()))
        .map(|k| match likely_key(k) {
            Some(meant) => format!("`{k}` (did you mean `{meant}`?)"),
            None => format!("`{k}`"),
        })
        .collect();
    if unread.is_empty() {
        return String::new();
    }
    format!(
        "; this line also has {}, which a trace does not read (keys: id, session, arrival_s, \
         input or extends + append, output, checkpoints; docs/simulator.md)",
        unread.join(", ")
    )
}

/// The trace key that a key of another format usually names.
fn likely_key(key: &str) -> Option<&'static str> {
    Some(match key.to_ascii_lowercase().as_str() {
        "prompt" | "prompt_tokens" | "prompt_token_ids" | "input_ids" | "tokens" | "inputs" => {
            "input"
        }
        "completion" | "completion_tokens" | "response" | "output_ids" | "outputs"
        | "output_tokens" => "output",
        "arrival" | "arrival_time" | "timestamp" | "time" | "t" => "arrival_s",
        "session_id" | "conversation" | "conversation_id" | "conv_id" => "session",
        "request_id" | "req_id" => "id",
        "parent" | "parent_id" => "extends",
        _ => return None,
    })
}

fn json_reason(e: &serde_json::Error) -> String {
    // serde_json appends " at line 1 column N"; the column helps, the line is ours.
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => format!("{} (column {})", &s[..i], e.column()),
        None => s,
    }
}

/// Expands compact records into full sequences, keeping the latest sequence
/// of each session, shared rather than copied (see the module's memory bound).
#[derive(Debug, Default)]
pub struct Expander {
    /// session -> (id of its latest request, its full sequence).
    latest: HashMap<u64, (u64, Arc<Seg>)>,
    /// retained id -> its session.
    owner: HashMap<u64, u64>,
    /// The last expanded sequence, when it is not stored contiguously (it
    /// links to another): what [`Request::full`] then borrows.
    work: Vec<u32>,
    /// What `work` holds: `(serial, tokens of its own)` of each segment,
    /// root first, so that the next sequence reuses the common part.
    work_segs: Vec<(u64, usize)>,
    /// The last expanded record's checkpoints ([`Request::checkpoints`]).
    checkpoints: Vec<u32>,
}

impl Expander {
    /// An empty expander.
    pub fn new() -> Self {
        Self::default()
    }

    /// Expands `r`; the returned request borrows the expander until the
    /// next call. Errors (as a reason, changing nothing) if `r` extends an
    /// unknown or superseded request, has an empty input, or a checkpoint
    /// outside 1..=input length.
    pub fn expand<'a>(&'a mut self, r: &Record) -> Result<Request<'a>, String> {
        let seg = match r.base {
            Base::Full => {
                if r.tokens.is_empty() {
                    return Err("empty input".into());
                }
                check_checkpoints(&r.checkpoints, r.tokens.len())?;
                // Reuse the session's storage when nothing else holds it.
                let mut own = self
                    .take_latest(r.session)
                    .and_then(|s| Arc::try_unwrap(s).ok())
                    .map(|mut s| std::mem::take(&mut s.own))
                    .unwrap_or_default();
                own.clear();
                own.extend_from_slice(&r.tokens);
                own.extend_from_slice(&r.output);
                Arc::new(Seg::new(None, own))
            }
            Base::Extends(x) => {
                let Some(&xs) = self.owner.get(&x) else {
                    return Err(format!(
                        "extends {x}: no such request is retained (unknown id, or no longer \
                         the latest request of its session)"
                    ));
                };
                check_checkpoints(&r.checkpoints, self.latest[&xs].1.len() + r.tokens.len())?;
                let parent = if xs == r.session {
                    self.take_latest(xs).expect("an owned id has a sequence")
                } else {
                    // A fork of another session: link to its sequence, and
                    // supersede our own latest.
                    drop(self.take_latest(r.session));
                    Arc::clone(&self.latest[&xs].1)
                };
                self.extend(parent, &r.tokens, &r.output)
            }
        };
        let input_len = seg.len() - r.output.len();
        self.owner.insert(r.id, r.session);
        if seg.parent.is_some() {
            self.fill_work(&seg);
        }
        self.latest.insert(r.session, (r.id, seg));
        let seg = &self.latest[&r.session].1;
        let full = match seg.parent {
            None => &seg.own[..],
            Some(_) => &self.work[..],
        };
        self.checkpoints.clear();
        self.checkpoints.extend_from_slice(&r.checkpoints);
        Ok(Request {
            id: r.id,
            session: r.session,
            arrival_s: r.arrival_s,
            full,
            input_len,
            checkpoints: &self.checkpoints,
            seg,
        })
    }

    /// Removes `session`'s latest sequence (and its id from the retained).
    fn take_latest(&mut self, session: u64) -> Option<Arc<Seg>> {
        let (id, seg) = self.latest.remove(&session)?;
        self.owner.remove(&id);
        Some(seg)
    }

    /// `seq` followed by `append` and `output`: in place when nothing else
    /// holds `seq` (the usual next turn of a conversation), else linked
    /// (`seq` itself when nothing follows, so that every link adds a token
    /// and chains are never deeper than their sequences are long).
    fn extend(&mut self, mut seq: Arc<Seg>, append: &[u32], output: &[u32]) -> Arc<Seg> {
        if append.is_empty() && output.is_empty() {
            return seq;
        }
        if let Some(s) = Arc::get_mut(&mut seq) {
            s.own.extend_from_slice(append);
            s.own.extend_from_slice(output);
            return seq;
        }
        let mut own = Vec::with_capacity(append.len() + output.len());
        own.extend_from_slice(append);
        own.extend_from_slice(output);
        Arc::new(Seg::new(Some(seq), own))
    }

    /// Makes `work` hold `seg`'s whole sequence, keeping what it already
    /// holds of the same segments: the cost is the tokens and links that
    /// differ, so a chain of forks that each extend the previous request
    /// costs what each adds, not its depth.
    fn fill_work(&mut self, seg: &Seg) {
        // Walk up to the first segment the working copy holds at the same
        // depth: a segment's ancestors never change, so everything above it
        // is there too. A segment only grows, so a shorter copy is a prefix.
        let mut missing = Vec::new();
        let mut at = Some(seg);
        let mut kept = None;
        while let Some(s) = at {
            if let Some(&(serial, n)) = self.work_segs.get(s.depth) {
                if serial == s.serial && n <= s.own.len() {
                    kept = Some((s, n));
                    break;
                }
            }
            missing.push(s);
            at = s.parent.as_deref();
        }
        match kept {
            Some((s, n)) => {
                self.work.truncate(s.base + n);
                self.work.extend_from_slice(&s.own[n..]);
                self.work_segs.truncate(s.depth);
                self.work_segs.push((s.serial, s.own.len()));
            }
            None => {
                self.work.clear();
                self.work_segs.clear();
            }
        }
        for s in missing.iter().rev() {
            self.work.extend_from_slice(&s.own);
            self.work_segs.push((s.serial, s.own.len()));
        }
        debug_assert_eq!(self.work.len(), seg.len());
    }

    /// If `tokens` strictly extends the full sequence of the retained
    /// request `id`, that sequence's length.
    pub fn continued_by(&self, id: u64, tokens: &[u32]) -> Option<usize> {
        let s = self.owner.get(&id)?;
        let seg = &self.latest[s].1;
        if tokens.len() <= seg.len() {
            return None;
        }
        let mut at = 0;
        for s in seg.chain() {
            if tokens[at..at + s.own.len()] != s.own[..] {
                return None;
            }
            at += s.own.len();
        }
        Some(at)
    }

    /// Tokens the expander holds: each stored token of the retained
    /// sequences once (however many sequences share it), plus the working
    /// copy of the last expanded sequence when it was not contiguous.
    pub fn retained_tokens(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        let mut n = self.work.len();
        for (_, seg) in self.latest.values() {
            let mut s = Some(&**seg);
            while let Some(x) = s {
                if !seen.insert(x.serial) {
                    break;
                }
                n += x.own.len();
                s = x.parent.as_deref();
            }
        }
        n
    }
}

/// Checks a record's application checkpoints against its input length.
fn check_checkpoints(checkpoints: &[u32], input_len: usize) -> Result<(), String> {
    match checkpoints
        .iter()
        .find(|&&c| c == 0 || c as usize > input_len)
    {
        Some(c) => Err(format!(
            "checkpoint {c} is not a position of the input: checkpoints are in \
             1..={input_len} (the input length)"
        )),
        None => Ok(()),
    }
}

/// Lines of a trace as bytes, decoded one at a time (so that invalid UTF-8
/// is reported with its line), parsed, and counted (so that a trace without
/// any request is an error).
#[derive(Debug)]
struct Lines<R> {
    src: R,
    bytes: Vec<u8>,
    parser: LineParser,
    records: u64,
}

impl<R: BufRead> Lines<R> {
    fn new(src: R) -> Self {
        Lines {
            src,
            bytes: Vec::new(),
            parser: LineParser::new(),
            records: 0,
        }
    }

    /// The next record, `Ok(None)` at the end; [`TraceError::Empty`] at the
    /// end of a trace without any.
    fn next_record(&mut self) -> Result<Option<Record>, TraceError> {
        loop {
            self.bytes.clear();
            if self.src.read_until(b'\n', &mut self.bytes)? == 0 {
                return match self.records {
                    0 => Err(TraceError::Empty),
                    _ => Ok(None),
                };
            }
            if let Some(r) = self.parser.parse_bytes(&self.bytes)? {
                self.records += 1;
                return Ok(Some(r));
            }
        }
    }

    /// The 1-based number of the last line read.
    fn line(&self) -> u64 {
        self.parser.line()
    }
}

/// Streams a trace: one line parsed and expanded at a time.
#[derive(Debug)]
pub struct TraceReader<R> {
    lines: Lines<R>,
    expander: Expander,
    record: Option<Record>,
}

impl<R: BufRead> TraceReader<R> {
    /// A reader over `src`.
    pub fn new(src: R) -> Self {
        TraceReader {
            lines: Lines::new(src),
            expander: Expander::new(),
            record: None,
        }
    }

    /// The next request, `Ok(None)` at the end. A trace without any request
    /// is an error ([`TraceError::Empty`]).
    pub fn next_request(&mut self) -> Result<Option<Request<'_>>, TraceError> {
        self.record = self.lines.next_record()?;
        let Some(r) = self.record.as_ref() else {
            return Ok(None);
        };
        let line = self.lines.line();
        self.expander
            .expand(r)
            .map(Some)
            .map_err(|reason| TraceError::Line { line, reason })
    }

    /// Tokens currently held for `extends` (the streaming memory bound).
    pub fn retained_tokens(&self) -> usize {
        self.expander.retained_tokens()
    }
}

/// A whole trace in memory, compact: every request whose input starts with
/// the full sequence of its session's previous request is stored as
/// `extends` + `append`, whatever form the file used.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// The records in arrival order.
    pub records: Vec<Record>,
    /// The prefixes the application knows are shared (system prompts, tool
    /// definitions): a generator sets them, in memory only (a file carries
    /// per-record [`Record::checkpoints`] instead: see
    /// [`with_app_checkpoints`](Self::with_app_checkpoints)). A request
    /// whose input starts with one passes its length as an application
    /// checkpoint under `marconi-hinted` (see [`Trace::hints`]). Not part
    /// of equality.
    pub app_prefixes: Vec<Vec<u32>>,
}

impl PartialEq for Trace {
    fn eq(&self, o: &Self) -> bool {
        self.records == o.records
    }
}

impl Trace {
    /// Reads and validates a trace from `src`.
    pub fn read(src: impl BufRead) -> Result<Self, TraceError> {
        let mut lines = Lines::new(src);
        let mut ex = Expander::new();
        let mut prev: HashMap<u64, u64> = HashMap::new();
        let mut records = Vec::new();
        while let Some(mut r) = lines.next_record()? {
            if r.base == Base::Full {
                if let Some(&p) = prev.get(&r.session) {
                    if let Some(n) = ex.continued_by(p, &r.tokens) {
                        // A fresh vector: draining would keep the capacity
                        // of the full input.
                        r.tokens = r.tokens[n..].to_vec();
                        r.base = Base::Extends(p);
                    }
                }
            }
            let line = lines.line();
            ex.expand(&r)
                .map_err(|reason| TraceError::Line { line, reason })?;
            prev.insert(r.session, r.id);
            records.push(r);
        }
        Ok(Trace::from_records(records))
    }

    /// Reads a trace file.
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        // The caller names the path (once) in its message: every error of
        // the read, not only this one, needs it.
        let f = std::fs::File::open(path)?;
        Self::read(io::BufReader::with_capacity(1 << 20, f))
    }

    /// Records whose expansion cannot fail (the caller guarantees that the
    /// records come from a valid trace, e.g. a generator).
    pub fn from_records(records: Vec<Record>) -> Self {
        Trace {
            records,
            app_prefixes: Vec::new(),
        }
    }

    /// The application checkpoints of an input: the lengths of the
    /// [`app_prefixes`](Self::app_prefixes) it starts with (shorter than
    /// the input), ascending.
    pub fn app_checkpoints(&self, input: &[u32]) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .app_prefixes
            .iter()
            .filter(|p| !p.is_empty() && p.len() < input.len() && input.starts_with(p))
            .map(|p| p.len() as u32)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The application checkpoints `marconi-hinted` passes for `r`: its
    /// record's [`checkpoints`](Record::checkpoints) and the
    /// [`app_checkpoints`](Self::app_checkpoints) of its input, ascending,
    /// without duplicates.
    pub fn hints(&self, r: &Request<'_>) -> Vec<u32> {
        let mut v = self.app_checkpoints(r.input());
        if !r.checkpoints.is_empty() {
            v.extend_from_slice(r.checkpoints);
            v.sort_unstable();
            v.dedup();
        }
        v
    }

    /// The trace with each record's [`app_checkpoints`](Self::app_checkpoints)
    /// added to its [`checkpoints`](Record::checkpoints) (so that a file
    /// written from it carries them) and no `app_prefixes` left: the
    /// requests `marconi-hinted` passes are the same.
    pub fn with_app_checkpoints(mut self) -> Self {
        if self.app_prefixes.is_empty() {
            return self;
        }
        let mut found = Vec::with_capacity(self.records.len());
        self.for_each(|r| found.push(self.app_checkpoints(r.input())));
        for (rec, add) in self.records.iter_mut().zip(found) {
            if !add.is_empty() {
                rec.checkpoints.extend(add);
                rec.checkpoints.sort_unstable();
                rec.checkpoints.dedup();
            }
        }
        self.app_prefixes.clear();
        self
    }

    /// Calls `f` on every expanded request in order.
    pub fn for_each(&self, mut f: impl FnMut(Request<'_>)) {
        let mut ex = Expander::new();
        for r in &self.records {
            let req = ex
                .expand(r)
                .expect("a Trace holds only records validated at construction");
            f(req);
        }
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the trace has no request.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Tokens stored (appended input plus output): the compact size.
    pub fn stored_tokens(&self) -> u64 {
        self.records
            .iter()
            .map(|r| (r.tokens.len() + r.output.len()) as u64)
            .sum()
    }

    /// Writes the trace as JSON lines (compact form where recorded so).
    pub fn write(&self, out: impl Write) -> io::Result<()> {
        let mut w = TraceWriter::new(out);
        for r in &self.records {
            w.write(r)?;
        }
        w.finish()
    }

    /// Writes the trace with every input in full (no `extends`): larger,
    /// for tools that do not expand the compact form.
    pub fn write_full(&self, out: impl Write) -> io::Result<()> {
        let mut w = TraceWriter::new(out);
        let mut res = Ok(());
        self.for_each(|r| {
            if res.is_ok() {
                res = w.write_full(&r);
            }
        });
        res?;
        w.finish()
    }
}

/// Writes records as JSON lines.
#[derive(Debug)]
pub struct TraceWriter<W: Write> {
    out: io::BufWriter<W>,
}

impl<W: Write> TraceWriter<W> {
    /// A writer over `out`.
    pub fn new(out: W) -> Self {
        TraceWriter {
            out: io::BufWriter::with_capacity(1 << 20, out),
        }
    }

    /// Writes one record as one line.
    pub fn write(&mut self, r: &Record) -> io::Result<()> {
        let (input, extends, append) = match r.base {
            Base::Full => (Some(r.tokens.as_slice()), None, None),
            Base::Extends(x) => (None, Some(x), Some(r.tokens.as_slice())),
        };
        serde_json::to_writer(
            &mut self.out,
            &OutLine {
                id: r.id,
                session: r.session,
                arrival_s: r.arrival_s,
                input,
                extends,
                append,
                output: &r.output,
                checkpoints: &r.checkpoints,
            },
        )?;
        self.out.write_all(b"\n")
    }

    /// Writes an expanded request in the full form (`input` = whole prompt).
    pub fn write_full(&mut self, r: &Request<'_>) -> io::Result<()> {
        serde_json::to_writer(
            &mut self.out,
            &OutLine {
                id: r.id,
                session: r.session,
                arrival_s: r.arrival_s,
                input: Some(r.input()),
                extends: None,
                append: None,
                output: r.output(),
                checkpoints: r.checkpoints,
            },
        )?;
        self.out.write_all(b"\n")
    }

    /// Flushes the output.
    pub fn finish(mut self) -> io::Result<()> {
        self.out.flush()
    }
}
