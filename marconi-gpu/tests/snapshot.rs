//! Host snapshot operations: byte-exact results against a reference model that
//! applies the copies one by one, and refusals that leave memory untouched.

use marconi_gpu::snapshot::{
    plan_promotion, CopyBatch, PromoteMode, Promotion, SlotPair, SnapshotBackend, SnapshotError,
    StateArena,
};
use proptest::prelude::*;

/// A distinct byte for every (plane, slot, offset), so any misplaced byte shows.
fn pattern(plane: usize, slot: u32, off: usize) -> u8 {
    (plane as u32 * 131 + slot * 31 + off as u32 * 7 + (off as u32 >> 8)) as u8
}

/// Planes of `slots` slots with the given per-plane slot sizes, filled with the pattern.
fn planes(sizes: &[usize], slots: u32) -> Vec<Vec<u8>> {
    sizes
        .iter()
        .enumerate()
        .map(|(p, &size)| {
            (0..slots as usize * size)
                .map(|i| pattern(p, (i / size) as u32, i % size))
                .collect()
        })
        .collect()
}

/// Reference: apply the pairs one at a time on copies of the planes.
fn reference(mut mem: Vec<Vec<u8>>, sizes: &[usize], pairs: &[SlotPair]) -> Vec<Vec<u8>> {
    for pair in pairs {
        for (plane, &size) in mem.iter_mut().zip(sizes) {
            let (s, d) = (pair.src as usize * size, pair.dst as usize * size);
            plane.copy_within(s..s + size, d);
        }
    }
    mem
}

/// Runs `op` on an arena over fresh planes and checks every byte against the
/// reference, or checks that it was refused with `Err(expect)` and nothing moved.
fn check(
    sizes: &[usize],
    slots: u32,
    threads: usize,
    op: impl FnOnce(&mut StateArena<'_>) -> Result<Vec<SlotPair>, SnapshotError>,
    expect: Result<(), SnapshotError>,
) {
    let mut mem = planes(sizes, slots);
    let before = mem.clone();
    let result = {
        let mut arena =
            StateArena::from_planes(mem.iter_mut().map(Vec::as_mut_slice).collect(), slots)
                .unwrap();
        arena.set_parallelism(threads, 0);
        op(&mut arena)
    };
    match (result, expect) {
        (Ok(pairs), Ok(())) => {
            let want = reference(before, sizes, &pairs);
            for (p, (got, want)) in mem.iter().zip(&want).enumerate() {
                if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                    panic!(
                        "plane {p}: first wrong byte at {i} (slot {}), pairs {pairs:?}",
                        i / sizes[p]
                    );
                }
            }
        }
        (Err(got), Err(want)) => {
            assert_eq!(got, want);
            assert!(mem == before, "a refused operation changed memory");
        }
        (got, want) => panic!("got {got:?}, expected {want:?}"),
    }
}

fn copy(
    list: &[(u32, u32)],
) -> impl FnOnce(&mut StateArena<'_>) -> Result<Vec<SlotPair>, SnapshotError> {
    let pairs: Vec<SlotPair> = list.iter().map(|&(s, d)| SlotPair::new(s, d)).collect();
    move |arena| {
        let batch = CopyBatch::new(pairs.clone(), arena.slots())?;
        arena.copy(&batch)?;
        Ok(pairs)
    }
}

#[test]
fn copies_are_byte_exact_on_every_layout() {
    // One plane, all layers in the slot.
    check(&[4096], 8, 1, copy(&[(0, 5), (1, 6), (2, 7)]), Ok(()));
    // Conv and SSM planes of different sizes, odd sizes included.
    check(&[96, 4099], 6, 1, copy(&[(5, 0), (5, 1), (2, 3)]), Ok(()));
    // Many small planes (per-layer), across threads with shares cutting jobs.
    check(&[48; 12], 5, 3, copy(&[(0, 1), (0, 2), (4, 3)]), Ok(()));
    // Large slots split across threads.
    check(
        &[(1 << 20) + 17, 333],
        4,
        4,
        copy(&[(0, 3), (1, 2)]),
        Ok(()),
    );
    // An empty batch copies nothing.
    check(&[64], 2, 2, copy(&[]), Ok(()));
}

#[test]
fn bad_slot_lists_are_refused_before_any_copy() {
    let sizes = &[128, 40];
    check(
        sizes,
        4,
        2,
        copy(&[(0, 1), (0, 4)]),
        Err(SnapshotError::SlotOutOfRange {
            index: 1,
            slot: 4,
            slots: 4,
        }),
    );
    check(
        sizes,
        4,
        2,
        copy(&[(0, 1), (2, 2)]),
        Err(SnapshotError::SelfCopy { index: 1, slot: 2 }),
    );
    check(
        sizes,
        4,
        2,
        copy(&[(0, 1), (2, 1)]),
        Err(SnapshotError::DuplicateDestination {
            slot: 1,
            first: 0,
            second: 1,
        }),
    );
    check(
        sizes,
        4,
        2,
        copy(&[(0, 1), (1, 3)]),
        Err(SnapshotError::DestinationIsSource {
            slot: 1,
            dst_index: 0,
            src_index: 1,
        }),
    );
    // A swap expressed as two copies overlaps too.
    check(
        sizes,
        4,
        2,
        copy(&[(0, 1), (1, 0)]),
        Err(SnapshotError::DestinationIsSource {
            slot: 0,
            dst_index: 1,
            src_index: 0,
        }),
    );
}

#[test]
fn batch_validated_for_a_larger_arena_is_refused() {
    let batch = CopyBatch::new(vec![SlotPair::new(0, 7)], 8).unwrap();
    check(
        &[64],
        4,
        1,
        move |a| a.copy(&batch).map(|()| Vec::new()),
        Err(SnapshotError::ArenaMismatch {
            batch_slots: 8,
            arena_slots: 4,
        }),
    );
}

#[test]
fn fork_copies_one_state_into_every_candidate() {
    check(
        &[1000, 24],
        6,
        2,
        |a| {
            a.fork(2, &[0, 1, 5]).map(|()| {
                vec![(2, 0), (2, 1), (2, 5)]
                    .into_iter()
                    .map(|(s, d)| SlotPair::new(s, d))
                    .collect()
            })
        },
        Ok(()),
    );
    check(
        &[64],
        6,
        1,
        |a| a.fork(2, &[0, 2]).map(|()| Vec::new()),
        Err(SnapshotError::SelfCopy { index: 1, slot: 2 }),
    );
    check(
        &[64],
        6,
        1,
        |a| a.fork(2, &[0, 1, 0]).map(|()| Vec::new()),
        Err(SnapshotError::DuplicateDestination {
            slot: 0,
            first: 0,
            second: 2,
        }),
    );
}

#[test]
fn promote_swaps_handles_or_copies_into_the_request_slot() {
    // Swap: no byte moves, the candidate's slot becomes the state slot.
    check(
        &[256, 32],
        5,
        1,
        |a| {
            let p = a.promote(0, &[2, 3, 4], 1, PromoteMode::Swap)?;
            assert_eq!(
                p,
                Promotion {
                    state_slot: 3,
                    released: vec![0, 2, 4],
                    copied: None
                }
            );
            Ok(Vec::new())
        },
        Ok(()),
    );
    // CopyInto: the accepted state lands in the request's slot.
    check(
        &[256, 32],
        5,
        1,
        |a| {
            let p = a.promote(0, &[2, 3, 4], 2, PromoteMode::CopyInto)?;
            assert_eq!(
                p,
                Promotion {
                    state_slot: 0,
                    released: vec![2, 3, 4],
                    copied: Some(SlotPair::new(4, 0))
                }
            );
            Ok(vec![SlotPair::new(4, 0)])
        },
        Ok(()),
    );
    check(
        &[64],
        5,
        1,
        |a| {
            a.promote(0, &[2, 3], 2, PromoteMode::CopyInto)
                .map(|_| Vec::new())
        },
        Err(SnapshotError::AcceptedOutOfRange {
            accepted: 2,
            candidates: 2,
        }),
    );
    check(
        &[64],
        5,
        1,
        |a| {
            a.promote(3, &[2, 3], 0, PromoteMode::CopyInto)
                .map(|_| Vec::new())
        },
        Err(SnapshotError::DuplicateSlot { slot: 3 }),
    );
}

#[test]
fn speculative_round_trip() {
    // Cache hit: copy the cached state into the request slot (copy-on-write),
    // fork it into candidates, the candidates diverge, promote the accepted one.
    let (slots, size) = (8u32, 512usize);
    let mut mem = planes(&[size], slots).remove(0);
    let mut arena = StateArena::new(&mut mem, slots).unwrap();
    let cached = arena.read_state(7).unwrap();
    arena
        .copy(&CopyBatch::new(vec![SlotPair::new(7, 0)], slots).unwrap())
        .unwrap();
    assert_eq!(arena.read_state(0).unwrap(), cached);
    arena.fork(0, &[1, 2, 3]).unwrap();
    for c in 1..=3u32 {
        assert_eq!(arena.read_state(c).unwrap(), cached);
        let mut diverged = cached.clone();
        diverged[c as usize] ^= 0xff;
        arena.write_state(c, &diverged).unwrap();
    }
    let accepted = arena.read_state(2).unwrap();
    let p = arena
        .promote(0, &[1, 2, 3], 1, PromoteMode::CopyInto)
        .unwrap();
    assert_eq!(p.state_slot, 0);
    assert_eq!(arena.read_state(0).unwrap(), accepted);
    // The cached snapshot itself was never written.
    assert_eq!(arena.read_state(7).unwrap(), cached);
}

#[test]
fn layouts_are_checked() {
    let mut mem = vec![0u8; 100];
    assert!(matches!(
        StateArena::new(&mut mem, 0),
        Err(SnapshotError::InvalidLayout(_))
    ));
    assert!(matches!(
        StateArena::new(&mut mem, 3),
        Err(SnapshotError::InvalidLayout(_))
    ));
    assert!(matches!(
        StateArena::layer_major(&mut mem, 3, 2),
        Err(SnapshotError::InvalidLayout(_))
    ));
    let a = StateArena::layer_major(&mut mem, 5, 4).unwrap();
    assert_eq!(
        (a.planes(), a.slots(), a.slot_bytes(), a.plane_slot_bytes(0)),
        (5, 4, 25, 5)
    );
    let mut empty: Vec<u8> = Vec::new();
    assert!(matches!(
        StateArena::new(&mut empty, 1),
        Err(SnapshotError::InvalidLayout(_))
    ));
    // Raw planes that overlap are refused.
    let mut buf = vec![0u8; 64];
    let base = buf.as_mut_ptr();
    // SAFETY: both planes lie inside `buf`, which outlives the (refused) arena.
    let overlapping =
        unsafe { StateArena::from_raw_parts(&[(base, 8), (base.wrapping_add(16), 8)], 4) };
    assert!(matches!(overlapping, Err(SnapshotError::InvalidLayout(m)) if m.contains("overlap")));
    // SAFETY: as above; these two halves do not overlap.
    let halves = unsafe { StateArena::from_raw_parts(&[(base, 8), (base.wrapping_add(32), 8)], 4) };
    assert!(halves.is_ok());
}

#[test]
fn layer_major_copy_moves_the_slot_in_every_layer() {
    let (layers, slots, state) = (3u32, 4u32, 40usize);
    let mut mem: Vec<u8> = (0..(layers * slots) as usize * state)
        .map(|i| (i % 253) as u8)
        .collect();
    let before = mem.clone();
    let mut arena = StateArena::layer_major(&mut mem, layers, slots).unwrap();
    arena
        .copy(&CopyBatch::new(vec![SlotPair::new(1, 3)], slots).unwrap())
        .unwrap();
    drop(arena);
    for l in 0..layers as usize {
        let at = |s: usize| (l * slots as usize + s) * state;
        assert_eq!(
            mem[at(3)..at(3) + state],
            before[at(1)..at(1) + state],
            "layer {l}"
        );
        assert_eq!(
            mem[at(0)..at(3)],
            before[at(0)..at(3)],
            "layer {l}: other slots untouched"
        );
    }
}

fn reference_validate(pairs: &[SlotPair], slots: u32) -> bool {
    pairs
        .iter()
        .all(|p| p.src < slots && p.dst < slots && p.src != p.dst)
        && pairs
            .iter()
            .enumerate()
            .all(|(i, p)| pairs[..i].iter().all(|q| q.dst != p.dst))
        && pairs.iter().all(|p| pairs.iter().all(|q| q.dst != p.src))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Any pair list: accepted exactly when the brute-force rules accept it, and
    /// then byte-exact against one-at-a-time copies, whatever the thread count.
    #[test]
    fn random_batches_match_the_reference(
        slots in 1u32..12,
        sizes in prop::collection::vec(1usize..300, 1..4),
        raw in prop::collection::vec((0u32..13, 0u32..13), 0..10),
        threads in 1usize..4,
    ) {
        let pairs: Vec<SlotPair> = raw.iter().map(|&(s, d)| SlotPair::new(s, d)).collect();
        let valid = reference_validate(&pairs, slots);
        prop_assert_eq!(CopyBatch::new(pairs.clone(), slots).is_ok(), valid);
        if valid {
            check(&sizes, slots, threads, copy(&raw), Ok(()));
        }
    }

    /// Promotion plans never leak or double-release a slot: the state slot plus
    /// the released slots are exactly the request's slot and its candidates.
    #[test]
    fn promotion_accounts_for_every_slot(k in 1usize..6, accepted in 0usize..6, swap in any::<bool>()) {
        let candidates: Vec<u32> = (1..=k as u32).collect();
        let mode = if swap { PromoteMode::Swap } else { PromoteMode::CopyInto };
        match plan_promotion(0, &candidates, accepted, mode, 8) {
            Ok((p, _)) => {
                let mut all = p.released.clone();
                all.push(p.state_slot);
                all.sort_unstable();
                prop_assert_eq!(all, (0..=k as u32).collect::<Vec<_>>());
            }
            Err(e) => prop_assert_eq!(e, SnapshotError::AcceptedOutOfRange { accepted, candidates: k }),
        }
    }
}

/// A shared memfd mapped twice, as a memfd-backed pool is: the arena works over
/// one view, and the other view (same physical pages) sees exactly its copies.
#[test]
fn arena_over_a_shared_memfd_mapping() {
    let (slots, slot_bytes) = (6u32, 64 << 10);
    let len = slots as usize * slot_bytes;
    // SAFETY: plain syscalls; every result is checked before use.
    let fd = unsafe { libc::memfd_create(c"marconi-snapshot-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh memfd owned by this test.
    assert_eq!(unsafe { libc::ftruncate(fd, len as libc::off_t) }, 0);
    let map = || {
        // SAFETY: maps `len` bytes of our memfd, shared; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        p.cast::<u8>()
    };
    let (work, view) = (map(), map());
    {
        // SAFETY: `work` maps `len` bytes, read-write, until the munmap below, and
        // only the arena writes them meanwhile (the test reads `view` afterwards).
        let mut arena =
            unsafe { StateArena::from_raw_parts(&[(work, slot_bytes)], slots) }.unwrap();
        arena.set_parallelism(2, 0);
        let state: Vec<u8> = (0..slot_bytes).map(|i| (i * 13 % 256) as u8).collect();
        arena.write_state(1, &state).unwrap();
        arena.fork(1, &[0, 4, 5]).unwrap();
        // SAFETY: `view` maps the same `len` bytes; no writer runs while we read.
        let seen = unsafe { std::slice::from_raw_parts(view, len) };
        for slot in [0usize, 1, 4, 5] {
            assert!(
                seen[slot * slot_bytes..(slot + 1) * slot_bytes] == state[..],
                "slot {slot}"
            );
        }
        assert!(
            seen[2 * slot_bytes..4 * slot_bytes].iter().all(|&b| b == 0),
            "untouched slots stay zero"
        );
    }
    // SAFETY: both mappings and the fd were made above and are released once.
    unsafe {
        assert_eq!(libc::munmap(work.cast(), len), 0);
        assert_eq!(libc::munmap(view.cast(), len), 0);
        libc::close(fd);
    }
}
