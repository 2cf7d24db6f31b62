//! Position ids (§3.3, §3.4): a schema's modules encoded at the positions
//! the schema fixes, and a prompt laid out over them.

use crate::error::{Error, ErrorKind, Pos, Result};
use crate::prompt::{self, Import, Prompt, PromptItem};
use crate::schema::{Item, ModuleId, Schema};

/// Turns text into the engine's token ids. The layout only counts them and
/// hands them back in [`Segment::tokens`]; it never looks inside.
pub trait Tokenizer {
    /// The token ids of `text` (whitespace-trimmed, never empty).
    fn tokenize(&mut self, text: &str) -> Vec<u32>;
}

/// One token per UTF-8 byte, the byte's value its id: layouts that can be
/// checked by hand.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl Tokenizer for ByteTokenizer {
    fn tokenize(&mut self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }
}

impl<F: FnMut(&str) -> Vec<u32>> Tokenizer for F {
    fn tokenize(&mut self, text: &str) -> Vec<u32> {
        self(text)
    }
}

/// What a segment of a layout is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentKind {
    /// Text of a named module: cached.
    Module,
    /// Text of the schema outside every module, an anonymous module that
    /// every prompt of the schema includes (§3.2.1): cached.
    Anonymous,
    /// A parameter: in a layout, the argument (computed) at the positions
    /// the parameter reserves; in a module's encoding, the `len`
    /// placeholder positions.
    Param,
    /// The prompt's own text: computed.
    Text,
}

impl SegmentKind {
    /// `module`, `anonymous`, `param` or `text`.
    pub fn as_str(self) -> &'static str {
        match self {
            SegmentKind::Module => "module",
            SegmentKind::Anonymous => "anonymous",
            SegmentKind::Param => "param",
            SegmentKind::Text => "text",
        }
    }
}

/// A run of tokens at consecutive position ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The module's name (kind module), the parameter's (kind param), none
    /// for anonymous and prompt text.
    pub name: Option<String>,
    /// The module the segment belongs to (for a parameter: its module).
    pub module: Option<ModuleId>,
    /// What it is.
    pub kind: SegmentKind,
    /// The first position id.
    pub start: u32,
    /// Its tokens' count: positions `start .. start + len`.
    pub len: u32,
    /// Whether its attention states come from the module cache (module and
    /// anonymous text) or must be computed (arguments, prompt text).
    pub cached: bool,
    /// The token ids (empty for a parameter's placeholder in an encoding).
    pub tokens: Vec<u32>,
}

impl Segment {
    /// One past the last position id.
    pub fn end(&self) -> u32 {
        self.start + self.len
    }
}

/// The segments of a prompt, in the order the engine concatenates them.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Layout {
    /// The segments.
    pub segments: Vec<Segment>,
}

impl Layout {
    /// Every token's position id, segment after segment.
    pub fn position_ids(&self) -> Vec<u32> {
        self.segments
            .iter()
            .flat_map(|s| s.start..s.end())
            .collect()
    }

    /// Tokens whose states come from the module cache.
    pub fn cached_tokens(&self) -> u64 {
        self.segments
            .iter()
            .filter(|s| s.cached)
            .map(|s| u64::from(s.len))
            .sum()
    }

    /// Tokens the engine computes (arguments and prompt text).
    pub fn computed_tokens(&self) -> u64 {
        self.segments
            .iter()
            .filter(|s| !s.cached)
            .map(|s| u64::from(s.len))
            .sum()
    }
}

/// Where one schema item lies, once tokenized.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Span {
    start: u32,
    len: u32,
    /// The text's tokens (text items only).
    tokens: Vec<u32>,
}

/// A schema with every module's place fixed (§3.3): a module starts where
/// the modules and text before it end; union members share a start and the
/// union takes the largest member's size; a parameter reserves `len`
/// positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    schema: Schema,
    /// Per module: its span and one span per body item.
    modules: Vec<(Span, Vec<Span>)>,
    top: Vec<Span>,
    total: u32,
}

fn add(a: u32, b: u32, pos: Pos) -> Result<u32> {
    a.checked_add(b).ok_or(Error::new(
        pos,
        ErrorKind::PositionOverflow { max: u32::MAX },
    ))
}

fn len_of(n: usize, pos: Pos) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::new(pos, ErrorKind::PositionOverflow { max: u32::MAX }))
}

impl Encoded {
    /// Tokenizes every text of the schema once and fixes every module's
    /// positions.
    ///
    /// # Errors
    /// [`ErrorKind::PositionOverflow`] when the schema spans more than
    /// `u32::MAX` positions.
    pub fn new(schema: Schema, tok: &mut dyn Tokenizer) -> Result<Encoded> {
        let mut modules = vec![(Span::at(0), Vec::new()); schema.modules().len()];
        let mut top = Vec::new();
        let total = encode_body(&schema, schema.body(), None, 0, tok, &mut modules, &mut top)?;
        Ok(Encoded {
            schema,
            modules,
            top,
            total,
        })
    }

    /// The schema.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// The positions the whole schema spans: `0 .. total`.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// A module's first position and its size (nested modules and
    /// parameters included).
    pub fn module_span(&self, m: ModuleId) -> (u32, u32) {
        let s = &self.modules[m.0].0;
        (s.start, s.len)
    }

    /// What the engine computes once to cache module `m` (§3.3): its text
    /// at its positions, and one [`SegmentKind::Param`] segment of `len`
    /// placeholder positions per parameter. Nested modules are encoded on
    /// their own, so they are not part of it.
    pub fn module_segments(&self, m: ModuleId) -> Vec<Segment> {
        let module = self.schema.module(m);
        let spans = &self.modules[m.0].1;
        let mut out = Vec::new();
        for (item, span) in module.body.iter().zip(spans) {
            match item {
                Item::Text { .. } => out.push(Segment {
                    name: Some(module.name.clone()),
                    module: Some(m),
                    kind: SegmentKind::Module,
                    start: span.start,
                    len: span.len,
                    cached: true,
                    tokens: span.tokens.clone(),
                }),
                Item::Param(i) => out.push(Segment {
                    name: Some(module.params[*i].name.clone()),
                    module: Some(m),
                    kind: SegmentKind::Param,
                    start: span.start,
                    len: span.len,
                    cached: false,
                    tokens: Vec::new(),
                }),
                Item::Module(_) | Item::Union { .. } => {}
            }
        }
        out
    }

    /// The schema's anonymous text (every prompt includes it), as segments.
    pub fn anonymous_segments(&self) -> Vec<Segment> {
        (0..self.top.len())
            .filter_map(|i| self.anonymous(i))
            .collect()
    }

    fn anonymous(&self, i: usize) -> Option<Segment> {
        match self.schema.body().get(i)? {
            Item::Text { .. } => {
                let span = &self.top[i];
                Some(Segment {
                    name: None,
                    module: None,
                    kind: SegmentKind::Anonymous,
                    start: span.start,
                    len: span.len,
                    cached: true,
                    tokens: span.tokens.clone(),
                })
            }
            _ => None,
        }
    }

    /// Lays `prompt` out (§3.4). Segments come in document order: the
    /// prompt's items in its order; an imported module's text, arguments
    /// and nested imports in the schema's order; each anonymous text of the
    /// schema just before the first import that follows it in the schema
    /// (at the start when it precedes every module), or, when no import
    /// follows it, right after the prompt's last import (at the start when
    /// the prompt imports nothing). Module text, anonymous text and arguments take
    /// the positions the schema fixes; prompt text starts where the segment
    /// before it ends (0 at the start).
    ///
    /// # Errors
    /// [`ErrorKind::SchemaMismatch`] when the prompt is not of this schema,
    /// [`ErrorKind::ArgumentTooLong`] when an argument has more tokens than
    /// its parameter's `len`, [`ErrorKind::PositionOverflow`].
    pub fn layout(&self, prompt: &Prompt, tok: &mut dyn Tokenizer) -> Result<Layout> {
        if prompt.schema() != self.schema.name() {
            return Err(Error::new(
                Pos { line: 1, col: 1 },
                ErrorKind::SchemaMismatch {
                    named: prompt.schema().into(),
                    given: self.schema.name().into(),
                },
            ));
        }
        let mut l = Lay {
            enc: self,
            tok,
            out: Vec::new(),
            cursor: 0,
            anon: (0..self.top.len())
                .filter(|&i| matches!(self.schema.body()[i], Item::Text { .. }))
                .collect(),
            next_anon: 0,
        };
        let first_module = self
            .schema
            .body()
            .iter()
            .position(|it| !matches!(it, Item::Text { .. }))
            .unwrap_or(self.top.len());
        let last_import = prompt
            .items()
            .iter()
            .rposition(|it| matches!(it, PromptItem::Import(_)));
        l.flush_before(first_module);
        if last_import.is_none() {
            l.flush_before(usize::MAX);
        }
        for (k, item) in prompt.items().iter().enumerate() {
            match item {
                PromptItem::Text { text, pos } => {
                    let tokens = l.tok.tokenize(text);
                    let len = len_of(tokens.len(), *pos)?;
                    let start = l.cursor;
                    add(start, len, *pos)?;
                    l.push(Segment {
                        name: None,
                        module: None,
                        kind: SegmentKind::Text,
                        start,
                        len,
                        cached: false,
                        tokens,
                    });
                }
                PromptItem::Import(i) => {
                    let top = prompt::top_index(&self.schema, i.module).unwrap_or(0);
                    l.flush_before(top);
                    l.import(i)?;
                    if Some(k) == last_import {
                        l.flush_before(usize::MAX);
                    }
                }
            }
        }
        Ok(Layout { segments: l.out })
    }
}

impl Span {
    fn at(start: u32) -> Span {
        Span {
            start,
            len: 0,
            tokens: Vec::new(),
        }
    }
}

/// Lays out `body` from position `start`; returns where it ends. One span
/// per item goes to `spans`; modules' spans go to `modules`.
fn encode_body(
    schema: &Schema,
    body: &[Item],
    module: Option<ModuleId>,
    start: u32,
    tok: &mut dyn Tokenizer,
    modules: &mut Vec<(Span, Vec<Span>)>,
    spans: &mut Vec<Span>,
) -> Result<u32> {
    let mut at = start;
    for item in body {
        let span = match item {
            Item::Text { text, pos } => {
                let tokens = tok.tokenize(text);
                let len = len_of(tokens.len(), *pos)?;
                add(at, len, *pos)?;
                Span {
                    start: at,
                    len,
                    tokens,
                }
            }
            Item::Param(i) => {
                let m = schema.module(module.expect("the parser puts params in modules"));
                let p = &m.params[*i];
                add(at, p.len, p.pos)?;
                Span {
                    start: at,
                    len: p.len,
                    tokens: Vec::new(),
                }
            }
            Item::Module(m) => {
                let end = encode_module(schema, *m, at, tok, modules)?;
                Span {
                    start: at,
                    len: end - at,
                    tokens: Vec::new(),
                }
            }
            Item::Union { members, .. } => {
                let mut end = at;
                for &m in members {
                    end = end.max(encode_module(schema, m, at, tok, modules)?);
                }
                Span {
                    start: at,
                    len: end - at,
                    tokens: Vec::new(),
                }
            }
        };
        at = span.start + span.len;
        spans.push(span);
    }
    Ok(at)
}

fn encode_module(
    schema: &Schema,
    m: ModuleId,
    start: u32,
    tok: &mut dyn Tokenizer,
    modules: &mut Vec<(Span, Vec<Span>)>,
) -> Result<u32> {
    let mut spans = Vec::new();
    let end = encode_body(
        schema,
        &schema.module(m).body,
        Some(m),
        start,
        tok,
        modules,
        &mut spans,
    )?;
    modules[m.0] = (
        Span {
            start,
            len: end - start,
            tokens: Vec::new(),
        },
        spans,
    );
    Ok(end)
}

struct Lay<'a, 't> {
    enc: &'a Encoded,
    tok: &'t mut dyn Tokenizer,
    out: Vec<Segment>,
    cursor: u32,
    /// Indices of the schema's top-level anonymous texts.
    anon: Vec<usize>,
    next_anon: usize,
}

impl Lay<'_, '_> {
    fn push(&mut self, s: Segment) {
        self.cursor = s.end();
        self.out.push(s);
    }

    /// Emits the anonymous texts not yet emitted that come before top-level
    /// item `top` in the schema.
    fn flush_before(&mut self, top: usize) {
        while let Some(&i) = self.anon.get(self.next_anon) {
            if i >= top {
                break;
            }
            self.next_anon += 1;
            if let Some(s) = self.enc.anonymous(i) {
                self.push(s);
            }
        }
    }

    fn import(&mut self, imp: &Import) -> Result<()> {
        let schema = &self.enc.schema;
        let m = schema.module(imp.module);
        let spans = &self.enc.modules[imp.module.0].1;
        for (item, span) in m.body.iter().zip(spans) {
            match item {
                Item::Text { .. } => self.push(Segment {
                    name: Some(m.name.clone()),
                    module: Some(imp.module),
                    kind: SegmentKind::Module,
                    start: span.start,
                    len: span.len,
                    cached: true,
                    tokens: span.tokens.clone(),
                }),
                Item::Param(i) => {
                    let p = &m.params[*i];
                    let tokens = match imp.args.iter().find(|a| a.param == *i) {
                        Some(a) if !a.value.is_empty() => {
                            let t = self.tok.tokenize(&a.value);
                            if t.len() > p.len as usize {
                                return Err(Error::new(
                                    a.pos,
                                    ErrorKind::ArgumentTooLong {
                                        module: m.name.clone(),
                                        param: p.name.clone(),
                                        tokens: t.len(),
                                        len: p.len,
                                    },
                                ));
                            }
                            t
                        }
                        _ => Vec::new(),
                    };
                    self.push(Segment {
                        name: Some(p.name.clone()),
                        module: Some(imp.module),
                        kind: SegmentKind::Param,
                        start: span.start,
                        len: tokens.len() as u32,
                        cached: false,
                        tokens,
                    });
                }
                Item::Module(c) => {
                    if let Some(ci) = imp.children.iter().find(|ci| ci.module == *c) {
                        self.import(ci)?;
                    }
                }
                Item::Union { members, .. } => {
                    if let Some(ci) = imp.children.iter().find(|ci| members.contains(&ci.module)) {
                        self.import(ci)?;
                    }
                }
            }
        }
        Ok(())
    }
}
