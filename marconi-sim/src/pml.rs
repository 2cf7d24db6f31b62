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
    /// Also replay through the module store (`marconi_pml::ModuleCache`)
    /// with this budget in MiB: module hit rate, evictions, refusals, with
    /// schemas pinned throughout and registered per prompt.
    #[arg(long, value_parser = crate::tiers::positive)]
    pub budget_mib: Option<f64>,
    /// The model whose entry sizes and FLOPs the store uses (a preset:
    /// paper-7b, paper-7b-attn, jamba-1.5-mini, nemotron-h-8b...).
    #[arg(long, default_value = "paper-7b")]
    pub model: String,
    /// The store's reuse mode (default: attention for an attention-only
    /// model, composed for a hybrid).
    #[arg(long, value_enum)]
    pub mode: Option<StoreMode>,
}

/// A reuse mode of the module store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreMode {
    /// Every module's KV (attention-only models).
    Attention,
    /// The exact leading run (hybrids or any model).
    Exact,
    /// The exact run, then composed states (hybrids).
    Composed,
}

/// How schemas are registered in a store replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Registration {
    /// Every schema registered before the first prompt and kept: its
    /// modules pinned (a schema that does not fit is refused and its
    /// prompts served without the store).
    Pinned,
    /// Each prompt registers its schema and unregisters it when done: its
    /// modules stay resident unpinned and compete for the budget.
    PerPrompt,
}

/// What one store replay measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StoreReport {
    /// How schemas were registered.
    pub registration: Registration,
    /// Schemas registered (pinned: those that fit).
    pub schemas_registered: u64,
    /// Schemas whose registration was refused (over budget).
    pub schemas_refused: u64,
    /// Cacheable segments served by an entry.
    pub hits: u64,
    /// Cacheable segments not resident (computed, then admitted).
    pub misses: u64,
    /// Cacheable segments the mode recomputes (exact, after the run).
    pub recomputed: u64,
    /// Cacheable segments of prompts whose schema could not be registered.
    pub unserved: u64,
    /// `hits / (hits + misses + unserved)`.
    pub hit_rate: f64,
    /// Tokens whose states came from entries.
    pub reused_tokens: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Admissions refused (an exact entry larger than the unpinned budget).
    pub refused_admissions: u64,
    /// The most bytes pinned at once.
    pub peak_pinned_bytes: u64,
    /// Bytes used at the end.
    pub used_bytes: u64,
}

/// The module store's part of a replay.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StoreReplay {
    /// The model preset.
    pub model: String,
    /// The budget in bytes.
    pub budget_bytes: u64,
    /// The mode.
    pub mode: StoreMode,
    /// The composed window.
    pub window: u32,
    /// Bytes of every schema's module entries (what pinning all takes).
    pub all_modules_bytes: u64,
    /// Schemas registered throughout, then per prompt.
    pub runs: Vec<StoreReport>,
}

/// The store's entry sizes and FLOPs for `spec`: KV of every attention
/// layer per token; the state of every SSM layer (recurrent and conv); a
/// transition operator as large as the recurrent state without its conv
/// part (a diagonal transition per state element: Mamba-1's case, an upper
/// bound for Mamba-2's per-head scalar); prefill FLOPs `a·n + b·n²` from
/// the spec's cost model.
pub fn module_model(spec: &marconi_core::ModelSpec) -> marconi_pml::ModuleModel {
    let one = spec.prefill_flops(0, 1);
    let two = spec.prefill_flops(0, 2);
    let b = ((two - 2.0 * one) / 2.0).max(0.0);
    let operator = if spec.ssm_layers == 0 {
        0
    } else {
        spec.ssm_state_channels
            .saturating_mul(spec.d_state)
            .saturating_mul(spec.state_dtype_bytes)
            .saturating_mul(u64::from(spec.ssm_layers))
    };
    marconi_pml::ModuleModel {
        kv_bytes_per_token: spec.kv_bytes_per_token(),
        state_bytes: spec.state_bytes(),
        operator_bytes: operator,
        flops_per_token: one - b,
        flops_per_token_squared: b,
    }
}

/// Replays `prompts` (laid out, with their schema's index) through a
/// module store of `budget_bytes`: per prompt a lookup under `mode`, then
/// every miss admitted as the engine would after computing it (an exact
/// entry in the leading run, else the module entry).
///
/// # Errors
/// A store error other than the refusals counted (a bug).
pub fn replay_store(
    schemas: &[Encoded],
    prompts: &[(usize, Layout)],
    model: marconi_pml::ModuleModel,
    budget_bytes: u64,
    mode: marconi_pml::ReuseMode,
    registration: Registration,
) -> Result<StoreReport, String> {
    use marconi_pml::{ModuleCache, Served, StoreError};
    let mut c = ModuleCache::new(model, budget_bytes).map_err(|e| e.to_string())?;
    let mut r = StoreReport {
        registration,
        schemas_registered: 0,
        schemas_refused: 0,
        hits: 0,
        misses: 0,
        recomputed: 0,
        unserved: 0,
        hit_rate: 0.0,
        reused_tokens: 0,
        evictions: 0,
        refused_admissions: 0,
        peak_pinned_bytes: 0,
        used_bytes: 0,
    };
    let mut ids = vec![None; schemas.len()];
    if registration == Registration::Pinned {
        for (i, enc) in schemas.iter().enumerate() {
            match c.register(enc) {
                Ok(id) => {
                    ids[i] = Some(id);
                    r.schemas_registered += 1;
                }
                Err(StoreError::OverBudget { .. }) => r.schemas_refused += 1,
                Err(e) => return Err(e.to_string()),
            }
        }
    }
    let mut refused_once = vec![false; schemas.len()];
    for (which, l) in prompts {
        let id = match registration {
            Registration::Pinned => ids[*which],
            Registration::PerPrompt => match c.register(&schemas[*which]) {
                Ok(id) => {
                    r.schemas_registered += 1;
                    Some(id)
                }
                Err(StoreError::OverBudget { .. }) => {
                    if !refused_once[*which] {
                        refused_once[*which] = true;
                        r.schemas_refused += 1;
                    }
                    None
                }
                Err(e) => return Err(e.to_string()),
            },
        };
        r.peak_pinned_bytes = r.peak_pinned_bytes.max(c.stats().pinned_bytes);
        let Some(id) = id else {
            r.unserved += l.segments.iter().filter(|s| s.cached).count() as u64;
            continue;
        };
        let found = c.lookup(id, l, mode).map_err(|e| e.to_string())?;
        r.reused_tokens += found.reused_tokens(l);
        for (i, g) in found.segments.iter().enumerate() {
            match g.served {
                Served::Miss => {
                    r.misses += 1;
                    let admitted =
                        if i < found.exact_run && mode != marconi_pml::ReuseMode::Attention {
                            c.admit_exact(id, l, i)
                        } else {
                            match g.module {
                                Some(m) => c.admit(id, m),
                                None => continue,
                            }
                        };
                    match admitted {
                        Ok(_) => {}
                        Err(StoreError::DoesNotFit { .. }) => r.refused_admissions += 1,
                        Err(e) => return Err(e.to_string()),
                    }
                }
                Served::Recomputed => r.recomputed += 1,
                s if s.is_hit() => r.hits += 1,
                _ => {}
            }
        }
        c.drain_evicted();
        if registration == Registration::PerPrompt {
            c.unregister(id).map_err(|e| e.to_string())?;
        }
    }
    let st = c.stats();
    r.evictions = st.evictions;
    r.used_bytes = st.used_bytes;
    let served = r.hits + r.misses + r.unserved;
    r.hit_rate = if served == 0 {
        0.0
    } else {
        r.hits as f64 / served as f64
    };
    Ok(r)
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
    /// The module store's figures (with `--budget-mib`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreReplay>,
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
    replay_layouts(schemas, prompts, tok, window).map(|(r, _)| r)
}

/// [`replay_prompts`], also giving every prompt's layout with its schema's
/// index.
///
/// # Errors
/// `name:line:column: reason` for the first invalid prompt.
pub fn replay_layouts(
    schemas: &[Encoded],
    prompts: &[(String, String)],
    tok: &mut dyn Tokenizer,
    window: u32,
) -> Result<(PmlReplayReport, Vec<(usize, Layout)>), String> {
    let mut layouts = Vec::with_capacity(prompts.len());
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
        layouts.push((which, l));
    }
    r.module_hit_rate = if r.imports == 0 {
        0.0
    } else {
        r.module_hits as f64 / r.imports as f64
    };
    Ok((r, layouts))
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
    let (mut r, layouts) = replay_layouts(&schemas, &prompts, tok.as_mut(), a.window)?;
    if let Some(mib) = a.budget_mib {
        let spec = marconi_core::ModelSpec::preset(&a.model).ok_or_else(|| {
            format!(
                "unknown model '{}' (presets: {})",
                a.model,
                marconi_core::PRESET_NAMES.join(", ")
            )
        })?;
        let model = module_model(&spec);
        let mode = a.mode.unwrap_or(if model.is_hybrid() {
            StoreMode::Composed
        } else {
            StoreMode::Attention
        });
        let reuse = match mode {
            StoreMode::Attention => marconi_pml::ReuseMode::Attention,
            StoreMode::Exact => marconi_pml::ReuseMode::Exact,
            StoreMode::Composed => marconi_pml::ReuseMode::Composed { window: a.window },
        };
        match (mode, model.is_hybrid()) {
            (StoreMode::Attention, true) | (StoreMode::Composed, false) => {
                return Err(format!(
                    "--mode {} does not apply to {} ({})",
                    format!("{mode:?}").to_lowercase(),
                    a.model,
                    if model.is_hybrid() {
                        "hybrid"
                    } else {
                        "attention-only"
                    }
                ))
            }
            _ => {}
        }
        let budget = (mib * 1024.0 * 1024.0) as u64;
        let probe = marconi_pml::ModuleCache::new(model, u64::MAX).map_err(|e| e.to_string())?;
        let all: u64 = schemas
            .iter()
            .map(|e| {
                let named = (0..e.schema().modules().len())
                    .map(|i| marconi_pml::ModuleRef::Named(marconi_pml::ModuleId(i)));
                let anon = (0..e.anonymous_segments().len()).map(marconi_pml::ModuleRef::Anonymous);
                named
                    .chain(anon)
                    .filter_map(|m| probe.module_bytes(e, m))
                    .sum::<u64>()
            })
            .sum();
        let mut runs = Vec::new();
        for reg in [Registration::Pinned, Registration::PerPrompt] {
            runs.push(replay_store(&schemas, &layouts, model, budget, reuse, reg)?);
        }
        r.store = Some(StoreReplay {
            model: a.model.clone(),
            budget_bytes: budget,
            mode,
            window: a.window,
            all_modules_bytes: all,
            runs,
        });
    }
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
        if let Some(st) = &r.store {
            let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
            let mode = match st.mode {
                StoreMode::Composed => format!("composed (window {})", st.window),
                m => format!("{m:?}").to_lowercase(),
            };
            println!(
                "module store: model {}, budget {:.1} MiB, mode {mode}; all modules of all schemas take {:.1} MiB",
                st.model,
                mib(st.budget_bytes),
                mib(st.all_modules_bytes)
            );
            for run in &st.runs {
                let how = match run.registration {
                    Registration::Pinned => "schemas pinned throughout",
                    Registration::PerPrompt => "registered per prompt",
                };
                println!(
                    "  {how}: module hit rate {:.2} % ({} of {} segments{}), {:.2} % of tokens reused, {} evictions, {} refused admissions, {} schema registrations refused, peak pinned {:.1} MiB",
                    100.0 * run.hit_rate,
                    run.hits,
                    run.hits + run.misses + run.unserved,
                    if run.unserved > 0 { format!(", {} of them in prompts of schemas not registered", run.unserved) } else { String::new() },
                    r.pct(run.reused_tokens),
                    run.evictions,
                    run.refused_admissions,
                    run.schemas_refused,
                    mib(run.peak_pinned_bytes)
                );
            }
        }
    }
    Ok(())
}
