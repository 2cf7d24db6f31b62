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

/// Arguments of `marconi-sim pml-replay`.
#[derive(Args, Debug)]
pub struct PmlReplayArgs {
    /// A schema (repeat for several); prompts name theirs.
    #[arg(long, required = true)]
    pub schema: Vec<PathBuf>,
    /// A prompt file (repeat for several); replayed before generated ones.
    #[arg(long)]
    pub prompt: Vec<PathBuf>,
    /// Prompts to generate from the schemas (random imports, union members,
    /// arguments and text; seeded).
    #[arg(long, default_value_t = 0)]
    pub synth: u32,
    /// Seed of the generated prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokens recomputed at the start of each composed segment.
    #[arg(long, default_value_t = 16)]
    pub window: u32,
    /// Tokenizer of the schemas' and the prompts' text.
    #[arg(long, value_enum, default_value_t = TokenizerKind::Bytes)]
    pub tokenizer: TokenizerKind,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What a replay of PML prompts measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PmlReplayReport {
    /// Prompts laid out.
    pub prompts: u64,
    /// Their tokens (every segment).
    pub tokens: u64,
    /// Tokens of module content (cached segments).
    pub module_tokens: u64,
    /// Module imports (each module of each prompt once).
    pub imports: u64,
    /// Imports of a module already encoded by an earlier prompt (modules
    /// are encoded on first use and kept).
    pub module_hits: u64,
    /// `module_hits / imports`.
    pub module_hit_rate: f64,
    /// Tokens reused, attention-only model (every cached segment).
    pub reused_attention: u64,
    /// Tokens reused, hybrid model, exact (the gapless leading run).
    pub reused_exact: u64,
    /// Tokens reused, hybrid model, composed (`window` recomputed).
    pub reused_composed: u64,
    /// The window of the composed mode.
    pub window: u32,
}

impl PmlReplayReport {
    /// Reused tokens as a percentage of all prompt tokens.
    pub fn pct(&self, reused: u64) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            100.0 * reused as f64 / self.tokens as f64
        }
    }
}

/// Lays every prompt out over its schema (found by name in `schemas`) and
/// counts module hits and the tokens each reuse mode serves.
///
/// # Errors
/// `name:line:column: reason` for the first invalid prompt.
pub fn replay_prompts(
    schemas: &[Encoded],
    prompts: &[(String, String)],
    tok: &mut dyn Tokenizer,
    window: u32,
) -> Result<PmlReplayReport, String> {
    use marconi_pml::{ReuseMode, ReusePlan};
    let mut r = PmlReplayReport {
        window,
        ..Default::default()
    };
    let mut seen = std::collections::BTreeSet::new();
    for (name, text) in prompts {
        let mut which = 0usize;
        let prompt = Prompt::parse_with(text, |n| {
            let i = schemas.iter().position(|e| e.schema().name() == n)?;
            which = i;
            Some(schemas[i].schema())
        })
        .map_err(|mut e| {
            if let marconi_pml::ErrorKind::UnknownSchema { known, .. } = &mut e.kind {
                let names: Vec<&str> = schemas.iter().map(|s| s.schema().name()).collect();
                *known = format!(" (registered: {})", names.join(", "));
            }
            format!("{name}:{e}")
        })?;
        let enc = &schemas[which];
        let l = enc
            .layout(&prompt, tok)
            .map_err(|e| format!("{name}:{e}"))?;
        r.prompts += 1;
        r.tokens += l.cached_tokens() + l.computed_tokens();
        r.module_tokens += l.cached_tokens();
        for m in prompt.imported() {
            r.imports += 1;
            if !seen.insert((which, m.0)) {
                r.module_hits += 1;
            }
        }
        r.reused_attention += ReusePlan::new(&l, ReuseMode::Attention).reused_tokens(&l);
        r.reused_exact += ReusePlan::new(&l, ReuseMode::Exact).reused_tokens(&l);
        r.reused_composed += ReusePlan::new(&l, ReuseMode::Composed { window }).reused_tokens(&l);
    }
    r.module_hit_rate = if r.imports == 0 {
        0.0
    } else {
        r.module_hits as f64 / r.imports as f64
    };
    Ok(r)
}

/// `n` prompts drawn from `schemas`: a schema at random; each top-level
/// module imported with probability 0.6, each union with 0.8 (one member at
/// random), nested ones likewise; arguments of random length that fit their
/// `len` under `tok`; prompt text first with probability 0.2 and always
/// last; the first two imports swapped with probability 0.1.
pub fn synth_prompts(
    schemas: &[Encoded],
    n: u32,
    seed: u64,
    tok: &mut dyn Tokenizer,
) -> Vec<(String, String)> {
    use crate::rng::Rng;
    use marconi_pml::{Item, ModuleId};

    fn import(s: &Schema, m: ModuleId, rng: &mut Rng, tok: &mut dyn Tokenizer, out: &mut String) {
        let module = s.module(m);
        out.push('<');
        out.push_str(&module.name);
        for p in &module.params {
            if rng.chance(0.1) {
                continue; // a missing argument
            }
            let mut k = rng.below(u64::from(p.len) + 1) as usize;
            let arg = loop {
                let a = vec!["x"; k].join(" ");
                if tok.tokenize(&a).len() <= p.len as usize || k == 0 {
                    break a;
                }
                k -= 1;
            };
            let _ = write!(out, " {}=\"{arg}\"", p.name);
        }
        let mut inner = String::new();
        body(s, &module.body, rng, tok, &mut inner);
        if inner.is_empty() {
            out.push_str("/>");
        } else {
            let _ = write!(out, ">{inner}</{}>", module.name);
        }
    }

    fn body(
        s: &Schema,
        items: &[Item],
        rng: &mut Rng,
        tok: &mut dyn Tokenizer,
        out: &mut String,
    ) -> Vec<String> {
        let mut imports = Vec::new();
        for it in items {
            let mut one = String::new();
            match it {
                Item::Module(m) if rng.chance(0.6) => import(s, *m, rng, tok, &mut one),
                Item::Union { members, .. } if rng.chance(0.8) => {
                    let m = members[rng.below(members.len() as u64) as usize];
                    import(s, m, rng, tok, &mut one);
                }
                _ => {}
            }
            if !one.is_empty() {
                out.push_str(&one);
                imports.push(one);
            }
        }
        imports
    }

    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    if schemas.is_empty() {
        return out;
    }
    for i in 0..n {
        let s = schemas[rng.below(schemas.len() as u64) as usize].schema();
        let mut ignored = String::new();
        let mut imports = body(s, s.body(), &mut rng, tok, &mut ignored);
        if imports.len() >= 2 && rng.chance(0.1) {
            imports.swap(0, 1);
        }
        let mut p = format!("<prompt schema=\"{}\">", s.name());
        if rng.chance(0.2) {
            p.push_str("Context first. ");
        }
        p.push_str(&imports.concat());
        let _ = write!(p, " Question {i}: what next?</prompt>");
        out.push((format!("synth#{i}"), p));
    }
    out
}

/// Runs `marconi-sim pml-replay`.
///
/// # Errors
/// `path:line:column: reason` for an invalid schema or prompt.
pub fn replay_run(a: PmlReplayArgs) -> Result<(), String> {
    let mut tok = a.tokenizer.tokenizer();
    let mut schemas = Vec::new();
    for p in &a.schema {
        let enc = load_schema(p, tok.as_mut())?;
        if schemas
            .iter()
            .any(|e: &Encoded| e.schema().name() == enc.schema().name())
        {
            return Err(format!(
                "{}: schema '{}' given twice",
                p.display(),
                enc.schema().name()
            ));
        }
        schemas.push(enc);
    }
    let mut prompts = Vec::new();
    for p in &a.prompt {
        prompts.push((p.display().to_string(), read(p)?));
    }
    prompts.extend(synth_prompts(&schemas, a.synth, a.seed, tok.as_mut()));
    if prompts.is_empty() {
        return Err("no prompt: give --prompt files or --synth N".into());
    }
    let r = replay_prompts(&schemas, &prompts, tok.as_mut(), a.window)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "{} prompts, {} tokens ({} module content); module hit rate {:.2} % ({} of {} imports)",
            r.prompts,
            r.tokens,
            r.module_tokens,
            100.0 * r.module_hit_rate,
            r.module_hits,
            r.imports
        );
        println!("tokens reused: attention-only {:.2} %, hybrid exact {:.2} %, hybrid composed (window {}) {:.2} %",
            r.pct(r.reused_attention), r.pct(r.reused_exact), r.window, r.pct(r.reused_composed));
    }
    Ok(())
}
