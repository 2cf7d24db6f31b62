//! The allocator layouts behind one trait: AVMP dual pools (static split or
//! dynamic migration, paper §3.1–3.2), and vLLM's padded unified table.

use serde::Serialize;

use crate::error::{AllocError, MigrationRefusal};
use crate::handle::{HandleLayout, PoolId, PoolKind, VirtualHandle};
use crate::table::UnitTable;

/// Rounds `x` up to a multiple of `align` (a power of two or any positive value).
#[must_use]
pub fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

/// Slab alignment of every unit size (paper §3.1: 128-byte alignment).
pub const UNIT_ALIGN: u64 = 128;

/// Shape of a hybrid model's caches, enough to size the two units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    /// KV heads per attention layer.
    pub kv_heads: u64,
    /// Head dimension.
    pub head_dim: u64,
    /// SSM inner dimension.
    pub d_inner: u64,
    /// SSM state dimension.
    pub d_state: u64,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u64,
    /// Tokens per KV page.
    pub tokens_per_page: u64,
}

impl ModelShape {
    /// KV page bytes: `align_up(2 · kv_heads · head_dim · dtype · tokens, 128)`.
    #[must_use]
    pub fn kv_page_bytes(&self) -> u64 {
        align_up(
            2 * self.kv_heads * self.head_dim * self.dtype_bytes * self.tokens_per_page,
            UNIT_ALIGN,
        )
    }

    /// SSM block bytes: one layer's recurrent state, `align_up(d_inner · d_state · dtype, 128)`.
    #[must_use]
    pub fn ssm_block_bytes(&self) -> u64 {
        align_up(self.d_inner * self.d_state * self.dtype_bytes, UNIT_ALIGN)
    }
}

/// Where a live handle's unit lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// The table (address range) holding the unit: KV or SSM for dual pools; the
    /// padded unified layout reports `Kv` for its single table.
    pub table: PoolKind,
    /// Byte offset of the unit from the start of that table's address range.
    pub byte_offset: u64,
    /// Usable bytes of the unit (the table's unit size).
    pub unit_bytes: u64,
}

/// The outcome of one capacity migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Migration {
    /// Pool that gave capacity.
    pub donor: PoolKind,
    /// Pool that received it.
    pub recipient: PoolKind,
    /// Units removed from the donor's tail.
    pub donor_units: u32,
    /// Units appended to the recipient.
    pub recipient_units: u32,
    /// Bytes the donor gave up (`donor_units · donor_unit`).
    pub donor_bytes: u64,
}

/// Counters every layout keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AllocStats {
    /// Successful migrations.
    pub rebalance_count: u64,
    /// Sum of `donor_bytes` over successful migrations.
    pub bytes_migrated: u64,
    /// Logical operation counter: one per allocate and per free call.
    pub ops: u64,
}

/// An allocator of fixed-size units in a KV pool and an SSM pool.
///
/// Contract: `allocate` is all-or-nothing (on error nothing was allocated and `out`
/// is unchanged); every failure is an [`AllocError`], no method panics on bad
/// input; a handle value is issued once for the life of the process (the pool
/// id refuses other allocators' handles, the generation stale ones, and a
/// unit is retired rather than let its generation wrap). Each call is O(1) per unit except migration
/// (O(donor tail)).
pub trait PoolAllocator {
    /// A short name of the layout (used in reports).
    fn name(&self) -> &str;
    /// Size in bytes of one unit of `pool` (as laid out: padded for the unified layout).
    fn unit_bytes(&self, pool: PoolKind) -> u64;
    /// Current capacity of `pool` in units (the unified layout reports the shared table).
    fn capacity(&self, pool: PoolKind) -> u32;
    /// Free units of `pool`.
    fn free_units(&self, pool: PoolKind) -> u32;
    /// Unit indices `0..extent` of `pool`'s table: its capacity plus its
    /// retired units below the extent (what a mapping of the table spans).
    fn extent(&self, pool: PoolKind) -> u32 {
        self.capacity(pool)
    }
    /// Units of `pool` ever retired: freed at their last generation, never
    /// allocated again (so a stale handle never names a live unit).
    fn retired_units(&self, pool: PoolKind) -> u64 {
        let _ = pool;
        0
    }
    /// Allocates `n` units of `pool`, appending their handles to `out`; all or nothing.
    fn allocate(
        &mut self,
        pool: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<(), AllocError>;
    /// Frees one unit.
    fn free(&mut self, handle: VirtualHandle) -> Result<(), AllocError>;
    /// Resolves a live handle to its table and byte offset, O(1).
    fn resolve(&self, handle: VirtualHandle) -> Result<Location, AllocError>;
    /// Moves one batch of capacity from the other pool to `recipient` (paper §3.2).
    /// Layouts that never migrate return [`MigrationRefusal::Unsupported`].
    fn migrate_toward(&mut self, recipient: PoolKind) -> Result<Migration, AllocError> {
        Err(AllocError::MigrationRefused {
            recipient,
            reason: MigrationRefusal::Unsupported,
        })
    }
    /// Moves `donor_units` units of the other pool to `recipient`, bypassing the
    /// policy's trigger (for policies layered on top, such as [`crate::policy`]).
    fn migrate_units_toward(
        &mut self,
        recipient: PoolKind,
        donor_units: u32,
    ) -> Result<Migration, AllocError> {
        let _ = donor_units;
        Err(AllocError::MigrationRefused {
            recipient,
            reason: MigrationRefusal::Unsupported,
        })
    }
    /// Counters.
    fn stats(&self) -> AllocStats;
    /// The whole byte budget of both pools (default: the bytes their current
    /// capacities hold).
    fn total_bytes(&self) -> u64 {
        PoolKind::ALL
            .iter()
            .map(|&p| u64::from(self.capacity(p)).saturating_mul(self.unit_bytes(p)))
            .sum()
    }
    /// Whether both kinds share one table (so [`capacity`](Self::capacity)
    /// and [`free_units`](Self::free_units) count the same units for both).
    fn shares_capacity(&self) -> bool {
        false
    }
    /// Whether this layout can move capacity between its pools.
    fn migrates(&self) -> bool {
        false
    }
    /// Bytes a migration step should move (the physical chunk size: one
    /// `unmap` + `map`); [`crate::policy::CHUNK_BYTES`] by default.
    fn migration_step_bytes(&self) -> u64 {
        crate::policy::CHUNK_BYTES
    }
    /// The handle currently live at raw unit `index` of `pool`'s table, if any.
    /// Only for emulating callers that keep raw page ids (see [`crate::avmp`]).
    fn live_handle_at(&self, pool: PoolKind, index: u32) -> Option<VirtualHandle>;
    /// The raw unit index behind a handle (no liveness check).
    fn unit_index(&self, handle: VirtualHandle) -> u32;

    /// Frees `handle` after checking it belongs to `pool`.
    fn free_in(&mut self, pool: PoolKind, handle: VirtualHandle) -> Result<(), AllocError> {
        check_pool(pool, handle)?;
        self.free(handle)
    }

    /// Resolves `handle` after checking it belongs to `pool`.
    fn resolve_in(&self, pool: PoolKind, handle: VirtualHandle) -> Result<Location, AllocError> {
        check_pool(pool, handle)?;
        self.resolve(handle)
    }

    /// The paper's allocate path: try; on [`AllocError::OutOfCapacity`] migrate one
    /// batch toward `pool` and retry once. Returns the original capacity error when
    /// the migration is refused.
    fn allocate_or_migrate(
        &mut self,
        pool: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<Option<Migration>, AllocError> {
        match self.allocate(pool, n, out) {
            Ok(()) => Ok(None),
            Err(e @ AllocError::OutOfCapacity { .. }) => match self.migrate_toward(pool) {
                Ok(m) => self.allocate(pool, n, out).map(|()| Some(m)),
                Err(_) => Err(e),
            },
            Err(e) => Err(e),
        }
    }
}

fn check_pool(expected: PoolKind, handle: VirtualHandle) -> Result<(), AllocError> {
    if handle.pool() == expected {
        Ok(())
    } else {
        Err(AllocError::WrongPool {
            handle: handle.raw(),
            expected,
            actual: handle.pool(),
        })
    }
}

/// When a dual-pool layout moves capacity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum MigrationPolicy {
    /// Never (SGLang-style static split, and `avmp_static`).
    Static,
    /// On demand, paper §3.2: move `batch_units` donor units from the donor's tail.
    Dynamic {
        /// Donor units per migration (`migration_batch_size`, default 128).
        batch_units: u32,
        /// Minimum logical ops between two migrations (0 = no throttle, as the
        /// prototype's forced path).
        min_interval_ops: u64,
        /// Required free fraction of the donor (`threshold_high`); `None` = no check
        /// (the prototype's forced path).
        donor_free_threshold: Option<f64>,
    },
}

impl MigrationPolicy {
    /// The prototype's `avmp_dynamic_b<batch>` forced path: no throttle, no threshold.
    #[must_use]
    pub fn forced(batch_units: u32) -> Self {
        MigrationPolicy::Dynamic {
            batch_units,
            min_interval_ops: 0,
            donor_free_threshold: None,
        }
    }
}

/// Pool pressure as in the paper's Figure 2 (the REBALANCING state is the
/// duration of [`DualPool::migrate_units`], which is synchronous here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Pressure {
    /// Neither pool is below the low threshold.
    Balanced,
    /// The KV pool's free fraction is below the low threshold.
    KvPressured,
    /// The SSM pool's free fraction is below the low threshold.
    SsmPressured,
}

/// Configuration of a [`DualPool`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DualPoolConfig {
    /// Whole byte budget of both pools together.
    pub total_bytes: u64,
    /// Fraction of the budget given to the SSM pool at start (`mamba_ratio`).
    pub ssm_ratio: f64,
    /// KV page bytes.
    pub kv_unit: u64,
    /// SSM block bytes.
    pub ssm_unit: u64,
    /// Migration policy.
    pub policy: MigrationPolicy,
}

/// Two pools with native unit sizes over one byte budget (AVMP, paper §3.1).
///
/// `ssm_bytes = floor(total · ratio)`, `kv_bytes = total − ssm_bytes`, capacity in
/// units = `floor(bytes / unit)`. Each pool's indices may grow up to
/// `floor(total / unit)` through migration.
///
/// Each pool holds a process-unique [`PoolId`] (its handles carry it), so it
/// is not `Clone`.
#[derive(Debug)]
pub struct DualPool {
    name: String,
    total_bytes: u64,
    policy: MigrationPolicy,
    layout: HandleLayout,
    _id: PoolId,
    tables: [UnitTable; 2],
    stats: AllocStats,
    last_migration_op: Option<u64>,
    step_bytes: u64,
}

fn units_in(bytes: u64, unit: u64) -> Result<u32, AllocError> {
    u32::try_from(bytes / unit)
        .map_err(|_| AllocError::InvalidConfig(format!("{bytes} B / {unit} B exceeds u32 units")))
}

impl DualPool {
    /// Builds the two pools.
    pub fn new(name: impl Into<String>, cfg: DualPoolConfig) -> Result<Self, AllocError> {
        if cfg.kv_unit == 0 || cfg.ssm_unit == 0 {
            return Err(AllocError::InvalidConfig("unit size 0".into()));
        }
        if !(cfg.ssm_ratio > 0.0 && cfg.ssm_ratio < 1.0) {
            return Err(AllocError::InvalidConfig(format!(
                "ssm_ratio {} not in (0, 1)",
                cfg.ssm_ratio
            )));
        }
        if let MigrationPolicy::Dynamic { batch_units: 0, .. } = cfg.policy {
            return Err(AllocError::InvalidConfig("batch_units 0".into()));
        }
        // Same arithmetic as the prototype: floor of the float product.
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "budget fits f64 exactly below 2^53 bytes; floor of a positive product"
        )]
        let ssm_bytes = (cfg.total_bytes as f64 * cfg.ssm_ratio).floor() as u64;
        let kv_bytes = cfg.total_bytes - ssm_bytes;
        let kv_max = units_in(cfg.total_bytes, cfg.kv_unit)?;
        let ssm_max = units_in(cfg.total_bytes, cfg.ssm_unit)?;
        let (kv_cap, ssm_cap) = (
            units_in(kv_bytes, cfg.kv_unit)?,
            units_in(ssm_bytes, cfg.ssm_unit)?,
        );
        if kv_max == 0 || ssm_max == 0 {
            return Err(AllocError::InvalidConfig(format!(
                "a {} B budget holds no {} B unit",
                cfg.total_bytes,
                if kv_max == 0 {
                    cfg.kv_unit
                } else {
                    cfg.ssm_unit
                }
            )));
        }
        let id = PoolId::acquire()?;
        let layout = HandleLayout::for_max_units(kv_max.max(ssm_max), &id);
        Ok(DualPool {
            name: name.into(),
            total_bytes: cfg.total_bytes,
            policy: cfg.policy,
            layout,
            _id: id,
            tables: [
                UnitTable::new(PoolKind::Kv, cfg.kv_unit, kv_cap, kv_max),
                UnitTable::new(PoolKind::Ssm, cfg.ssm_unit, ssm_cap, ssm_max),
            ],
            stats: AllocStats::default(),
            last_migration_op: None,
            step_bytes: crate::policy::CHUNK_BYTES,
        })
    }

    /// The whole byte budget.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes of capacity currently assigned to `pool` (`capacity · unit`).
    #[must_use]
    pub fn pool_bytes(&self, pool: PoolKind) -> u64 {
        let t = &self.tables[pool.index()];
        u64::from(t.capacity()) * t.unit_bytes
    }

    /// Live units of `pool`.
    #[must_use]
    pub fn live_units(&self, pool: PoolKind) -> u32 {
        self.tables[pool.index()].live_units()
    }

    /// Free fraction of `pool` (0 for an empty pool).
    #[must_use]
    pub fn free_fraction(&self, pool: PoolKind) -> f64 {
        let t = &self.tables[pool.index()];
        if t.capacity() == 0 {
            0.0
        } else {
            f64::from(t.free_units()) / f64::from(t.capacity())
        }
    }

    /// The pressure state for thresholds `low` (the paper's `threshold_low`):
    /// the pool with the lower free fraction is pressured when it is below `low`.
    #[must_use]
    pub fn pressure(&self, low: f64) -> Pressure {
        let (kv, ssm) = (
            self.free_fraction(PoolKind::Kv),
            self.free_fraction(PoolKind::Ssm),
        );
        if kv < low && kv <= ssm {
            Pressure::KvPressured
        } else if ssm < low {
            Pressure::SsmPressured
        } else {
            Pressure::Balanced
        }
    }

    /// Sets the bytes one migration step of a caller such as
    /// [`crate::pooled`] moves (default [`crate::policy::CHUNK_BYTES`], the
    /// GPU's 2 MiB granularity; at least 1).
    pub fn set_migration_step_bytes(&mut self, bytes: u64) {
        self.step_bytes = bytes.max(1);
    }

    /// Allocates the lowest free unit of each pool first, instead of the
    /// prototype's order (last freed, first reused): live units stay packed
    /// at the bottom, so the free capacity a cache leaves gathers at the
    /// tail, where a migration can take it. O(log n) per unit instead of
    /// O(1). Used by [`crate::pooled`] layouts; the AVMP replay keeps the
    /// prototype's order.
    pub fn set_lowest_first(&mut self) {
        for t in &mut self.tables {
            t.set_lowest_first();
        }
    }

    /// The migration policy.
    #[must_use]
    pub fn policy(&self) -> MigrationPolicy {
        self.policy
    }

    /// Migrates `donor_units` units from the donor's tail to `recipient`, regardless
    /// of policy (the policy decides *when*; this is *how*). The recipient grows by
    /// `floor(donor_units · donor_unit / recipient_unit)`; the donor's tail must be
    /// free and the recipient must stay within `floor(total / recipient_unit)`.
    /// On refusal the capacities are unchanged.
    pub fn migrate_units(
        &mut self,
        recipient: PoolKind,
        donor_units: u32,
    ) -> Result<Migration, AllocError> {
        let (d, r) = (recipient.other().index(), recipient.index());
        let old_d = self.tables[d].extent();
        let old_r = self.tables[r].extent();
        let (kv, ssm) = match self.plan_migration(recipient, donor_units) {
            Ok(p) => p,
            Err(
                e @ AllocError::MigrationRefused {
                    reason: MigrationRefusal::RecipientOverBudget,
                    ..
                },
            ) => {
                // The prototype shrinks the donor before it checks the recipient and
                // rolls back by growing again, which moves the donor's tail ids to the
                // end of its free list (ascending). Replays depend on that order.
                if self.tables[d].shrink(old_d - donor_units) {
                    let _ = self.tables[d].grow(old_d);
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let new = [kv, ssm];
        if !self.tables[d].shrink(new[d]) || !self.tables[r].grow(new[r]) {
            // Unreachable after a successful plan; restore and report anyway.
            let _ = self.tables[d].grow(old_d);
            let _ = self.tables[r].shrink(old_r);
            return Err(AllocError::MigrationRefused {
                recipient,
                reason: MigrationRefusal::DonorTailInUse,
            });
        }
        let donor_bytes = u64::from(donor_units) * self.tables[d].unit_bytes;
        self.stats.rebalance_count += 1;
        self.stats.bytes_migrated += donor_bytes;
        self.last_migration_op = Some(self.stats.ops);
        tracing::debug!(%recipient, donor_units, grow = new[r] - old_r, "capacity migrated");
        Ok(Migration {
            donor: recipient.other(),
            recipient,
            donor_units,
            recipient_units: new[r] - old_r,
            donor_bytes,
        })
    }

    /// Checks a migration without applying it and returns the extents
    /// `(kv_units, ssm_units)` it would leave (capacities, retired units
    /// included). The checks run in the prototype's
    /// order: donor large enough, donor tail free, recipient within the budget.
    pub fn plan_migration(
        &self,
        recipient: PoolKind,
        donor_units: u32,
    ) -> Result<(u32, u32), AllocError> {
        let refuse = |reason| AllocError::MigrationRefused { recipient, reason };
        let (d, r) = (recipient.other().index(), recipient.index());
        let donor_bytes = u64::from(donor_units) * self.tables[d].unit_bytes;
        let grow = donor_bytes / self.tables[r].unit_bytes;
        if grow == 0 {
            return Err(refuse(MigrationRefusal::BatchBelowRecipientUnit));
        }
        let Some(d_new) = self.tables[d].extent().checked_sub(donor_units) else {
            return Err(refuse(MigrationRefusal::DonorTooSmall));
        };
        if !self.tables[d].tail_is_free(d_new) {
            return Err(refuse(MigrationRefusal::DonorTailInUse));
        }
        let r_new = u64::from(self.tables[r].extent()) + grow;
        let r_limit = self.total_bytes / self.tables[r].unit_bytes;
        if r_new > r_limit {
            return Err(refuse(MigrationRefusal::RecipientOverBudget));
        }
        // Cannot truncate: r_new <= r_limit, which fits u32 (checked at construction).
        let r_new = r_new as u32;
        Ok(if recipient == PoolKind::Kv {
            (r_new, d_new)
        } else {
            (d_new, r_new)
        })
    }

    /// Applies the policy's trigger conditions (throttle, donor free threshold) and
    /// returns the batch size to migrate toward `recipient`.
    pub fn policy_allows(&self, recipient: PoolKind) -> Result<u32, AllocError> {
        let MigrationPolicy::Dynamic {
            batch_units,
            min_interval_ops,
            donor_free_threshold,
        } = self.policy
        else {
            return Err(AllocError::MigrationRefused {
                recipient,
                reason: MigrationRefusal::Unsupported,
            });
        };
        let policy_refused = AllocError::MigrationRefused {
            recipient,
            reason: MigrationRefusal::Policy,
        };
        if let Some(last) = self.last_migration_op {
            if self.stats.ops.saturating_sub(last) < min_interval_ops {
                return Err(policy_refused);
            }
        }
        if let Some(th) = donor_free_threshold {
            let d = &self.tables[recipient.other().index()];
            let frac = f64::from(d.free_units()) / f64::from(d.capacity().max(1));
            if frac <= th {
                return Err(policy_refused);
            }
        }
        Ok(batch_units)
    }
}

impl PoolAllocator for DualPool {
    fn name(&self) -> &str {
        &self.name
    }

    fn unit_bytes(&self, pool: PoolKind) -> u64 {
        self.tables[pool.index()].unit_bytes
    }

    fn capacity(&self, pool: PoolKind) -> u32 {
        self.tables[pool.index()].capacity()
    }

    fn free_units(&self, pool: PoolKind) -> u32 {
        self.tables[pool.index()].free_units()
    }

    fn extent(&self, pool: PoolKind) -> u32 {
        self.tables[pool.index()].extent()
    }

    fn retired_units(&self, pool: PoolKind) -> u64 {
        self.tables[pool.index()].retired_total()
    }

    fn allocate(
        &mut self,
        pool: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<(), AllocError> {
        self.stats.ops += 1;
        self.tables[pool.index()].alloc(self.layout, pool, n, out)
    }

    fn free(&mut self, handle: VirtualHandle) -> Result<(), AllocError> {
        self.stats.ops += 1;
        self.tables[handle.pool().index()]
            .free(self.layout, handle)
            .map(|_| ())
    }

    fn resolve(&self, handle: VirtualHandle) -> Result<Location, AllocError> {
        let t = &self.tables[handle.pool().index()];
        let idx = t.check_live(self.layout, handle)?;
        Ok(Location {
            table: t.kind,
            byte_offset: u64::from(idx) * t.unit_bytes,
            unit_bytes: t.unit_bytes,
        })
    }

    fn migrate_toward(&mut self, recipient: PoolKind) -> Result<Migration, AllocError> {
        let batch = self.policy_allows(recipient)?;
        self.migrate_units(recipient, batch)
    }

    fn migrate_units_toward(
        &mut self,
        recipient: PoolKind,
        donor_units: u32,
    ) -> Result<Migration, AllocError> {
        if self.policy == MigrationPolicy::Static {
            return Err(AllocError::MigrationRefused {
                recipient,
                reason: MigrationRefusal::Unsupported,
            });
        }
        self.migrate_units(recipient, donor_units)
    }

    fn stats(&self) -> AllocStats {
        self.stats
    }

    fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    fn migrates(&self) -> bool {
        self.policy != MigrationPolicy::Static
    }

    fn migration_step_bytes(&self) -> u64 {
        self.step_bytes
    }

    fn live_handle_at(&self, pool: PoolKind, index: u32) -> Option<VirtualHandle> {
        self.tables[pool.index()].live_at(self.layout, index)
    }

    fn unit_index(&self, handle: VirtualHandle) -> u32 {
        self.layout.index_of(handle)
    }
}

/// vLLM's padded unified layout: one table whose unit is the larger of the two
/// unit sizes (aligned), shared by KV pages and SSM blocks.
///
/// Handles carry the kind they were allocated as; both kinds resolve into the
/// one table (reported as [`PoolKind::Kv`]).
#[derive(Debug)]
pub struct PaddedUnified {
    layout: HandleLayout,
    _id: PoolId,
    table: UnitTable,
    logical: [u64; 2],
    stats: AllocStats,
}

impl PaddedUnified {
    /// One table of `floor(total / align_up(max(kv_unit, ssm_unit), 128))` units.
    pub fn new(total_bytes: u64, kv_unit: u64, ssm_unit: u64) -> Result<Self, AllocError> {
        if kv_unit == 0 || ssm_unit == 0 {
            return Err(AllocError::InvalidConfig("unit size 0".into()));
        }
        let unit = align_up(kv_unit.max(ssm_unit), UNIT_ALIGN);
        let n = units_in(total_bytes, unit)?;
        if n == 0 {
            return Err(AllocError::InvalidConfig(format!(
                "a {total_bytes} B budget holds no {unit} B unit"
            )));
        }
        let id = PoolId::acquire()?;
        let layout = HandleLayout::for_max_units(n, &id);
        Ok(PaddedUnified {
            layout,
            _id: id,
            table: UnitTable::new(PoolKind::Kv, unit, n, n),
            logical: [kv_unit, ssm_unit],
            stats: AllocStats::default(),
        })
    }

    /// Bytes of padding per unit of `pool` (unit − logical size).
    #[must_use]
    pub fn padding_bytes(&self, pool: PoolKind) -> u64 {
        self.table.unit_bytes - self.logical[pool.index()]
    }
}

impl PoolAllocator for PaddedUnified {
    fn name(&self) -> &str {
        "padded_unified"
    }

    fn unit_bytes(&self, _pool: PoolKind) -> u64 {
        self.table.unit_bytes
    }

    fn capacity(&self, _pool: PoolKind) -> u32 {
        self.table.capacity()
    }

    fn free_units(&self, _pool: PoolKind) -> u32 {
        self.table.free_units()
    }

    fn extent(&self, _pool: PoolKind) -> u32 {
        self.table.extent()
    }

    fn retired_units(&self, _pool: PoolKind) -> u64 {
        self.table.retired_total()
    }

    fn allocate(
        &mut self,
        pool: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<(), AllocError> {
        self.stats.ops += 1;
        self.table.alloc(self.layout, pool, n, out)
    }

    fn free(&mut self, handle: VirtualHandle) -> Result<(), AllocError> {
        self.stats.ops += 1;
        self.table.free(self.layout, handle).map(|_| ())
    }

    fn resolve(&self, handle: VirtualHandle) -> Result<Location, AllocError> {
        let idx = self.table.check_live(self.layout, handle)?;
        Ok(Location {
            table: PoolKind::Kv,
            byte_offset: u64::from(idx) * self.table.unit_bytes,
            unit_bytes: self.table.unit_bytes,
        })
    }

    fn stats(&self) -> AllocStats {
        self.stats
    }

    fn shares_capacity(&self) -> bool {
        true
    }

    fn live_handle_at(&self, _pool: PoolKind, index: u32) -> Option<VirtualHandle> {
        // One table for both kinds: the raw index names the unit whatever its tag.
        self.table.live_at(self.layout, index)
    }

    fn unit_index(&self, handle: VirtualHandle) -> u32 {
        self.layout.index_of(handle)
    }
}

/// A boxed allocator is an allocator (so a cache over pools can hold any
/// layout chosen at run time, `Box<dyn PoolAllocator + Send>`).
impl<P: PoolAllocator + ?Sized> PoolAllocator for Box<P> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn unit_bytes(&self, pool: PoolKind) -> u64 {
        (**self).unit_bytes(pool)
    }
    fn capacity(&self, pool: PoolKind) -> u32 {
        (**self).capacity(pool)
    }
    fn free_units(&self, pool: PoolKind) -> u32 {
        (**self).free_units(pool)
    }
    fn extent(&self, pool: PoolKind) -> u32 {
        (**self).extent(pool)
    }
    fn retired_units(&self, pool: PoolKind) -> u64 {
        (**self).retired_units(pool)
    }
    fn allocate(
        &mut self,
        pool: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<(), AllocError> {
        (**self).allocate(pool, n, out)
    }
    fn free(&mut self, handle: VirtualHandle) -> Result<(), AllocError> {
        (**self).free(handle)
    }
    fn resolve(&self, handle: VirtualHandle) -> Result<Location, AllocError> {
        (**self).resolve(handle)
    }
    fn migrate_toward(&mut self, recipient: PoolKind) -> Result<Migration, AllocError> {
        (**self).migrate_toward(recipient)
    }
    fn migrate_units_toward(
        &mut self,
        recipient: PoolKind,
        donor_units: u32,
    ) -> Result<Migration, AllocError> {
        (**self).migrate_units_toward(recipient, donor_units)
    }
    fn stats(&self) -> AllocStats {
        (**self).stats()
    }
    fn total_bytes(&self) -> u64 {
        (**self).total_bytes()
    }
    fn shares_capacity(&self) -> bool {
        (**self).shares_capacity()
    }
    fn migrates(&self) -> bool {
        (**self).migrates()
    }
    fn migration_step_bytes(&self) -> u64 {
        (**self).migration_step_bytes()
    }
    fn live_handle_at(&self, pool: PoolKind, index: u32) -> Option<VirtualHandle> {
        (**self).live_handle_at(pool, index)
    }
    fn unit_index(&self, handle: VirtualHandle) -> u32 {
        (**self).unit_index(handle)
    }
}
