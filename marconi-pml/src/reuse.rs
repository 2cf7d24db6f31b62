//! How a laid-out prompt reuses cached module states, by model kind. The
//! modes are named and never mixed: an attention-only model reuses every
//! module (Prompt Cache); a hybrid model reuses exactly only the leading
//! run of module content (a recurrent state depends on everything before
//! it), and approximately, when asked, the modules after it (HYPIC-style
//! composition of Mamba-2's linear recurrence, h(A.B) = Φ_B h(A) + h_B(0),
//! with a boundary window recomputed).

use crate::layout::{Encoded, Layout, SegmentKind};
use crate::schema::ModuleId;

/// Which reuse a caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReuseMode {
    /// Attention-only models (Prompt Cache §3.4): every cached segment's
    /// KV is reused at its schema positions, in any order.
    Attention,
    /// Hybrid models, exact: only the leading run of cached segments that
    /// starts at position 0 and leaves no gap (a prefix of the schema's own
    /// layout, so its states are those of an ordinary prefix); cached
    /// segments after it are recomputed.
    Exact,
    /// Hybrid models, approximate: the leading run as in `Exact`; each
    /// cached segment after it reuses its KV and a composed state, its
    /// first `window` tokens recomputed.
    Composed {
        /// Tokens recomputed at the start of each composed segment.
        window: u32,
    },
}

/// How one segment is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reuse {
    /// Part of the exact leading run: KV and the recurrent state at its
    /// end come from a prefix of the schema's layout.
    Exact,
    /// KV reused at the schema's positions (attention-only models).
    Attention,
    /// KV reused and the state composed (approximate); `recomputed`
    /// leading tokens are computed again.
    Composed {
        /// Tokens recomputed at the segment's start.
        recomputed: u32,
    },
    /// Cached, but computed again (an exact hybrid lookup past the run).
    Recomputed,
    /// Never cached: an argument or the prompt's own text.
    Computed,
}

impl Reuse {
    /// `exact`, `attention`, `composed`, `recomputed` or `computed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reuse::Exact => "exact",
            Reuse::Attention => "attention",
            Reuse::Composed { .. } => "composed",
            Reuse::Recomputed => "recomputed",
            Reuse::Computed => "computed",
        }
    }

    /// Tokens of a segment of `len` tokens whose states are reused.
    pub fn reused_of(self, len: u32) -> u32 {
        match self {
            Reuse::Exact | Reuse::Attention => len,
            Reuse::Composed { recomputed } => len - recomputed.min(len),
            Reuse::Recomputed | Reuse::Computed => 0,
        }
    }
}

/// What a lookup reuses, segment by segment, under one [`ReuseMode`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReusePlan {
    /// The mode asked for.
    pub mode: ReuseMode,
    /// One entry per segment of the layout.
    pub segments: Vec<Reuse>,
    /// Segments in the exact leading run (the first `exact_run` ones);
    /// in `Attention` mode, those the run would hold.
    pub exact_run: usize,
}

impl ReusePlan {
    /// Plans the reuse of `layout`.
    pub fn new(layout: &Layout, mode: ReuseMode) -> ReusePlan {
        let mut next = 0u32;
        let exact_run = layout
            .segments
            .iter()
            .take_while(|s| {
                let ok = s.cached && s.start == next;
                next = s.end();
                ok
            })
            .count();
        let segments = layout
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| match (s.cached, mode) {
                (false, _) => Reuse::Computed,
                (true, ReuseMode::Attention) => Reuse::Attention,
                (true, _) if i < exact_run => Reuse::Exact,
                (true, ReuseMode::Exact) => Reuse::Recomputed,
                (true, ReuseMode::Composed { window }) => Reuse::Composed {
                    recomputed: window.min(s.len),
                },
            })
            .collect();
        ReusePlan {
            mode,
            segments,
            exact_run,
        }
    }

    /// Tokens whose states are reused.
    pub fn reused_tokens(&self, layout: &Layout) -> u64 {
        self.segments
            .iter()
            .zip(&layout.segments)
            .map(|(r, s)| u64::from(r.reused_of(s.len)))
            .sum()
    }

    /// Each imported module with the least exact reuse among its content
    /// segments (arguments aside), in the layout's order.
    pub fn modules(&self, layout: &Layout) -> Vec<(ModuleId, Reuse)> {
        fn rank(r: Reuse) -> u8 {
            match r {
                Reuse::Exact => 0,
                Reuse::Attention => 1,
                Reuse::Composed { .. } => 2,
                Reuse::Recomputed => 3,
                Reuse::Computed => 4,
            }
        }
        let mut out: Vec<(ModuleId, Reuse)> = Vec::new();
        for (r, s) in self.segments.iter().zip(&layout.segments) {
            let (Some(m), SegmentKind::Module) = (s.module, s.kind) else {
                continue;
            };
            match out.iter_mut().find(|(x, _)| *x == m) {
                Some((_, worst)) if rank(*r) > rank(*worst) => *worst = *r,
                Some(_) => {}
                None => out.push((m, *r)),
            }
        }
        out
    }

    /// The exact run as a prefix-cache request: its tokens (positions 0
    /// onwards, no gap) and the ends of its segments, where states are
    /// worth saving (hints for `PrefixCache::lookup_hinted` in
    /// [`namespace`]'s namespace).
    pub fn exact_prefix(&self, layout: &Layout) -> (Vec<u32>, Vec<u32>) {
        let run = &layout.segments[..self.exact_run];
        let tokens = run.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let mut ends: Vec<u32> = run.iter().map(|s| s.end()).filter(|&e| e > 0).collect();
        ends.dedup();
        (tokens, ends)
    }
}

/// The prefix-cache namespace of an encoded schema: FNV-1a (64-bit) over
/// its name, every module's name and span and every text's tokens, so two
/// schemas (or two versions of one) never share entries, and one schema
/// encoded with one tokenizer always gets the same namespace.
pub fn namespace(enc: &Encoded) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    };
    eat(enc.schema().name().as_bytes());
    eat(&[0xff]);
    for s in enc.anonymous_segments() {
        eat(&s.start.to_le_bytes());
        s.tokens.iter().for_each(|t| eat(&t.to_le_bytes()));
    }
    for i in 0..enc.schema().modules().len() {
        let m = ModuleId(i);
        eat(enc.schema().module(m).name.as_bytes());
        eat(&[0xff]);
        let (start, len) = enc.module_span(m);
        eat(&start.to_le_bytes());
        eat(&len.to_le_bytes());
        for s in enc.module_segments(m) {
            eat(&s.start.to_le_bytes());
            eat(&s.len.to_le_bytes());
            s.tokens.iter().for_each(|t| eat(&t.to_le_bytes()));
        }
    }
    h
}
