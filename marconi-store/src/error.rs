//! Typed errors of stores and of their configuration.

use std::time::Duration;

/// Why a store call failed. Every one of them reads as a miss to the tier.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The call ran out of its time bound.
    #[error("store call timed out (bound {0:?})")]
    Timeout(Duration),
    /// The store cannot be reached (refused, reset, or waiting out a
    /// reconnection backoff).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store answered with an error or something that is not an answer.
    #[error("store failed: {0}")]
    Failed(String),
    /// The request itself is invalid (an object name the store refuses).
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// A configuration that cannot build a store or a tier.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid store configuration: {0}")]
pub struct ConfigError(pub String);
