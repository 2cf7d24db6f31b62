//! Typed errors of the allocator layer.

use crate::handle::PoolKind;

/// Why an allocator call failed. Every failure is a value; no allocator path panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The pool has fewer free units than requested; nothing was allocated.
    #[error("{pool} pool out of capacity: requested {requested} units, {free} free of {capacity}")]
    OutOfCapacity {
        /// Pool that could not satisfy the request.
        pool: PoolKind,
        /// Units asked for.
        requested: u32,
        /// Units free at the time of the call.
        free: u32,
        /// Capacity of the pool in units.
        capacity: u32,
    },
    /// The handle's slot has been reallocated since (freed or evicted, then reused).
    #[error("stale handle {0:#018x}: its unit was freed and now belongs to a later allocation")]
    StaleHandle(u64),
    /// The handle was already freed and its unit has not been reused.
    #[error("double free of handle {0:#018x}")]
    DoubleFree(u64),
    /// The handle names another pool than the one the caller expected, or a pool
    /// this layout does not hold, or an index outside the pool.
    #[error("handle {handle:#018x} belongs to the {actual} pool, expected {expected}")]
    WrongPool {
        /// The raw handle.
        handle: u64,
        /// Pool the caller expected.
        expected: PoolKind,
        /// Pool encoded in the handle.
        actual: PoolKind,
    },
    /// The handle was issued by another allocator (another pool id), or does
    /// not decode to a unit of this one (index out of range, generation 0).
    #[error("handle {0:#018x} does not belong to this allocator")]
    ForeignHandle(u64),
    /// A capacity migration could not run; the pools are unchanged.
    #[error("migration toward the {recipient} pool refused: {reason}")]
    MigrationRefused {
        /// Pool that would have grown.
        recipient: PoolKind,
        /// Why it was refused.
        reason: MigrationRefusal,
    },
    /// The physical backing failed (see [`crate::phys::PhysError`]).
    #[error("physical backing: {0}")]
    Physical(#[from] crate::phys::PhysError),
    /// The layout cannot be built from this configuration.
    #[error("invalid allocator configuration: {0}")]
    InvalidConfig(String),
}

/// Why a capacity migration was refused (the pools are left as they were).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MigrationRefusal {
    /// This layout never migrates (static split, padded unified).
    #[error("this layout does not migrate capacity")]
    Unsupported,
    /// The donor pool has fewer units than one migration batch.
    #[error("donor pool smaller than one batch")]
    DonorTooSmall,
    /// A unit in the donor's tail (the part that would move) is in use.
    #[error("donor tail holds live units")]
    DonorTailInUse,
    /// The recipient would exceed the whole budget divided by its unit size.
    #[error("recipient would exceed the whole budget")]
    RecipientOverBudget,
    /// The batch is too small to give the recipient even one unit.
    #[error("batch smaller than one recipient unit")]
    BatchBelowRecipientUnit,
    /// The policy's throttle or threshold did not allow it.
    #[error("policy throttle or threshold")]
    Policy,
}
