//! Memory planning: from a [`ModelSpec`] and a device memory budget, the
//! numbers an engine needs at start-up. Pure arithmetic on the layouts of
//! [`crate::pooled`] (the same unit sizes and the same split arithmetic as
//! [`crate::DualPool`]), plus [`converged_split`], which replays requests
//! through an AVMP [`crate::pooled::PooledCache`] to find where capacity
//! migration takes the split.
//!
//! A running sequence of `context` tokens holds `ceil(context / page_size)`
//! KV pages and one state slot (its recurrent state). So a batch of `B`
//! such sequences fits:
//!
//! - a static split iff `B · pages ≤ kv_pages` and `B ≤ state_slots`;
//! - AVMP (capacity follows demand) iff `B · (pages · page_bytes +
//!   slot_bytes) ≤ budget` (ignoring the rounding of migrations to chunks);
//! - a padded unified table iff `B · (pages + 1) ≤ units`, each unit as
//!   large as the larger of a page and a slot.

use marconi_core::ModelSpec;
use serde::Serialize;

use crate::alloc::{align_up, UNIT_ALIGN};
use crate::error::AllocError;
use crate::pooled::{unit_sizes, PoolLayout, PooledCache, PooledStats};
use crate::PoolAllocator;
use crate::PoolKind;

/// The pools of one static split (plain data, for the C ABI as well).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SplitPlan {
    /// Fraction of the budget given to state slots.
    pub ssm_fraction: f64,
    /// KV pages.
    pub kv_pages: u64,
    /// KV tokens (`kv_pages · page_size`).
    pub kv_tokens: u64,
    /// State slots.
    pub state_slots: u64,
}

/// The start-up numbers for one model, page size and budget (plain data).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// The device budget for both pools, bytes.
    pub budget_bytes: u64,
    /// Tokens per KV page.
    pub page_size: u32,
    /// KV bytes per token (all attention layers).
    pub kv_bytes_per_token: u64,
    /// Bytes of one KV page (128-aligned).
    pub kv_page_bytes: u64,
    /// Bytes of one state slot: one checkpoint of every recurrent layer
    /// (128-aligned).
    pub state_slot_bytes: u64,
    /// KV tokens if the whole budget held KV.
    pub max_kv_tokens: u64,
    /// State slots if the whole budget held states.
    pub max_state_slots: u64,
    /// Unit of the padded unified table (the larger unit).
    pub unified_unit_bytes: u64,
    /// Units of the padded unified table.
    pub unified_units: u64,
}

/// The start-up numbers; refused when the model has no recurrent layers,
/// the page size is 0 or the budget cannot hold one page and one slot.
pub fn plan(
    model: &ModelSpec,
    page_size: u32,
    budget_bytes: u64,
) -> Result<MemoryPlan, AllocError> {
    if page_size == 0 {
        return Err(AllocError::InvalidConfig("page_size is 0".into()));
    }
    model
        .validate()
        .map_err(|e| AllocError::InvalidConfig(format!("model: {e}")))?;
    // A page or a slot larger than the budget is refused before the unit
    // sizes are aligned (an alignment near 2^64 would wrap).
    let kv_per_token = match model.kv_bytes_per_token() {
        0 => marconi_core::TOKEN_ID_BYTES,
        b => b,
    };
    let page_bytes = kv_per_token.checked_mul(u64::from(page_size));
    if page_bytes.is_none_or(|b| b > budget_bytes) || model.state_bytes() > budget_bytes {
        return Err(AllocError::InvalidConfig(format!(
            "a budget of {budget_bytes} bytes holds less than one page of {page_size} tokens \
             ({kv_per_token} bytes a token) and one slot ({} bytes)",
            model.state_bytes()
        )));
    }
    let (kv_page_bytes, state_slot_bytes) = unit_sizes(model, page_size);
    if state_slot_bytes == 0 {
        return Err(AllocError::InvalidConfig(
            "the model has no recurrent layers: no state pool to plan".into(),
        ));
    }
    if budget_bytes < kv_page_bytes.saturating_add(state_slot_bytes) {
        return Err(AllocError::InvalidConfig(format!(
            "a budget of {budget_bytes} bytes holds less than one page ({kv_page_bytes}) and one slot ({state_slot_bytes})"
        )));
    }
    let unified_unit_bytes = align_up(kv_page_bytes.max(state_slot_bytes), UNIT_ALIGN);
    Ok(MemoryPlan {
        budget_bytes,
        page_size,
        kv_bytes_per_token: model.kv_bytes_per_token(),
        kv_page_bytes,
        state_slot_bytes,
        max_kv_tokens: budget_bytes / kv_page_bytes * u64::from(page_size),
        max_state_slots: budget_bytes / state_slot_bytes,
        unified_unit_bytes,
        unified_units: budget_bytes / unified_unit_bytes,
    })
}

impl MemoryPlan {
    /// The pools of a static split, with [`crate::DualPool`]'s arithmetic:
    /// `ssm_bytes = floor(budget · f)`, the rest for KV, each in whole units.
    pub fn split(&self, ssm_fraction: f64) -> Result<SplitPlan, AllocError> {
        if !(ssm_fraction > 0.0 && ssm_fraction < 1.0) {
            return Err(AllocError::InvalidConfig(format!(
                "ssm_fraction {ssm_fraction} not in (0, 1)"
            )));
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "as DualPool: floor of a positive product below 2^53"
        )]
        let ssm_bytes = (self.budget_bytes as f64 * ssm_fraction).floor() as u64;
        let kv_pages = (self.budget_bytes - ssm_bytes) / self.kv_page_bytes;
        Ok(SplitPlan {
            ssm_fraction,
            kv_pages,
            kv_tokens: kv_pages * u64::from(self.page_size),
            state_slots: ssm_bytes / self.state_slot_bytes,
        })
    }

    /// KV pages one running sequence of `context` tokens holds.
    #[must_use]
    pub fn pages_per_sequence(&self, context: u64) -> u64 {
        context.div_ceil(u64::from(self.page_size))
    }

    /// The state fraction a batch of `context`-token sequences uses when
    /// nothing else is cached: `slot / (pages · page + slot)`, in `(0, 1]`
    /// for every context (formed in floating point: a context whose KV
    /// exceeds 64 bits of bytes gives a fraction near 0, never a wrapped
    /// product).
    #[must_use]
    pub fn fraction_for_context(&self, context: u64) -> f64 {
        #[expect(clippy::cast_precision_loss, reason = "a ratio of byte counts")]
        let (kv, slot) = (
            self.pages_per_sequence(context) as f64 * self.kv_page_bytes as f64,
            self.state_slot_bytes as f64,
        );
        (slot / (kv + slot)).min(1.0)
    }

    /// Bytes one running sequence of `context` tokens holds (its pages and
    /// one state slot); `None` beyond 64 bits, where no batch fits.
    fn sequence_bytes(&self, context: u64) -> Option<u64> {
        self.pages_per_sequence(context)
            .checked_mul(self.kv_page_bytes)?
            .checked_add(self.state_slot_bytes)
    }

    /// The largest batch of `context`-token sequences that fits under
    /// `layout` (module documentation); 0 when not one sequence fits, also
    /// for contexts whose size exceeds 64 bits.
    pub fn max_batch(&self, context: u64, layout: PoolLayout) -> Result<u64, AllocError> {
        let pages = self.pages_per_sequence(context.max(1));
        Ok(match layout {
            PoolLayout::Static { ssm_fraction } => {
                let s = self.split(ssm_fraction)?;
                (s.kv_pages / pages).min(s.state_slots)
            }
            PoolLayout::Avmp { .. } => self
                .sequence_bytes(context.max(1))
                .map_or(0, |b| self.budget_bytes / b),
            PoolLayout::Unified => pages
                .checked_add(1)
                .map_or(0, |units| self.unified_units / units),
        })
    }

    /// The longest context a batch of `batch` sequences can each hold under
    /// `layout` (0 when not even one page each fits), in whole pages.
    pub fn max_context(&self, batch: u64, layout: PoolLayout) -> Result<u64, AllocError> {
        let batch = batch.max(1);
        let pages = match layout {
            PoolLayout::Static { ssm_fraction } => {
                let s = self.split(ssm_fraction)?;
                if s.state_slots < batch {
                    0
                } else {
                    s.kv_pages / batch
                }
            }
            PoolLayout::Avmp { .. } => {
                let per = self.budget_bytes / batch;
                per.saturating_sub(self.state_slot_bytes) / self.kv_page_bytes
            }
            PoolLayout::Unified => (self.unified_units / batch).saturating_sub(1),
        };
        Ok(pages.saturating_mul(u64::from(self.page_size)))
    }
}

/// Where AVMP took the split on a replay ([`converged_split`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ConvergedSplit {
    /// State fraction at start.
    pub start_fraction: f64,
    /// State fraction of the pools' bytes at the end (capacity · unit over
    /// the pools' total).
    pub final_fraction: f64,
    /// The state fraction averaged over the second half of the requests
    /// (after the cache filled, where the split settles).
    pub settled_fraction: f64,
    /// The joined system's counters.
    pub stats: PooledStats,
    /// Token hit rate of the replay.
    pub token_hit_rate: f64,
}

/// Replays `requests` (`(input_len, full sequence)`, served in order)
/// through a cache built from `cfg` over an AVMP pool of `budget_bytes`
/// starting at `start_fraction`, and reports the split capacity migration
/// reaches.
pub fn converged_split<'a>(
    cfg: &marconi_core::CacheConfig,
    budget_bytes: u64,
    start_fraction: f64,
    requests: impl ExactSizeIterator<Item = (usize, &'a [u32])>,
) -> Result<ConvergedSplit, crate::pooled::PooledError> {
    let pool = crate::pooled::dual_pool(
        &cfg.model,
        cfg.page_size,
        budget_bytes,
        PoolLayout::Avmp {
            ssm_fraction: start_fraction,
        },
    )?;
    let mut c = PooledCache::new(cfg.clone(), pool)?;
    let n = requests.len();
    let (mut sum, mut count) = (0.0, 0u64);
    for (i, (input_len, full)) in requests.enumerate() {
        c.serve(0, input_len, full)?;
        if i >= n / 2 {
            sum += ssm_fraction_of(c.pool());
            count += 1;
        }
    }
    #[expect(clippy::cast_precision_loss, reason = "a mean")]
    let settled_fraction = if count == 0 {
        ssm_fraction_of(c.pool())
    } else {
        sum / count as f64
    };
    Ok(ConvergedSplit {
        start_fraction,
        final_fraction: ssm_fraction_of(c.pool()),
        settled_fraction,
        stats: c.stats(),
        token_hit_rate: c.cache().stats().token_hit_rate(),
    })
}

/// The state pool's share of the pools' bytes.
#[must_use]
pub fn ssm_fraction_of(pool: &dyn PoolAllocator) -> f64 {
    let bytes = |p: PoolKind| u64::from(pool.capacity(p)) * pool.unit_bytes(p);
    let total = bytes(PoolKind::Kv) + bytes(PoolKind::Ssm);
    #[expect(clippy::cast_precision_loss, reason = "a ratio")]
    let f = if total == 0 {
        0.0
    } else {
        bytes(PoolKind::Ssm) as f64 / total as f64
    };
    f
}
