//! The callback store (an engine's own storage) under the fault contract,
//! and its time bound with a slow callback.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{assert_miss, fault_contract, tokens, value};
use marconi_store::{
    CallbackStore, Callbacks, Fetched, KeyerConfig, MissKind, StoreError, StoreTier, TierConfig,
};

type Map = Arc<Mutex<HashMap<String, Vec<u8>>>>;

fn callbacks(map: &Map, delay: Duration) -> Callbacks {
    let (g, p, e, d) = (map.clone(), map.clone(), map.clone(), map.clone());
    Callbacks {
        get: Box::new(move |k, _max| {
            std::thread::sleep(delay);
            // Returns the whole value whatever max is (as a careless
            // engine store might): the store bounds it anyway.
            Ok(match g.lock().unwrap().get(k) {
                None => Fetched::Absent,
                Some(v) => Fetched::Value(v.clone()),
            })
        }),
        put: Box::new(move |k, v| {
            p.lock().unwrap().insert(k.to_owned(), v.to_vec());
            Ok(())
        }),
        exists: Box::new(move |k| Ok(e.lock().unwrap().contains_key(k))),
        delete: Box::new(move |k| {
            d.lock().unwrap().remove(k);
            Ok(())
        }),
    }
}

fn tier(map: &Map, delay: Duration, f: impl FnOnce(&mut TierConfig)) -> StoreTier {
    let mut c = TierConfig::new("model-a", 8);
    c.max_value_bytes = 1 << 20;
    f(&mut c);
    let s = CallbackStore::new(callbacks(map, delay), Duration::from_millis(200));
    StoreTier::new(Box::new(s), c).unwrap()
}

#[test]
fn callback_store_keeps_the_fault_contract() {
    let map = Map::default();
    fault_contract(
        &tier(&map, Duration::ZERO, |_| {}),
        &tier(&map, Duration::ZERO, |_| {}),
        &tier(&map, Duration::ZERO, |c| {
            c.keyer = KeyerConfig::new("model-b", 8)
        }),
        &tier(&map, Duration::ZERO, |c| c.keyer.layout_version = 2),
    );
}

#[test]
fn a_slow_callback_batch_stops_at_its_deadline() {
    let map = Map::default();
    let fast = tier(&map, Duration::ZERO, |_| {});
    let t = tokens(8 * 40, 2);
    let blocks: Vec<Vec<u8>> = (0..40).map(|i| value(64, i)).collect();
    let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
    fast.put_kv(&t, 0, &refs).unwrap();
    assert_eq!(fast.get_kv(&t, 0, 40, None).unwrap().len(), 40);
    // 40 callbacks of 20 ms against a 200 ms bound: the batch stops.
    let slow = tier(&map, Duration::from_millis(20), |_| {});
    let start = Instant::now();
    assert!(slow.get_kv(&t, 0, 40, None).unwrap().is_empty());
    assert!(
        start.elapsed() < Duration::from_millis(200 + 20 + 300),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(slow.stats().timeout, 1);
}

#[test]
fn an_engine_store_that_fails_or_overfills_gives_misses() {
    let failing = Callbacks {
        get: Box::new(|_, _| Err(StoreError::Unavailable("engine store down".into()))),
        put: Box::new(|_, _| Err(StoreError::Failed("full".into()))),
        exists: Box::new(|_| Err(StoreError::Failed("x".into()))),
        delete: Box::new(|_| Ok(())),
    };
    let a = StoreTier::new(
        Box::new(CallbackStore::new(failing, Duration::from_secs(1))),
        TierConfig::new("m", 8),
    )
    .unwrap();
    let t = tokens(16, 0);
    assert_miss(&a.get_state(&t, 8).unwrap(), MissKind::Unavailable, "down");
    assert!(a.put_state(&t, 8, b"x").is_err());
    assert_eq!(a.kv_prefix(&t), 0);
    // A callback that returns more than asked for: refused as oversized.
    let big = Callbacks {
        get: Box::new(|_, max| Ok(Fetched::Value(vec![0; max + 10]))),
        put: Box::new(|_, _| Ok(())),
        exists: Box::new(|_| Ok(true)),
        delete: Box::new(|_| Ok(())),
    };
    let b = StoreTier::new(
        Box::new(CallbackStore::new(big, Duration::from_secs(1))),
        TierConfig::new("m", 8),
    )
    .unwrap();
    assert_miss(
        &b.get_state(&t, 8).unwrap(),
        MissKind::Oversized,
        "overfilled",
    );
}
