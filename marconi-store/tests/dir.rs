//! The directory store under the fault contract, plus what only a
//! directory can do wrong (non-regular files, a vanished root).

mod common;

use std::time::{Duration, Instant};

use common::{assert_miss, fault_contract, tokens, value};
use marconi_store::{DirStore, Fetched, MissKind, Store, StoreTier, TierConfig};

fn tier(root: &std::path::Path, f: impl FnOnce(&mut TierConfig)) -> StoreTier {
    let mut c = TierConfig::new("model-a", 8);
    c.max_value_bytes = 1 << 20;
    f(&mut c);
    let s = DirStore::new(root, Duration::from_secs(2)).unwrap();
    StoreTier::new(Box::new(s), c).unwrap()
}

#[test]
fn dir_store_keeps_the_fault_contract() {
    let d = tempfile::tempdir().unwrap();
    fault_contract(
        &tier(d.path(), |_| {}),
        &tier(d.path(), |_| {}),
        &tier(d.path(), |c| {
            c.keyer = marconi_store::KeyerConfig::new("model-b", 8)
        }),
        &tier(d.path(), |c| c.keyer.layout_version = 2),
    );
    // No temporary file is left behind.
    for e in std::fs::read_dir(d.path()).unwrap() {
        let n = e.unwrap().file_name();
        assert!(!n.to_string_lossy().starts_with('.'), "{n:?}");
    }
}

#[test]
fn non_regular_objects_are_refused_without_blocking() {
    let d = tempfile::tempdir().unwrap();
    let a = tier(d.path(), |_| {});
    let t = tokens(16, 5);
    let state = value(1000, 1);
    let name = |p| a.name(&a.keyer().state_key(&t, p).unwrap());
    a.put_state(&t, 8, &state).unwrap();
    // A symlink to a valid object: not followed.
    std::os::unix::fs::symlink(d.path().join(name(8)), d.path().join(name(9))).unwrap();
    // A directory, and a FIFO (opening one for reading would block).
    std::fs::create_dir(d.path().join(name(10))).unwrap();
    let fifo = d.path().join(name(11));
    let st = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(st.success());
    let start = Instant::now();
    for p in [9, 10, 11] {
        assert_miss(
            &a.get_state(&t, p).unwrap(),
            MissKind::NotRegular,
            &format!("position {p}"),
        );
    }
    assert!(start.elapsed() < Duration::from_secs(1));
    assert_eq!(
        a.store()
            .batch_exists(&[&name(8), &name(9), &name(10), &name(11)])
            .unwrap(),
        vec![true, false, false, false]
    );
    // delete never removes a directory; it removes a symlink, not its target.
    a.store().delete(&[&name(9), &name(10)]).unwrap();
    assert!(d.path().join(name(10)).is_dir());
    assert!(d.path().join(name(8)).is_file());
    assert_eq!(a.stats().not_regular, 3);
    // Names that could leave the directory are refused.
    for bad in ["../x", ".hidden", "a/b", ""] {
        assert!(a.store().batch_get(&[bad], 10).is_err(), "{bad:?}");
        assert!(a.store().batch_put(&[(bad, b"x")]).is_err(), "{bad:?}");
    }
}

#[test]
fn a_vanished_or_unwritable_root_gives_misses_and_put_errors() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("store");
    let a = tier(&root, |_| {});
    let t = tokens(16, 5);
    a.put_state(&t, 8, &value(100, 1)).unwrap();
    std::fs::remove_dir_all(&root).unwrap();
    assert_miss(
        &a.get_state(&t, 8).unwrap(),
        MissKind::Absent,
        "root removed",
    );
    assert!(a.put_state(&t, 8, &value(100, 1)).is_err());
    assert_eq!(a.kv_prefix(&t), 0);
    // A file where the root was.
    std::fs::write(&root, b"not a directory").unwrap();
    assert_miss(
        &a.get_state(&t, 8).unwrap(),
        MissKind::Failed,
        "root is a file",
    );
    let s = a.stats();
    assert_eq!((s.absent, s.failed, s.put_failures), (1, 1, 1));
    assert!(DirStore::new(&root, Duration::from_secs(1)).is_err());
    assert!(DirStore::new(d.path(), Duration::ZERO).is_err());
}

#[test]
fn reads_are_bounded_by_max_bytes() {
    let d = tempfile::tempdir().unwrap();
    let s = DirStore::new(d.path(), Duration::from_secs(1)).unwrap();
    s.batch_put(&[("big", &value(10_000, 0)[..])]).unwrap();
    assert_eq!(
        s.batch_get(&["big"], 9_999).unwrap(),
        vec![Fetched::Oversized]
    );
    assert_eq!(
        s.batch_get(&["big"], 10_000).unwrap()[0],
        Fetched::Value(value(10_000, 0))
    );
    assert_eq!(s.batch_get(&["none"], 10).unwrap(), vec![Fetched::Absent]);
}
