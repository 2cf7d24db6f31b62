//! Seeded synthetic workloads shaped like the Marconi paper's (§5.1, Fig. 6).
//!
//! Every generator is a pure function of its [`SynthConfig`]: the same seed
//! gives the same trace, byte for byte, on every platform (the RNG is
//! [`crate::rng::Rng`], a fixed algorithm).

use std::fmt;

use crate::rng::Rng;
use crate::trace::{Base, Record, Trace};
use crate::ttft::TtftModel;

/// Token ids are drawn from `0..VOCAB`.
pub const VOCAB: u32 = 100_000;

/// Which workload to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthKind {
    /// SWE-agent style runs: a long system prompt and demonstration shared by
    /// every session, then rounds of action (output) and observation (next
    /// append) growing the history from hundreds to tens of thousands of
    /// tokens.
    Agentic,
    /// ShareGPT-style short chats, a few popular system prompts.
    Chat,
    /// LMSys-style chats with long outputs (often thousands of tokens).
    Longout,
}

impl fmt::Display for SynthKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SynthKind::Agentic => "agentic",
            SynthKind::Chat => "chat",
            SynthKind::Longout => "longout",
        })
    }
}

/// A generator's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthConfig {
    /// Workload shape.
    pub kind: SynthKind,
    /// Sessions (conversations or agent runs).
    pub sessions: u32,
    /// Session arrivals per second (Poisson process).
    pub session_rate: f64,
    /// RNG seed.
    pub seed: u64,
    /// Longest input of any request, in tokens (a session stops before).
    pub max_input: u32,
    /// How long a turn's prefill and decode take, to place the next turn.
    pub timing: Timing,
}

impl SynthConfig {
    /// The default configuration of `kind`. The agentic default gives about
    /// 7,000 requests with inputs up to 60 K tokens.
    pub fn new(kind: SynthKind) -> Self {
        let (sessions, session_rate) = match kind {
            SynthKind::Agentic => (207, 0.05),
            SynthKind::Chat => (400, 0.5),
            SynthKind::Longout => (400, 0.25),
        };
        SynthConfig {
            kind,
            sessions,
            session_rate,
            seed: 0,
            max_input: 60_000,
            timing: Timing::default(),
        }
    }
}

/// Turn timing used to place the next turn of a session: it arrives after
/// the previous one is prefilled (no cache) and decoded, plus a think time.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// Prefill latency model (prefill of the whole input, as if uncached).
    pub prefill: TtftModel,
    /// Decode time per output token, in ms.
    pub decode_ms_per_token: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            prefill: TtftModel::default(),
            decode_ms_per_token: 20.0,
        }
    }
}

impl Timing {
    /// Seconds from a turn's arrival to its last output token.
    pub fn turn_s(&self, input_len: usize, output_len: usize) -> f64 {
        (self.prefill.prefill_ms_linear_uncached(input_len)
            + self.decode_ms_per_token * output_len as f64)
            / 1000.0
    }
}

/// One turn of a session before ids are assigned.
#[derive(Clone, Debug)]
pub struct Turn {
    /// Tokens appended to the history (the whole input for the first turn).
    pub append: Vec<u32>,
    /// Tokens decoded.
    pub output: Vec<u32>,
    /// Think (or environment) time after the output, before the next turn.
    pub think_s: f64,
}

/// A session: its start time and turns.
#[derive(Clone, Debug)]
pub struct Session {
    /// Arrival of the first turn, in seconds.
    pub start_s: f64,
    /// The turns, in order.
    pub turns: Vec<Turn>,
}

/// Places every turn in time, sorts by arrival and assigns ids: turn k + 1
/// of a session extends turn k.
pub fn assemble(sessions: Vec<Session>, timing: &Timing) -> Trace {
    struct Item {
        arrival: f64,
        session: u64,
        turn: usize,
        append: Vec<u32>,
        output: Vec<u32>,
    }
    let mut items = Vec::new();
    for (s, sess) in sessions.into_iter().enumerate() {
        let mut t = sess.start_s;
        let mut input_len = 0usize;
        for (k, turn) in sess.turns.into_iter().enumerate() {
            input_len += turn.append.len();
            let next = t + timing.turn_s(input_len, turn.output.len()) + turn.think_s;
            input_len += turn.output.len();
            items.push(Item {
                arrival: round_us(t),
                session: s as u64,
                turn: k,
                append: turn.append,
                output: turn.output,
            });
            t = next;
        }
    }
    items.sort_by(|a, b| {
        a.arrival
            .total_cmp(&b.arrival)
            .then(a.session.cmp(&b.session))
            .then(a.turn.cmp(&b.turn))
    });
    let mut last_id: std::collections::HashMap<u64, u64> = Default::default();
    let records = items
        .into_iter()
        .enumerate()
        .map(|(id, it)| {
            let id = id as u64;
            let base = match last_id.insert(it.session, id) {
                Some(prev) if it.turn > 0 => Base::Extends(prev),
                _ => Base::Full,
            };
            Record {
                id,
                session: it.session,
                arrival_s: it.arrival,
                base,
                tokens: it.append,
                output: it.output,
                checkpoints: Vec::new(),
            }
        })
        .collect();
    Trace::from_records(records)
}

/// Arrival times are kept to the microsecond so that they print short and
/// round-trip exactly through JSON.
fn round_us(t: f64) -> f64 {
    (t * 1e6).round() / 1e6
}

/// Generates the trace `cfg` describes.
pub fn generate(cfg: &SynthConfig) -> Trace {
    let mut rng = Rng::new(cfg.seed ^ ((cfg.kind as u64) << 56));
    let mut prefixes = Vec::new();
    let sessions = match cfg.kind {
        SynthKind::Agentic => agentic(cfg, &mut rng, &mut prefixes),
        SynthKind::Chat => chat(cfg, &mut rng, &mut prefixes),
        SynthKind::Longout => longout(cfg, &mut rng, &mut prefixes),
    };
    let mut trace = assemble(sessions, &cfg.timing);
    trace.app_prefixes = prefixes;
    trace
}

fn starts(cfg: &SynthConfig, rng: &mut Rng) -> Vec<f64> {
    let mut t = 0.0;
    (0..cfg.sessions)
        .map(|_| {
            let s = t;
            t += rng.exp(1.0 / cfg.session_rate.max(1e-9));
            s
        })
        .collect()
}

/// SWE-agent on SWE-bench: a shared system prompt and demonstration, an
/// issue statement per session, then rounds of action and observation.
/// The prefixes each generator's application knows are shared go to
/// `prefixes` ([`Trace::app_prefixes`]): the system prompt with the
/// demonstration (agentic: every run starts with both, so the end of the
/// system prompt alone is never a branch point and is not declared), each
/// system prompt (chat, longout).
fn agentic(cfg: &SynthConfig, rng: &mut Rng, prefixes: &mut Vec<Vec<u32>>) -> Vec<Session> {
    let mut shared = rng.fork(1);
    let system = shared.tokens(1_800, VOCAB);
    let demo = shared.tokens(3_200, VOCAB);
    prefixes.push([system.as_slice(), demo.as_slice()].concat());
    let max = cfg.max_input as usize;
    starts(cfg, rng)
        .into_iter()
        .enumerate()
        .map(|(i, start_s)| {
            let mut r = rng.fork(1000 + i as u64);
            let mut first = system.clone();
            first.extend_from_slice(&demo);
            let issue = r.lognormal(900.0, 0.8, 100, 6_000);
            first.extend(r.tokens(issue, VOCAB));
            let rounds = r.lognormal(30.0, 0.6, 4, 150);
            let mut turns = Vec::new();
            let mut len = 0usize;
            let mut append = first;
            for _ in 0..rounds {
                let action = r.lognormal(110.0, 0.7, 15, 1_500);
                if len + append.len() + action as usize > max {
                    break;
                }
                len += append.len() + action as usize;
                let output = r.tokens(action, VOCAB);
                turns.push(Turn {
                    append: std::mem::take(&mut append),
                    output,
                    think_s: r.lognormal(3_000.0, 0.8, 200, 60_000) as f64 / 1000.0,
                });
                let obs = r.lognormal(260.0, 1.1, 5, 12_000);
                append = r.tokens(obs, VOCAB);
            }
            Session { start_s, turns }
        })
        .collect()
}

/// ShareGPT-style: a few popular system prompts (Zipf-like popularity),
/// short user messages, outputs of tens to hundreds of tokens.
fn chat(cfg: &SynthConfig, rng: &mut Rng, prefixes: &mut Vec<Vec<u32>>) -> Vec<Session> {
    let mut shared = rng.fork(2);
    let prompts: Vec<Vec<u32>> = [700, 450, 300, 200, 120]
        .iter()
        .map(|&n| shared.tokens(n, VOCAB))
        .collect();
    prefixes.extend(prompts.iter().cloned());
    let weights: Vec<f64> = (1..=prompts.len()).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum::<f64>() / 0.7; // 30% have no system prompt
    chat_like(cfg, rng, |r| {
        let mut u = r.unit() * total;
        for (p, w) in prompts.iter().zip(&weights) {
            if u < *w {
                return p.clone();
            }
            u -= w;
        }
        Vec::new()
    })
    .into_iter()
    .map(|mut s| {
        for t in &mut s.turns {
            t.output.truncate(t.output.len().min(1_500));
        }
        s
    })
    .collect()
}

fn chat_like(
    cfg: &SynthConfig,
    rng: &mut Rng,
    mut system: impl FnMut(&mut Rng) -> Vec<u32>,
) -> Vec<Session> {
    let long = cfg.kind == SynthKind::Longout;
    let max = cfg.max_input as usize;
    starts(cfg, rng)
        .into_iter()
        .enumerate()
        .map(|(i, start_s)| {
            let mut r = rng.fork(1000 + i as u64);
            let mut append = system(&mut r);
            let n_turns = 1 + r.exp(if long { 2.0 } else { 2.5 }) as u64;
            let mut turns = Vec::new();
            let mut len = 0usize;
            for _ in 0..n_turns.min(40) {
                let user = r.lognormal(if long { 90.0 } else { 60.0 }, 1.0, 2, 4_000);
                append.extend(r.tokens(user, VOCAB));
                let out = if long {
                    r.lognormal(650.0, 0.9, 5, 8_000)
                } else {
                    r.lognormal(180.0, 0.9, 3, 1_500)
                };
                if len + append.len() + out as usize > max {
                    break;
                }
                len += append.len() + out as usize;
                turns.push(Turn {
                    append: std::mem::take(&mut append),
                    output: r.tokens(out, VOCAB),
                    think_s: r.exp(if long { 45.0 } else { 30.0 }),
                });
            }
            Session { start_s, turns }
        })
        .filter(|s| !s.turns.is_empty())
        .collect()
}

/// LMSys-style: a short shared system prompt, user messages, long outputs.
fn longout(cfg: &SynthConfig, rng: &mut Rng, prefixes: &mut Vec<Vec<u32>>) -> Vec<Session> {
    let mut shared = rng.fork(3);
    let prompt = shared.tokens(40, VOCAB);
    prefixes.push(prompt.clone());
    chat_like(cfg, rng, |_| prompt.clone())
}
