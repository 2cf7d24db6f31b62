//! Host backend of the snapshot operations: slots over byte planes, copied with a
//! parallel memcpy.

use std::marker::PhantomData;
use std::ptr::NonNull;

use super::{CopyBatch, SnapshotBackend, SnapshotError};

/// Below this many bytes in a batch, copies run on the calling thread: spawning
/// threads costs tens of microseconds, which is what copying ~1 MiB costs.
const DEFAULT_MIN_PARALLEL_BYTES: usize = 2 << 20;

/// Upper bound on the default thread count; memcpy saturates memory bandwidth
/// with a handful of cores.
const DEFAULT_MAX_THREADS: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Plane {
    base: NonNull<u8>,
    slot_bytes: usize,
}

/// Recurrent-state slots over one or more byte *planes* of host memory.
///
/// Slot `s` of plane `p` is the `slot_bytes(p)` bytes at `base(p) + s *
/// slot_bytes(p)`; a slot's state is its bytes in every plane. One plane holds
/// all layers' states side by side; a layer-major tensor `[layers][slots][state]`
/// is one plane per layer ([`StateArena::layer_major`]); conv and SSM tensors are
/// separate planes ([`StateArena::from_planes`]). A copy order moves a slot's
/// bytes in every plane.
///
/// The arena borrows its memory mutably for `'a` (or, built from raw parts, the
/// caller vouches for it), so nothing else reads or writes it meanwhile.
#[derive(Debug)]
pub struct StateArena<'a> {
    planes: Vec<Plane>,
    slots: u32,
    threads: usize,
    min_parallel_bytes: usize,
    _mem: PhantomData<&'a mut [u8]>,
}

// SAFETY: the arena is an exclusive borrow of its planes (`&'a mut [u8]` is Send),
// and the raw constructor's contract gives the same exclusivity.
unsafe impl Send for StateArena<'_> {}
// SAFETY: shared access only reads (`&[u8]` views); writes need `&mut self`.
unsafe impl Sync for StateArena<'_> {}

impl<'a> StateArena<'a> {
    /// One plane: `mem` holds `slots` slots of `mem.len() / slots` bytes each.
    ///
    /// # Errors
    /// [`SnapshotError::InvalidLayout`] when `slots` is zero, the slot size would
    /// be zero, or `mem.len()` is not a multiple of `slots`.
    pub fn new(mem: &'a mut [u8], slots: u32) -> Result<Self, SnapshotError> {
        Self::from_planes(vec![mem], slots)
    }

    /// A layer-major tensor `[layers][slots][state]`: one plane per layer, so a
    /// copy order moves the slot's state in every layer.
    ///
    /// # Errors
    /// [`SnapshotError::InvalidLayout`] when `layers` or `slots` is zero or
    /// `mem.len()` is not a multiple of `layers * slots`.
    pub fn layer_major(mem: &'a mut [u8], layers: u32, slots: u32) -> Result<Self, SnapshotError> {
        let layers_n = layers as usize;
        if layers == 0 || mem.len() % layers_n != 0 {
            return Err(SnapshotError::InvalidLayout(format!(
                "{} bytes do not split into {layers} layers",
                mem.len()
            )));
        }
        let per_layer = mem.len() / layers_n;
        Self::from_planes(mem.chunks_exact_mut(per_layer).collect(), slots)
    }

    /// Several planes (one per layer, conv and SSM tensors, ...), each holding
    /// `slots` slots of `plane.len() / slots` bytes.
    ///
    /// # Errors
    /// [`SnapshotError::InvalidLayout`] when there is no plane, `slots` is zero,
    /// or a plane is empty or not a multiple of `slots` bytes.
    pub fn from_planes(planes: Vec<&'a mut [u8]>, slots: u32) -> Result<Self, SnapshotError> {
        let per = slots.max(1) as usize;
        if let Some(i) = planes.iter().position(|p| p.len() % per != 0) {
            return Err(SnapshotError::InvalidLayout(format!(
                "plane {i}: {} bytes is not a multiple of {slots} slots",
                planes[i].len()
            )));
        }
        let raw: Vec<(*mut u8, usize)> = planes
            .into_iter()
            .map(|p| (p.as_mut_ptr(), p.len() / per))
            .collect();
        // SAFETY: each pointer comes from a distinct `&'a mut [u8]` (so planes are
        // valid, exclusive and disjoint for 'a); slot sizes are len / slots, so
        // `slots * slot_bytes <= len`.
        let arena = unsafe { Self::from_raw_parts(&raw, slots) }?;
        Ok(arena)
    }

    /// Builds an arena over raw planes: `(base, slot_bytes)` each, `slots` slots
    /// per plane. Use it over a mapping (a memfd-backed pool, for instance).
    ///
    /// # Errors
    /// [`SnapshotError::InvalidLayout`] when there is no plane, `slots` or a
    /// slot size is zero, a base is null, a plane's size overflows, or two planes
    /// overlap.
    ///
    /// # Safety
    /// For `'a`, each `base` must be valid for reads and writes of `slots *
    /// slot_bytes` bytes, and nothing else may access those bytes while the arena
    /// lives (the arena writes them from several threads).
    pub unsafe fn from_raw_parts(
        planes: &[(*mut u8, usize)],
        slots: u32,
    ) -> Result<Self, SnapshotError> {
        if planes.is_empty() || slots == 0 {
            return Err(SnapshotError::InvalidLayout(format!(
                "{} planes of {slots} slots: need at least one of each",
                planes.len()
            )));
        }
        let mut checked = Vec::with_capacity(planes.len());
        let mut ranges = Vec::with_capacity(planes.len());
        for (i, &(base, slot_bytes)) in planes.iter().enumerate() {
            let base = NonNull::new(base)
                .ok_or_else(|| SnapshotError::InvalidLayout(format!("plane {i}: null base")))?;
            let len = slot_bytes
                .checked_mul(slots as usize)
                .filter(|&len| len > 0 && len <= isize::MAX as usize)
                .ok_or_else(|| {
                    SnapshotError::InvalidLayout(format!(
                        "plane {i}: {slots} slots of {slot_bytes} bytes"
                    ))
                })?;
            ranges.push((base.as_ptr() as usize, len, i));
            checked.push(Plane { base, slot_bytes });
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(SnapshotError::InvalidLayout(format!(
                    "planes {} and {} overlap",
                    w[0].2, w[1].2
                )));
            }
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(DEFAULT_MAX_THREADS);
        Ok(Self {
            planes: checked,
            slots,
            threads,
            min_parallel_bytes: DEFAULT_MIN_PARALLEL_BYTES,
            _mem: PhantomData,
        })
    }

    /// Sets how many threads a large batch is split over (at least 1) and the
    /// batch size in bytes from which it is split at all.
    pub fn set_parallelism(&mut self, threads: usize, min_parallel_bytes: usize) {
        self.threads = threads.max(1);
        self.min_parallel_bytes = min_parallel_bytes;
    }

    /// Number of planes.
    pub fn planes(&self) -> usize {
        self.planes.len()
    }

    /// Bytes of one slot in plane `plane`.
    ///
    /// # Panics
    /// If `plane >= self.planes()`.
    pub fn plane_slot_bytes(&self, plane: usize) -> usize {
        self.planes[plane].slot_bytes
    }

    /// The bytes of `slot` in `plane`, or `None` when either is out of range.
    pub fn slot(&self, plane: usize, slot: u32) -> Option<&[u8]> {
        let (ptr, len) = self.slot_ptr(plane, slot)?;
        // SAFETY: in range (checked by slot_ptr), inside a plane the arena holds
        // exclusively; `&self` means no `&mut` view exists meanwhile.
        Some(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// The bytes of `slot` in `plane`, writable, or `None` when either is out of
    /// range.
    pub fn slot_mut(&mut self, plane: usize, slot: u32) -> Option<&mut [u8]> {
        let (ptr, len) = self.slot_ptr(plane, slot)?;
        // SAFETY: as in `slot`, and `&mut self` makes this view the only one.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    /// A slot's whole state, plane after plane, or `None` when out of range.
    pub fn read_state(&self, slot: u32) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(self.slot_bytes());
        for plane in 0..self.planes.len() {
            out.extend_from_slice(self.slot(plane, slot)?);
        }
        Some(out)
    }

    /// Writes a slot's whole state, plane after plane (the layout of
    /// [`StateArena::read_state`]).
    ///
    /// # Errors
    /// [`SnapshotError::SlotOutOfRange`] for a bad slot,
    /// [`SnapshotError::InvalidLayout`] when `state` is not `slot_bytes()` long.
    pub fn write_state(&mut self, slot: u32, state: &[u8]) -> Result<(), SnapshotError> {
        if slot >= self.slots {
            return Err(SnapshotError::SlotOutOfRange {
                index: 0,
                slot,
                slots: self.slots,
            });
        }
        if state.len() != self.slot_bytes() {
            return Err(SnapshotError::InvalidLayout(format!(
                "state of {} bytes for slots of {} bytes",
                state.len(),
                self.slot_bytes()
            )));
        }
        let mut rest = state;
        for plane in 0..self.planes.len() {
            let dst = self.slot_mut(plane, slot).expect("slot checked above");
            let (head, tail) = rest.split_at(dst.len());
            dst.copy_from_slice(head);
            rest = tail;
        }
        Ok(())
    }

    fn slot_ptr(&self, plane: usize, slot: u32) -> Option<(*mut u8, usize)> {
        let p = self.planes.get(plane)?;
        if slot >= self.slots {
            return None;
        }
        // SAFETY: slot < slots, so the offset stays inside the plane's
        // `slots * slot_bytes` bytes (checked not to overflow at construction).
        let ptr = unsafe { p.base.as_ptr().add(slot as usize * p.slot_bytes) };
        Some((ptr, p.slot_bytes))
    }
}

/// One contiguous memcpy of a batch.
#[derive(Clone, Copy)]
struct Job {
    src: *const u8,
    dst: *mut u8,
    len: usize,
}

/// The jobs of one validated batch, shared by the copying threads.
struct Jobs(Vec<Job>);

// SAFETY: the jobs of a validated batch read slots nobody writes and write
// pairwise-disjoint slots, each exactly once (CopyBatch's invariant, planes
// disjoint by construction), so sharing them across threads races on nothing.
unsafe impl Sync for Jobs {}

impl Jobs {
    /// Copies the bytes `[lo, hi)` of the concatenation of all jobs; `starts`
    /// holds each job's offset in that concatenation.
    fn run_range(&self, starts: &[usize], lo: usize, hi: usize) {
        let mut i = starts.partition_point(|&s| s <= lo).saturating_sub(1);
        let mut at = lo;
        while at < hi && i < self.0.len() {
            let job = self.0[i];
            let off = at - starts[i];
            let n = (job.len - off).min(hi - at);
            // SAFETY: off + n <= job.len, so both ranges lie inside their slots;
            // src and dst are distinct slots (or planes), hence do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(job.src.add(off), job.dst.add(off), n) };
            at += n;
            i += 1;
        }
    }
}

impl SnapshotBackend for StateArena<'_> {
    type Error = SnapshotError;

    fn slots(&self) -> u32 {
        self.slots
    }

    fn slot_bytes(&self) -> usize {
        self.planes.iter().map(|p| p.slot_bytes).sum()
    }

    /// Copies every pair of `batch` in every plane. Batches of at least the
    /// parallel threshold are split by bytes over the configured threads; the
    /// copies are complete when this returns.
    fn copy(&mut self, batch: &CopyBatch) -> Result<(), SnapshotError> {
        if batch.slots() > self.slots {
            return Err(SnapshotError::ArenaMismatch {
                batch_slots: batch.slots(),
                arena_slots: self.slots,
            });
        }
        let mut jobs = Vec::with_capacity(batch.len() * self.planes.len());
        for pair in batch.pairs() {
            for plane in 0..self.planes.len() {
                let (src, len) = self.slot_ptr(plane, pair.src).expect("validated slot");
                let (dst, _) = self.slot_ptr(plane, pair.dst).expect("validated slot");
                jobs.push(Job { src, dst, len });
            }
        }
        let mut starts = Vec::with_capacity(jobs.len());
        let mut total = 0usize;
        for job in &jobs {
            starts.push(total);
            total += job.len;
        }
        let jobs = Jobs(jobs);
        let threads = if total >= self.min_parallel_bytes {
            self.threads
        } else {
            1
        };
        if threads <= 1 {
            jobs.run_range(&starts, 0, total);
            return Ok(());
        }
        // Shares are cut on 4 KiB boundaries so no two threads write one page.
        let share = total.div_ceil(threads).next_multiple_of(4096);
        std::thread::scope(|scope| {
            let (jobs, starts) = (&jobs, &starts);
            for t in 1..threads {
                let (lo, hi) = ((t * share).min(total), ((t + 1) * share).min(total));
                if lo < hi {
                    scope.spawn(move || jobs.run_range(starts, lo, hi));
                }
            }
            jobs.run_range(starts, 0, share.min(total));
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::SlotPair;

    #[test]
    fn parallel_split_covers_every_byte_once() {
        // Odd sizes so thread shares cut jobs in the middle.
        let slots = 7u32;
        let mut mem: Vec<u8> = (0..slots as usize * 10_007)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let expect = {
            let mut m = mem.clone();
            let (a, b) = m.split_at_mut(10_007 * 3);
            b[..10_007].copy_from_slice(&a[..10_007]);
            m
        };
        let mut arena = StateArena::new(&mut mem, slots).unwrap();
        arena.set_parallelism(3, 0);
        arena
            .copy(&CopyBatch::new(vec![SlotPair::new(0, 3)], slots).unwrap())
            .unwrap();
        drop(arena);
        assert_eq!(mem, expect);
    }
}
