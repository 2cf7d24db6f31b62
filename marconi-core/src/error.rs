//! Typed errors. Every failing call leaves the cache unchanged.

/// Why a cache call was refused. A refused call changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// The configuration cannot drive a cache.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A token array was empty where at least one token is needed.
    #[error("token array is empty")]
    EmptyTokens,
    /// A token array longer than the cache can index (2^32 − 1 tokens).
    #[error("token array has {len} tokens, more than the 4294967295 a sequence may hold")]
    TooManyTokens {
        /// The length given.
        len: usize,
    },
    /// The lease is unknown: never issued, or already released.
    #[error("lease {0} is unknown or already released")]
    UnknownLease(u64),
    /// The admitted tokens do not start with the input the lease looked up.
    #[error("admitted tokens do not start with the {input_len} input tokens of the lease")]
    PrefixMismatch {
        /// Length of the looked-up input.
        input_len: usize,
    },
    /// The KV page list has the wrong length.
    #[error(
        "kv page list has {got} ids, expected {expected} (one per full page of the admitted \
         tokens; none at all in a cache that does not track pages)"
    )]
    BadPageList {
        /// Full pages in the admitted sequence.
        expected: usize,
        /// Ids given.
        got: usize,
    },
    /// A state was offered at a position the cache did not plan.
    #[error("state at position {position} was not planned for this request (allowed: {allowed})")]
    NotPlanned {
        /// The position offered.
        position: u32,
        /// What the policy allows, in words.
        allowed: String,
    },
    /// A state position outside `1..=tokens.len()`.
    #[error("state position {position} is outside 1..={len}")]
    PositionOutOfRange {
        /// The position offered.
        position: u32,
        /// Length of the admitted sequence.
        len: usize,
    },
    /// The same position appears twice in one call.
    #[error("state position {0} given twice")]
    DuplicatePosition(u32),
    /// A state slot given twice in one call, or already owned by the cache.
    #[error("state slot {0} is given twice or already owned by the cache")]
    DuplicateSlot(u32),
    /// A KV page id given twice in one call, or already owned by the cache.
    #[error("kv page {0} is given twice or already owned by the cache")]
    DuplicatePage(u32),
}
