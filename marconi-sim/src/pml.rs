//! `marconi-sim pml`: lays a Prompt Markup Language prompt out over its
//! schema ([`marconi_pml`]) and prints its segments with their position ids.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use marconi_pml::{ByteTokenizer, Encoded, Layout, Prompt, Schema, Tokenizer};
use serde::Serialize;

/// Which tokenizer turns schema and prompt text into tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TokenizerKind {
    /// One token per UTF-8 byte: layouts that can be checked by hand.
    Bytes,
    /// tiktoken's `cl100k_base` (embedded: no network).
    Tiktoken,
}

/// tiktoken's `cl100k_base`, ordinary text (special tokens are text).
#[derive(Clone, Copy, Debug, Default)]
pub struct Tiktoken;

impl Tokenizer for Tiktoken {
    fn tokenize(&mut self, text: &str) -> Vec<u32> {
        tiktoken_rs::cl100k_base_singleton().encode_ordinary(text)
    }
}

impl TokenizerKind {
    /// The tokenizer.
    pub fn tokenizer(self) -> Box<dyn Tokenizer> {
        match self {
            TokenizerKind::Bytes => Box::new(ByteTokenizer),
            TokenizerKind::Tiktoken => Box::new(Tiktoken),
        }
    }
}

/// Arguments of `marconi-sim pml`.
#[derive(Args, Debug)]
pub struct PmlArgs {
    /// The schema (`<schema name="...">`).
    #[arg(long)]
    pub schema: PathBuf,
    /// The prompt (`<prompt schema="...">`).
    #[arg(long)]
    pub prompt: PathBuf,
    /// Print `{"segments": [{"name", "kind", "start", "len", "cached"}...]}`.
    #[arg(long)]
    pub json: bool,
    /// Tokenizer of the schema's and the prompt's text.
    #[arg(long, value_enum, default_value_t = TokenizerKind::Bytes)]
    pub tokenizer: TokenizerKind,
}

/// Reads a PML file as UTF-8; a decoding error names its line and column.
pub fn read(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let good = std::str::from_utf8(good).unwrap_or("");
        let line = good.matches('\n').count() + 1;
        let col = good.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!("{}:{line}:{col}: not UTF-8", path.display())
    })
}

/// Parses and encodes a schema file.
///
/// # Errors
/// `path:line:column: reason` for unreadable or invalid files.
pub fn load_schema(path: &Path, tok: &mut dyn Tokenizer) -> Result<Encoded, String> {
    let text = read(path)?;
    let schema = Schema::parse(&text).map_err(|e| format!("{}:{e}", path.display()))?;
    Encoded::new(schema, tok).map_err(|e| format!("{}:{e}", path.display()))
}

/// Parses a prompt file against `enc` and lays it out.
///
/// # Errors
/// `path:line:column: reason` for unreadable or invalid prompts.
pub fn layout_file(enc: &Encoded, path: &Path, tok: &mut dyn Tokenizer) -> Result<Layout, String> {
    let text = read(path)?;
    let prompt =
        Prompt::parse(&text, enc.schema()).map_err(|e| format!("{}:{e}", path.display()))?;
    enc.layout(&prompt, tok)
        .map_err(|e| format!("{}:{e}", path.display()))
}

#[derive(Serialize)]
struct JsonSegment<'a> {
    name: Option<&'a str>,
    kind: &'static str,
    start: u32,
    len: u32,
    cached: bool,
}

#[derive(Serialize)]
struct JsonLayout<'a> {
    segments: Vec<JsonSegment<'a>>,
}

/// The layout as `{"segments": [...]}`, pretty-printed.
pub fn to_json(l: &Layout) -> String {
    let j = JsonLayout {
        segments: l
            .segments
            .iter()
            .map(|s| JsonSegment {
                name: s.name.as_deref(),
                kind: s.kind.as_str(),
                start: s.start,
                len: s.len,
                cached: s.cached,
            })
            .collect(),
    };
    serde_json::to_string_pretty(&j).expect("plain structs serialize")
}

/// The layout as a table, with totals.
pub fn to_table(enc: &Encoded, l: &Layout) -> String {
    let mut out = format!(
        "schema '{}': {} modules over positions 0..{}\n{:<10} {:<20} {:>8} {:>6}  {}\n",
        enc.schema().name(),
        enc.schema().modules().len(),
        enc.total(),
        "kind",
        "name",
        "start",
        "len",
        "states"
    );
    for s in &l.segments {
        let _ = writeln!(
            out,
            "{:<10} {:<20} {:>8} {:>6}  {}",
            s.kind.as_str(),
            s.name.as_deref().unwrap_or("-"),
            s.start,
            s.len,
            if s.cached { "cached" } else { "computed" }
        );
    }
    let _ = writeln!(
        out,
        "{} tokens: {} cached, {} computed",
        l.cached_tokens() + l.computed_tokens(),
        l.cached_tokens(),
        l.computed_tokens()
    );
    out
}

/// Runs `marconi-sim pml`.
///
/// # Errors
/// `path:line:column: reason` for an invalid schema or prompt.
pub fn run(a: PmlArgs) -> Result<(), String> {
    let mut tok = a.tokenizer.tokenizer();
    let enc = load_schema(&a.schema, tok.as_mut())?;
    let l = layout_file(&enc, &a.prompt, tok.as_mut())?;
    if a.json {
        println!("{}", to_json(&l));
    } else {
        print!("{}", to_table(&enc, &l));
    }
    Ok(())
}
