//! Allocator contracts: typed errors, all-or-nothing bulk allocation, generations,
//! migration semantics, and a property test against invariants.

use std::collections::HashSet;

use marconi_gpu::{
    AllocError, DualPool, DualPoolConfig, MigrationPolicy, MigrationRefusal, PaddedUnified,
    PoolAllocator, PoolKind, Pressure, VirtualHandle,
};
use proptest::prelude::*;

const KIB: u64 = 1024;

fn dual(total: u64, ratio: f64, policy: MigrationPolicy) -> DualPool {
    DualPool::new(
        "test",
        DualPoolConfig {
            total_bytes: total,
            ssm_ratio: ratio,
            kv_unit: 64 * KIB,
            ssm_unit: 256 * KIB,
            policy,
        },
    )
    .unwrap()
}

fn alloc(
    a: &mut dyn PoolAllocator,
    pool: PoolKind,
    n: u32,
) -> Result<Vec<VirtualHandle>, AllocError> {
    let mut v = Vec::new();
    a.allocate(pool, n, &mut v).map(|()| v)
}

#[test]
fn split_sizes_units_and_offsets() {
    // 8 MiB at 0.5: 4 MiB of 64 KiB pages (64), 4 MiB of 256 KiB blocks (16).
    let mut p = dual(8 << 20, 0.5, MigrationPolicy::Static);
    assert_eq!(
        (p.capacity(PoolKind::Kv), p.capacity(PoolKind::Ssm)),
        (64, 16)
    );
    let kv = alloc(&mut p, PoolKind::Kv, 3).unwrap();
    let ssm = alloc(&mut p, PoolKind::Ssm, 2).unwrap();
    // Lowest ids first, offsets = index · unit.
    let offs: Vec<u64> = kv
        .iter()
        .map(|&h| p.resolve(h).unwrap().byte_offset)
        .collect();
    assert_eq!(offs, [0, 64 * KIB, 128 * KIB]);
    let l = p.resolve(ssm[1]).unwrap();
    assert_eq!(
        (l.table, l.byte_offset, l.unit_bytes),
        (PoolKind::Ssm, 256 * KIB, 256 * KIB)
    );
    assert!(
        kv.iter().all(|h| h.pool() == PoolKind::Kv)
            && ssm.iter().all(|h| h.pool() == PoolKind::Ssm)
    );
}

#[test]
fn pressure_follows_free_fractions() {
    let mut p = dual(8 << 20, 0.5, MigrationPolicy::Static);
    assert_eq!(p.pressure(0.1), Pressure::Balanced);
    let _ssm = alloc(&mut p, PoolKind::Ssm, 15).unwrap();
    assert_eq!(p.pressure(0.1), Pressure::SsmPressured);
    let _kv = alloc(&mut p, PoolKind::Kv, 64).unwrap();
    assert_eq!(p.pressure(0.1), Pressure::KvPressured);
    assert_eq!(p.free_fraction(PoolKind::Ssm), 1.0 / 16.0);
}

#[test]
fn bulk_allocation_is_all_or_nothing() {
    let mut p = dual(8 << 20, 0.5, MigrationPolicy::Static);
    let _held = alloc(&mut p, PoolKind::Ssm, 10).unwrap();
    let mut out = vec![];
    let err = p.allocate(PoolKind::Ssm, 7, &mut out).unwrap_err();
    assert_eq!(
        err,
        AllocError::OutOfCapacity {
            pool: PoolKind::Ssm,
            requested: 7,
            free: 6,
            capacity: 16
        }
    );
    assert!(out.is_empty());
    assert_eq!(p.free_units(PoolKind::Ssm), 6);
    alloc(&mut p, PoolKind::Ssm, 6).unwrap();
}

#[test]
fn stale_double_free_and_wrong_pool_are_typed_errors() {
    let mut p = dual(8 << 20, 0.5, MigrationPolicy::Static);
    let h = alloc(&mut p, PoolKind::Kv, 1).unwrap()[0];
    p.free(h).unwrap();
    assert_eq!(p.free(h), Err(AllocError::DoubleFree(h.raw())));
    assert_eq!(p.resolve(h), Err(AllocError::DoubleFree(h.raw())));
    // The same unit is handed out again (LIFO) under a new generation.
    let h2 = alloc(&mut p, PoolKind::Kv, 1).unwrap()[0];
    assert_ne!(h, h2);
    assert_eq!(p.unit_index(h), p.unit_index(h2));
    assert_eq!(p.free(h), Err(AllocError::StaleHandle(h.raw())));
    assert!(
        p.resolve(h2).is_ok(),
        "a stale free must not touch the new owner"
    );
    assert!(matches!(
        p.free_in(PoolKind::Ssm, h2),
        Err(AllocError::WrongPool { .. })
    ));
    assert!(matches!(
        p.resolve_in(PoolKind::Ssm, h2),
        Err(AllocError::WrongPool { .. })
    ));
    assert!(matches!(
        p.free(VirtualHandle::from_raw(0)),
        Err(AllocError::ForeignHandle(0))
    ));
    p.free_in(PoolKind::Kv, h2).unwrap();
}

#[test]
fn migration_moves_the_donor_tail_only_when_free() {
    let mut p = dual(8 << 20, 0.5, MigrationPolicy::forced(4));
    // 4 SSM blocks = 1 MiB = 16 KV pages.
    let m = p.migrate_toward(PoolKind::Kv).unwrap();
    assert_eq!(
        (m.donor_units, m.recipient_units, m.donor_bytes),
        (4, 16, 1 << 20)
    );
    assert_eq!(
        (p.capacity(PoolKind::Kv), p.capacity(PoolKind::Ssm)),
        (80, 12)
    );
    // Occupy the SSM tail: the next migration is refused and nothing changes.
    let hs = alloc(&mut p, PoolKind::Ssm, 12).unwrap();
    assert_eq!(
        p.migrate_toward(PoolKind::Kv),
        Err(AllocError::MigrationRefused {
            recipient: PoolKind::Kv,
            reason: MigrationRefusal::DonorTailInUse
        })
    );
    assert_eq!(p.capacity(PoolKind::Kv), 80);
    // Free only the tail: allowed again.
    for &h in &hs[8..] {
        p.free(h).unwrap();
    }
    p.migrate_toward(PoolKind::Kv).unwrap();
    assert_eq!(p.stats().rebalance_count, 2);
    assert_eq!(p.stats().bytes_migrated, 2 << 20);
    // Bytes never exceed the budget.
    assert!(p.pool_bytes(PoolKind::Kv) + p.pool_bytes(PoolKind::Ssm) <= p.total_bytes());
}

#[test]
fn allocate_or_migrate_and_static_layouts() {
    let mut s = dual(8 << 20, 0.5, MigrationPolicy::Static);
    let mut out = vec![];
    s.allocate(PoolKind::Kv, 64, &mut out).unwrap();
    assert!(matches!(
        s.allocate_or_migrate(PoolKind::Kv, 1, &mut out),
        Err(AllocError::OutOfCapacity { .. })
    ));
    let mut d = dual(8 << 20, 0.5, MigrationPolicy::forced(4));
    let mut out = vec![];
    d.allocate(PoolKind::Kv, 64, &mut out).unwrap();
    let m = d.allocate_or_migrate(PoolKind::Kv, 1, &mut out).unwrap();
    assert_eq!(m.map(|m| m.recipient), Some(PoolKind::Kv));
    assert_eq!(out.len(), 65);
    // A batch of all 64 KV pages gives SSM 16 blocks (32 in all = the whole
    // budget); then the donor is too small for another batch.
    let mut d = dual(8 << 20, 0.5, MigrationPolicy::forced(64));
    d.migrate_toward(PoolKind::Ssm).unwrap();
    assert_eq!(
        (d.capacity(PoolKind::Kv), d.capacity(PoolKind::Ssm)),
        (0, 32)
    );
    assert_eq!(
        d.migrate_toward(PoolKind::Ssm),
        Err(AllocError::MigrationRefused {
            recipient: PoolKind::Ssm,
            reason: MigrationRefusal::DonorTooSmall
        })
    );
    assert!(matches!(
        alloc(&mut d, PoolKind::Kv, 1),
        Err(AllocError::OutOfCapacity { capacity: 0, .. })
    ));
}

#[test]
fn padded_unified_pads_both_kinds_to_the_larger_unit() {
    let mut p = PaddedUnified::new(8 << 20, 64 * KIB, 256 * KIB).unwrap();
    assert_eq!(p.capacity(PoolKind::Kv), 32);
    assert_eq!(p.padding_bytes(PoolKind::Kv), 192 * KIB);
    let kv = alloc(&mut p, PoolKind::Kv, 2).unwrap();
    let ssm = alloc(&mut p, PoolKind::Ssm, 1).unwrap();
    assert_eq!(p.free_units(PoolKind::Ssm), 29);
    assert_eq!(p.resolve(ssm[0]).unwrap().byte_offset, 2 * 256 * KIB);
    assert_eq!(ssm[0].pool(), PoolKind::Ssm);
    p.free(kv[0]).unwrap();
    assert!(matches!(
        p.migrate_toward(PoolKind::Kv),
        Err(AllocError::MigrationRefused {
            reason: MigrationRefusal::Unsupported,
            ..
        })
    ));
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(bool, u32),
    Free(usize),
    FreeStale(usize),
    Migrate(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<bool>(), 1u32..20).prop_map(|(k, n)| Op::Alloc(k, n)),
        any::<usize>().prop_map(Op::Free),
        any::<usize>().prop_map(Op::FreeStale),
        any::<bool>().prop_map(Op::Migrate),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random sequences: live handles always resolve to distinct, in-capacity
    /// units; stale handles are always rejected; counts add up; bytes within budget.
    #[test]
    fn dual_pool_invariants(ops in proptest::collection::vec(op(), 1..300)) {
        let mut p = dual(8 << 20, 0.5, MigrationPolicy::forced(2));
        let mut live: Vec<VirtualHandle> = Vec::new();
        let mut dead: Vec<VirtualHandle> = Vec::new();
        for o in ops {
            match o {
                Op::Alloc(kv, n) => {
                    let pool = if kv { PoolKind::Kv } else { PoolKind::Ssm };
                    let mut out = vec![];
                    match p.allocate_or_migrate(pool, n, &mut out) {
                        Ok(_) => { prop_assert_eq!(out.len(), n as usize); live.extend(out); }
                        Err(AllocError::OutOfCapacity { .. }) => {
                            prop_assert!(out.is_empty());
                            prop_assert!(p.free_units(pool) < n);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let h = live.swap_remove(i % live.len());
                    prop_assert!(p.free(h).is_ok());
                    dead.push(h);
                }
                Op::FreeStale(i) if !dead.is_empty() => {
                    let h = dead[i % dead.len()];
                    prop_assert!(matches!(p.free(h), Err(AllocError::StaleHandle(_) | AllocError::DoubleFree(_))));
                }
                Op::Migrate(kv) => {
                    let _ = p.migrate_toward(if kv { PoolKind::Kv } else { PoolKind::Ssm });
                }
                _ => {}
            }
            let mut seen = HashSet::new();
            for &h in &live {
                let l = p.resolve(h).unwrap();
                prop_assert!(seen.insert((l.table, l.byte_offset)));
                prop_assert!(l.byte_offset + l.unit_bytes <= p.pool_bytes(l.table));
            }
            for pool in PoolKind::ALL {
                prop_assert_eq!(p.live_units(pool) + p.free_units(pool), p.capacity(pool));
            }
            prop_assert!(p.pool_bytes(PoolKind::Kv) + p.pool_bytes(PoolKind::Ssm) <= p.total_bytes());
        }
    }
}
