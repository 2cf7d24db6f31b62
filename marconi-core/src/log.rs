//! The decision log: one structured record per decision, also emitted
//! through `tracing` at debug level (target `marconi::decision`).

use std::fmt;

use serde::Serialize;

/// Why a checkpoint was planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PlanReason {
    /// Speculative insertion would split an edge: a new branch node.
    NewBranch,
    /// The input ends inside a cached edge: a branch at the end of the prompt.
    PromptEnd,
    /// The input adds a child to an existing node that has no state.
    ExistingBranch,
    /// Block boundaries (all-blocks admission).
    Blocks,
    /// A position the application said will be shared (a checkpoint hint
    /// of [`crate::PrefixCache::lookup_hinted`]: the end of a system
    /// prompt, of tool definitions, of a document), planned before any
    /// second request branches there.
    AppCheckpoint,
}

/// How a node was evicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum EvictKind {
    /// A leaf: its state and its edge's KV are freed.
    Leaf,
    /// A node with one child: its state is freed, its edge merges into the child.
    Merge,
}

/// One decision of the cache.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decision {
    /// A lookup: what matched and what is usable.
    Lookup {
        /// The lease issued (also the request's id in later records).
        lease: u64,
        /// Namespace looked up.
        namespace: u64,
        /// Input length.
        input: u32,
        /// Tokens whose KV is cached.
        kv_matched: u32,
        /// Tokens that can be skipped (a state exists there).
        hit: u32,
    },
    /// Checkpoints planned for the prefill.
    Plan {
        /// The lease.
        lease: u64,
        /// Positions at which the engine should save states.
        positions: Vec<u32>,
        /// Why.
        reason: PlanReason,
    },
    /// An admission.
    Admit {
        /// The lease.
        lease: u64,
        /// Length of the admitted sequence.
        tokens: u32,
        /// Tokens of KV newly cached.
        new_kv: u32,
        /// Positions whose states were newly cached.
        states: Vec<u32>,
        /// Why nothing was cached, if so.
        rejected: Option<String>,
    },
    /// A lease released.
    Release {
        /// The lease.
        lease: u64,
    },
    /// An eviction, with the scores that decided it.
    Evict {
        /// Prefix length at the end of the evicted node's edge.
        depth: u32,
        /// Tokens on its edge.
        edge: u32,
        /// Leaf or merge.
        how: EvictKind,
        /// Normalised recency in [0, 1] among the candidates.
        recency: f64,
        /// Normalised FLOP efficiency in [0, 1] among the candidates.
        efficiency: f64,
        /// recency + α · efficiency.
        utility: f64,
        /// Bytes freed.
        freed_bytes: u64,
    },
    /// The result of one α tuning round.
    Alpha {
        /// Tuning round (1 = the bootstrap window).
        round: u32,
        /// Requests replayed.
        requests: u32,
        /// α before.
        old: f64,
        /// α adopted.
        new: f64,
        /// What α = 0 (under the rules in force) scored on the window:
        /// prefill FLOPs saved, or tokens hit, by the window's requests
        /// replayed from the window's start. (A shadow switch logs the
        /// decayed score of the shadow followed until then.)
        objective_at_zero: f64,
        /// What the adopted α scored on the same window. (A shadow switch
        /// logs the decayed score of the shadow followed from now.)
        objective_at_new: f64,
    },
    /// An α tuning round whose grid search failed (a panic inside a replay,
    /// which is a bug): α stays as it was.
    AlphaKept {
        /// Requests in the window that was to be replayed.
        requests: u32,
        /// α, unchanged.
        alpha: f64,
        /// What went wrong.
        reason: String,
    },
    /// A tuning round changed the eviction rules
    /// ([`crate::TunerConfig::tune_rules`]); logged after its `Alpha` record.
    Rules {
        /// Tuning round.
        round: u32,
        /// Plain LRU (SGLang+'s rules) now, instead of FLOP-aware eviction.
        lru: bool,
        /// FLOP-aware eviction's [`crate::CacheConfig::protect_branch_states`]
        /// now (meaningless under LRU).
        protect_branch_states: bool,
    },
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Lookup {
                lease,
                namespace,
                input,
                kv_matched,
                hit,
            } => write!(
                f,
                "lookup  #{lease} ns={namespace} input={input} kv_matched={kv_matched} hit={hit}"
            ),
            Decision::Plan {
                lease,
                positions,
                reason,
            } => write!(f, "plan    #{lease} {reason:?} at {positions:?}"),
            Decision::Admit {
                lease,
                tokens,
                new_kv,
                states,
                rejected,
            } => {
                write!(
                    f,
                    "admit   #{lease} tokens={tokens} new_kv={new_kv} states={states:?}"
                )?;
                if let Some(r) = rejected {
                    write!(f, " REJECTED: {r}")?;
                }
                Ok(())
            }
            Decision::Release { lease } => write!(f, "release #{lease}"),
            Decision::Evict {
                depth,
                edge,
                how,
                recency,
                efficiency,
                utility,
                freed_bytes,
            } => write!(
                f,
                "evict   {how:?} depth={depth} edge={edge} recency={recency:.3} eff={efficiency:.3} utility={utility:.3} freed={freed_bytes}"
            ),
            Decision::Alpha {
                round,
                requests,
                old,
                new,
                objective_at_zero,
                objective_at_new,
            } => write!(
                f,
                "alpha   round={round} requests={requests} {old:.1} -> {new:.1} (objective {objective_at_zero:.4e} at 0, {objective_at_new:.4e} at new)"
            ),
            Decision::AlphaKept {
                requests,
                alpha,
                reason,
            } => write!(
                f,
                "alpha   kept {alpha:.1}: the search over {requests} requests failed: {reason}"
            ),
            Decision::Rules {
                round,
                lru,
                protect_branch_states,
            } => {
                let rules = match (lru, protect_branch_states) {
                    (true, _) => "lru",
                    (false, true) => "flop-aware, branch states protected",
                    (false, false) => "flop-aware (the paper's merge rule)",
                };
                write!(f, "rules   round={round} {rules}")
            }
        }
    }
}

/// Records decisions when enabled; always emits them through `tracing`.
#[derive(Clone, Debug, Default)]
pub(crate) struct DecisionLog {
    pub(crate) enabled: bool,
    records: Vec<Decision>,
}

impl DecisionLog {
    pub(crate) fn new(enabled: bool) -> Self {
        DecisionLog {
            enabled,
            records: Vec::new(),
        }
    }

    /// Records `make()` if the log is enabled or tracing listens; building a
    /// record costs nothing otherwise.
    pub(crate) fn push(&mut self, make: impl FnOnce() -> Decision) {
        let tracing_on = tracing::enabled!(target: "marconi::decision", tracing::Level::DEBUG);
        if !self.enabled && !tracing_on {
            return;
        }
        let d = make();
        if tracing_on {
            tracing::debug!(target: "marconi::decision", "{d}");
        }
        if self.enabled {
            self.records.push(d);
        }
    }

    pub(crate) fn drain(&mut self) -> Vec<Decision> {
        std::mem::take(&mut self.records)
    }
}
