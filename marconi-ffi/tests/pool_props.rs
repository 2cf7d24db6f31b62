//! Property test of the pool and snapshot C functions over the memfd
//! backend: random sequences of allocate / free (live, freed and made-up
//! handles) / resolve / copy / fork / migrate against a model of the live
//! handles and of the bytes each unit holds. After every step: every
//! handle of the model resolves, to non-overlapping units that still hold
//! the bytes the model says (migrations included); free units plus live
//! units are the capacity; mapped chunks and the memfd's physical bytes
//! (st_blocks) never exceed the budget; a refused call changed nothing.

use std::collections::{BTreeMap, HashSet};
use std::ptr;

use marconi::pool::*;
use marconi::status::marconi_status;
use proptest::prelude::*;

const CHUNK: u64 = 64 << 10;
const BUDGET: u64 = 40 * CHUNK;
const KV_UNIT: u64 = 4 << 10;
const STATE_UNIT: u64 = 24 << 10;

#[derive(Debug, Clone)]
enum Op {
    Alloc { state: bool, n: u32 },
    Free { pick: Vec<usize> },
    FreeAgain { pick: usize },
    FreeMadeUp { raw: u64 },
    Write { pick: usize, byte: u8 },
    Copy { pairs: Vec<(usize, usize)> },
    Fork { src: usize, dsts: Vec<usize> },
    Migrate { to_state: bool, units: u32 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<bool>(), 0u32..24).prop_map(|(state, n)| Op::Alloc { state, n }),
        3 => prop::collection::vec(any::<usize>(), 0..8).prop_map(|pick| Op::Free { pick }),
        1 => any::<usize>().prop_map(|pick| Op::FreeAgain { pick }),
        1 => any::<u64>().prop_map(|raw| Op::FreeMadeUp { raw }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(pick, byte)| Op::Write { pick, byte }),
        2 => prop::collection::vec((any::<usize>(), any::<usize>()), 0..5)
            .prop_map(|pairs| Op::Copy { pairs }),
        1 => (any::<usize>(), prop::collection::vec(any::<usize>(), 0..4))
            .prop_map(|(src, dsts)| Op::Fork { src, dsts }),
        1 => (any::<bool>(), 0u32..24).prop_map(|(to_state, units)| Op::Migrate { to_state, units }),
    ]
}

struct Pool(*mut marconi_pool);

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: a live pool from marconi_pool_new, freed once.
        unsafe { marconi_pool_free(self.0) };
    }
}

/// The model: each live handle and the byte its unit is filled with.
#[derive(Default)]
struct Model {
    live: BTreeMap<u64, u8>,
    freed: Vec<u64>,
}

impl Model {
    fn nth(&self, i: usize, state_only: bool) -> Option<u64> {
        let v: Vec<u64> = self
            .live
            .keys()
            .copied()
            .filter(|&h| !state_only || is_state(h))
            .collect();
        (!v.is_empty()).then(|| v[i % v.len()])
    }
}

fn stats(p: &Pool) -> marconi_pool_stats {
    let mut s = marconi_pool_stats {
        struct_size: std::mem::size_of::<marconi_pool_stats>() as u32,
        ..Default::default()
    };
    // SAFETY: live pool, s writable.
    assert_eq!(
        unsafe { marconi_pool_get_stats(p.0, &mut s) },
        marconi_status::Ok
    );
    s
}

/// Whether a handle names a state unit (marconi-gpu's layout).
fn is_state(h: u64) -> bool {
    marconi_gpu::VirtualHandle::from_raw(h).pool() == marconi_gpu::PoolKind::Ssm
}

fn resolve(p: &Pool, h: u64) -> Result<marconi_unit_location, marconi_status> {
    let mut l = marconi_unit_location::default();
    // SAFETY: live pool; one handle in, one location out.
    match unsafe { marconi_pool_resolve(p.0, &h, 1, &mut l, 1) } {
        marconi_status::Ok => Ok(l),
        s => Err(s),
    }
}

fn unit<'a>(l: &marconi_unit_location) -> &'a mut [u8] {
    // SAFETY: a live unit's address is mapped read-write for unit_bytes
    // while the handle is live (the API's contract), and the test is the
    // only user of this memory.
    unsafe { std::slice::from_raw_parts_mut(l.address as *mut u8, l.unit_bytes as usize) }
}

fn fill(p: &Pool, h: u64, byte: u8) {
    let l = resolve(p, h).expect("live handle resolves");
    unit(&l).fill(byte);
}

fn check(p: &Pool, m: &Model) -> Result<(), TestCaseError> {
    let s = stats(p);
    let live_kv = m.live.keys().filter(|&&h| !is_state(h)).count() as u64;
    let live_st = m.live.len() as u64 - live_kv;
    prop_assert_eq!(s.kv_free + live_kv, s.kv_capacity);
    prop_assert_eq!(s.state_free + live_st, s.state_capacity);
    prop_assert!(s.mapped_chunks <= s.budget_chunks);
    prop_assert!(s.kv_capacity * KV_UNIT + s.state_capacity * STATE_UNIT <= BUDGET);
    prop_assert!(
        s.physical_bytes <= s.budget_bytes,
        "st_blocks {} over the budget {}",
        s.physical_bytes,
        s.budget_bytes
    );
    let mut spans = Vec::new();
    for (&h, &byte) in &m.live {
        let l = resolve(p, h).map_err(|e| TestCaseError::fail(format!("{h:#x}: {e:?}")))?;
        let u = unit(&l);
        prop_assert!(
            u.iter().all(|&b| b == byte),
            "unit {h:#x} lost its bytes ({byte} expected)"
        );
        spans.push((l.address, l.address + l.unit_bytes));
    }
    spans.sort_unstable();
    prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "units overlap");
    for &h in m.freed.iter().rev().take(4) {
        prop_assert!(resolve(p, h).is_err(), "freed {h:#x} still resolves");
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut cfg = std::mem::MaybeUninit::<marconi_pool_config>::uninit();
    // SAFETY: cfg has size_of writable bytes.
    let st = unsafe {
        marconi_pool_config_init(cfg.as_mut_ptr(), std::mem::size_of::<marconi_pool_config>())
    };
    prop_assert_eq!(st, marconi_status::Ok);
    // SAFETY: initialised by marconi_pool_config_init.
    let mut cfg = unsafe { cfg.assume_init() };
    cfg.budget_bytes = BUDGET;
    cfg.chunk_bytes = CHUNK;
    cfg.kv_page_bytes = KV_UNIT;
    cfg.state_slot_bytes = STATE_UNIT;
    cfg.state_fraction = 0.4;
    cfg.migration_batch_units = 16;
    let mut raw = ptr::null_mut();
    // SAFETY: cfg initialised, raw writable.
    prop_assert_eq!(
        unsafe { marconi_pool_new(&cfg, &mut raw) },
        marconi_status::Ok
    );
    let p = Pool(raw);
    let mut m = Model::default();
    let mut next_byte = 1u8;
    for op in ops {
        let before = stats(&p);
        match op {
            Op::Alloc { state, n } => {
                let mut out = vec![0u64; n as usize];
                // SAFETY: out has n writable handles.
                let s = unsafe {
                    marconi_pool_allocate(
                        p.0,
                        u32::from(state),
                        out.len(),
                        out.as_mut_ptr(),
                        out.len(),
                    )
                };
                if s == marconi_status::Ok {
                    for h in out {
                        prop_assert!(m.live.insert(h, next_byte).is_none(), "handle issued twice");
                        fill(&p, h, next_byte);
                    }
                    next_byte = next_byte.wrapping_add(1).max(1);
                } else {
                    prop_assert_eq!(s, marconi_status::OutOfMemory);
                    prop_assert!(out.iter().all(|&h| h == 0), "out written on failure");
                    let after = stats(&p);
                    prop_assert_eq!(
                        (after.kv_free, after.state_free),
                        (before.kv_free, before.state_free)
                    );
                }
            }
            Op::Free { pick } => {
                let mut hs: Vec<u64> = pick.iter().filter_map(|&i| m.nth(i, false)).collect();
                let distinct: HashSet<u64> = hs.iter().copied().collect();
                // SAFETY: hs has hs.len() readable u32.
                let s = unsafe { marconi_pool_free_units(p.0, hs.as_ptr(), hs.len()) };
                if distinct.len() == hs.len() {
                    prop_assert_eq!(s, marconi_status::Ok);
                    for h in hs.drain(..) {
                        m.live.remove(&h);
                        m.freed.push(h);
                    }
                } else {
                    prop_assert_eq!(s, marconi_status::DoubleFree);
                }
            }
            Op::FreeAgain { pick } => {
                if !m.freed.is_empty() {
                    let h = m.freed[pick % m.freed.len()];
                    // SAFETY: one readable u32.
                    let s = unsafe { marconi_pool_free_units(p.0, &h, 1) };
                    prop_assert!(
                        s == marconi_status::DoubleFree || s == marconi_status::UnknownHandle,
                        "{s:?}"
                    );
                }
            }
            Op::FreeMadeUp { raw } => {
                if !m.live.contains_key(&raw) {
                    // SAFETY: one readable u32.
                    let s = unsafe { marconi_pool_free_units(p.0, &raw, 1) };
                    prop_assert!(
                        s == marconi_status::DoubleFree || s == marconi_status::UnknownHandle,
                        "{s:?}"
                    );
                }
            }
            Op::Write { pick, byte } => {
                if let Some(h) = m.nth(pick, false) {
                    fill(&p, h, byte);
                    m.live.insert(h, byte);
                }
            }
            Op::Copy { pairs } => {
                let pairs: Vec<(u64, u64)> = pairs
                    .iter()
                    .filter_map(|&(a, b)| Some((m.nth(a, true)?, m.nth(b, true)?)))
                    .collect();
                let orders: Vec<marconi_state_copy> = pairs
                    .iter()
                    .map(|&(src_state, dst_state)| marconi_state_copy {
                        src_state,
                        dst_state,
                    })
                    .collect();
                let dsts: Vec<u64> = pairs.iter().map(|p| p.1).collect();
                let valid = pairs.iter().all(|(s, d)| s != d)
                    && dsts.iter().collect::<HashSet<_>>().len() == dsts.len()
                    && !pairs.iter().any(|(s, _)| dsts.contains(s));
                // SAFETY: orders has orders.len() readable elements.
                let s = unsafe { marconi_pool_copy_states(p.0, orders.as_ptr(), orders.len()) };
                if valid {
                    prop_assert_eq!(s, marconi_status::Ok);
                    let new: Vec<(u64, u8)> = pairs.iter().map(|&(s, d)| (d, m.live[&s])).collect();
                    m.live.extend(new);
                } else {
                    prop_assert_eq!(s, marconi_status::InvalidArgument);
                }
            }
            Op::Fork { src, dsts } => {
                if let Some(s) = m.nth(src, true) {
                    let dsts: Vec<u64> = dsts.iter().filter_map(|&i| m.nth(i, true)).collect();
                    let valid = !dsts.contains(&s)
                        && dsts.iter().collect::<HashSet<_>>().len() == dsts.len();
                    // SAFETY: dsts has dsts.len() readable u32.
                    let st = unsafe { marconi_pool_fork_state(p.0, s, dsts.as_ptr(), dsts.len()) };
                    if valid {
                        prop_assert_eq!(st, marconi_status::Ok);
                        let b = m.live[&s];
                        for d in dsts {
                            m.live.insert(d, b);
                        }
                    } else {
                        prop_assert_eq!(st, marconi_status::InvalidArgument);
                    }
                }
            }
            Op::Migrate { to_state, units } => {
                let mut out = marconi_migration::default();
                // SAFETY: out writable.
                let s = unsafe { marconi_pool_migrate(p.0, u32::from(to_state), units, &mut out) };
                if s != marconi_status::Ok {
                    prop_assert_eq!(s, marconi_status::OutOfMemory);
                    let after = stats(&p);
                    prop_assert_eq!(
                        (after.kv_capacity, after.state_capacity),
                        (before.kv_capacity, before.state_capacity)
                    );
                }
            }
        }
        check(&p, &m)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap are foreign calls Miri cannot run")]
    fn pool_calls_keep_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
