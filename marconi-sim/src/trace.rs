//! Request traces: JSON lines, one request per line, sorted by arrival.
//!
//! ```text
//! {"id": 0, "session": 3, "arrival_s": 1.25, "input": [1, 2, 3], "output": [4, 5]}
//! {"id": 7, "session": 3, "arrival_s": 9.5, "extends": 0, "append": [6], "output": [7]}
//! ```
//!
//! `input` is the full prompt. The compact form means
//! `input = input(extends) + output(extends) + append`, so multi-turn traces
//! stay linear in size.
//!
//! **Memory bound.** Reading is streaming: the reader keeps, for every
//! session, only the full token sequence of that session's latest request,
//! so memory is the sum over sessions of one context, independent of the
//! trace's length. The price is a format rule: `extends` must name a request
//! that is still the latest of its session (in practice, the previous turn
//! of a conversation, or the latest turn of another session that forks it).
//! A reference to an older request is rejected as unknown.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, Write};
use std::path::Path;

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
}

/// An expanded request: its full sequence (input then output).
#[derive(Clone, Copy, Debug, PartialEq)]
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
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io(e) => write!(f, "reading trace: {e}"),
            TraceError::Line { line, reason } => write!(f, "trace line {line}: {reason}"),
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
                u32::try_from(x)
                    .map(Tok)
                    .map_err(|_| E::custom(format!("token {} is {x}, not below 2^32", self.0)))
            }
            fn visit_i64<E: de::Error>(self, x: i64) -> Result<Tok, E> {
                if x < 0 {
                    Err(E::custom(format!("token {} is negative ({x})", self.0)))
                } else {
                    self.visit_u64(x as u64)
                }
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<Tok, E> {
                Err(E::custom(format!(
                    "token {} is not an integer ({x})",
                    self.0
                )))
            }
        }
        let idx = self.0;
        d.deserialize_any(V(idx))
    }
}

#[derive(Deserialize)]
struct RawLine {
    id: Option<u64>,
    session: Option<u64>,
    arrival_s: Option<f64>,
    input: Option<Tokens>,
    extends: Option<u64>,
    append: Option<Tokens>,
    output: Option<Tokens>,
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

    /// Parses the next line. `Ok(None)` for a blank line.
    pub fn parse(&mut self, text: &str) -> Result<Option<Record>, TraceError> {
        self.line += 1;
        if text.trim().is_empty() {
            return Ok(None);
        }
        let err = |reason: String| TraceError::Line {
            line: self.line,
            reason,
        };
        let raw: RawLine =
            serde_json::from_str(text.trim_end()).map_err(|e| err(json_reason(&e)))?;
        let id = raw.id.ok_or_else(|| err("missing `id`".into()))?;
        let session = raw.session.ok_or_else(|| err("missing `session`".into()))?;
        let arrival_s = raw
            .arrival_s
            .ok_or_else(|| err("missing `arrival_s`".into()))?;
        if !arrival_s.is_finite() || arrival_s < 0.0 {
            return Err(err(format!("arrival_s {arrival_s} is not a time >= 0")));
        }
        let output = raw.output.ok_or_else(|| err("missing `output`".into()))?.0;
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
        }))
    }
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
/// of each session (see the module's memory bound).
#[derive(Debug, Default)]
pub struct Expander {
    /// session -> (id of its latest request, its full sequence).
    latest: HashMap<u64, (u64, Vec<u32>)>,
    /// retained id -> its session.
    owner: HashMap<u64, u64>,
    /// The session last expanded, whose buffer [`Request::full`] borrows.
    current: Option<u64>,
}

impl Expander {
    /// An empty expander.
    pub fn new() -> Self {
        Self::default()
    }

    /// Expands `r`; the returned request borrows the session's buffer until
    /// the next call. Errors (as a reason) if `r` extends an unknown or
    /// superseded request.
    pub fn expand<'a>(&'a mut self, r: &Record) -> Result<Request<'a>, String> {
        let mut buf = match r.base {
            Base::Full => {
                let mut b = self
                    .latest
                    .remove(&r.session)
                    .map(|(old, b)| {
                        self.owner.remove(&old);
                        b
                    })
                    .unwrap_or_default();
                b.clear();
                b.extend_from_slice(&r.tokens);
                b
            }
            Base::Extends(x) => {
                let Some(&xs) = self.owner.get(&x) else {
                    return Err(format!(
                        "extends {x}: no such request is retained (unknown id, or no longer \
                         the latest request of its session)"
                    ));
                };
                let mut b = if xs == r.session {
                    self.owner.remove(&x);
                    self.latest.remove(&xs).map(|(_, b)| b).unwrap_or_default()
                } else {
                    // Fork from another session: copy, and supersede our own latest.
                    let b = self.latest[&xs].1.clone();
                    if let Some((old, _)) = self.latest.remove(&r.session) {
                        self.owner.remove(&old);
                    }
                    b
                };
                b.extend_from_slice(&r.tokens);
                b
            }
        };
        let input_len = buf.len();
        if input_len == 0 {
            return Err("empty input".into());
        }
        buf.extend_from_slice(&r.output);
        self.owner.insert(r.id, r.session);
        self.current = Some(r.session);
        let slot = self.latest.entry(r.session).or_default();
        *slot = (r.id, buf);
        Ok(Request {
            id: r.id,
            session: r.session,
            arrival_s: r.arrival_s,
            full: &slot.1,
            input_len,
        })
    }

    /// The full sequence of `id` if it is retained (the latest of its session).
    pub fn retained(&self, id: u64) -> Option<&[u32]> {
        let s = self.owner.get(&id)?;
        Some(&self.latest[s].1)
    }

    /// Tokens held in session buffers (the memory the bound talks about).
    pub fn retained_tokens(&self) -> usize {
        self.latest.values().map(|(_, b)| b.len()).sum()
    }
}

/// Streams a trace: one line parsed and expanded at a time.
#[derive(Debug)]
pub struct TraceReader<R> {
    src: R,
    text: String,
    parser: LineParser,
    expander: Expander,
    record: Option<Record>,
}

impl<R: BufRead> TraceReader<R> {
    /// A reader over `src`.
    pub fn new(src: R) -> Self {
        TraceReader {
            src,
            text: String::new(),
            parser: LineParser::new(),
            expander: Expander::new(),
            record: None,
        }
    }

    /// The next request, `Ok(None)` at the end.
    pub fn next_request(&mut self) -> Result<Option<Request<'_>>, TraceError> {
        loop {
            self.text.clear();
            if self.src.read_line(&mut self.text)? == 0 {
                return Ok(None);
            }
            if let Some(r) = self.parser.parse(&self.text)? {
                self.record = Some(r);
                break;
            }
        }
        let r = self.record.as_ref().expect("set above");
        let line = self.parser.line();
        self.expander
            .expand(r)
            .map(Some)
            .map_err(|reason| TraceError::Line { line, reason })
    }

    /// Tokens currently retained for `extends` (the streaming memory bound).
    pub fn retained_tokens(&self) -> usize {
        self.expander.retained_tokens()
    }
}

/// A whole trace in memory, compact: every request whose input starts with
/// the full sequence of its session's previous request is stored as
/// `extends` + `append`, whatever form the file used.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// The records in arrival order.
    pub records: Vec<Record>,
}

impl Trace {
    /// Reads and validates a trace from `src`.
    pub fn read(src: impl BufRead) -> Result<Self, TraceError> {
        let mut src = src;
        let mut text = String::new();
        let mut parser = LineParser::new();
        let mut ex = Expander::new();
        let mut prev: HashMap<u64, u64> = HashMap::new();
        let mut records = Vec::new();
        loop {
            text.clear();
            if src.read_line(&mut text)? == 0 {
                break;
            }
            let Some(mut r) = parser.parse(&text)? else {
                continue;
            };
            if r.base == Base::Full {
                if let Some(&p) = prev.get(&r.session) {
                    if let Some(pf) = ex.retained(p) {
                        if r.tokens.len() > pf.len() && r.tokens.starts_with(pf) {
                            // A fresh vector: draining would keep the
                            // capacity of the full input.
                            r.tokens = r.tokens[pf.len()..].to_vec();
                            r.base = Base::Extends(p);
                        }
                    }
                }
            }
            let line = parser.line();
            ex.expand(&r)
                .map_err(|reason| TraceError::Line { line, reason })?;
            prev.insert(r.session, r.id);
            records.push(r);
        }
        Ok(Trace { records })
    }

    /// Reads a trace file.
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        let f = std::fs::File::open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        Self::read(io::BufReader::with_capacity(1 << 20, f))
    }

    /// Records whose expansion cannot fail (the caller guarantees that the
    /// records come from a valid trace, e.g. a generator).
    pub fn from_records(records: Vec<Record>) -> Self {
        Trace { records }
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
            },
        )?;
        self.out.write_all(b"\n")
    }

    /// Flushes the output.
    pub fn finish(mut self) -> io::Result<()> {
        self.out.flush()
    }
}
