//! Bytes through the store path: the envelope (seal: copy + checksum;
//! open: verify) against a plain copy, and state-sized values through the
//! directory store and, when redis-server is on PATH, a Redis started on
//! 127.0.0.1. Run: `cargo bench -p marconi-store --bench store`.

#![expect(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

#[path = "../tests/common.rs"]
mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use marconi_store::envelope::{open, seal, seal_header, Expect};
use marconi_store::{
    DirStore, Fingerprint, KeyKind, Lookup, RedisConfig, RedisStore, StoreKey, StoreTier,
    TierConfig,
};

const MIB: usize = 1 << 20;

fn expect() -> Expect {
    Expect {
        key: StoreKey {
            kind: KeyKind::State,
            digest: [7; 32],
        },
        fingerprint: Fingerprint::of("bench"),
        layout_version: 1,
    }
}

fn envelope(c: &mut Criterion) {
    let mut g = c.benchmark_group("envelope");
    g.sample_size(20).measurement_time(Duration::from_secs(2));
    let e = expect();
    for mib in [1usize, 16, 64] {
        let payload = common::value(mib * MIB, 3);
        g.throughput(Throughput::Bytes(payload.len() as u64));
        g.bench_with_input(BenchmarkId::new("memcpy_to_vec", mib), &payload, |b, p| {
            b.iter(|| black_box(p.to_vec()))
        });
        let mut dst = vec![0u8; payload.len()];
        g.bench_with_input(
            BenchmarkId::new("memcpy_prealloc", mib),
            &payload,
            |b, p| {
                b.iter(|| {
                    dst.copy_from_slice(p);
                    black_box(&dst);
                })
            },
        );
        g.bench_with_input(BenchmarkId::new("seal", mib), &payload, |b, p| {
            b.iter(|| black_box(seal(&e, p)))
        });
        g.bench_with_input(BenchmarkId::new("seal_header", mib), &payload, |b, p| {
            b.iter(|| black_box(seal_header(&e, p)))
        });
        let sealed = seal(&e, &payload);
        g.bench_with_input(BenchmarkId::new("open_verify", mib), &sealed, |b, s| {
            b.iter(|| black_box(open(&e, s).unwrap()))
        });
    }
    g.finish();
}

fn round_trips(c: &mut Criterion, name: &str, tier: &StoreTier) {
    let mut g = c.benchmark_group(name);
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    let tokens = common::tokens(4096, 1);
    for mib in [1usize, 16, 64] {
        let v = common::value(mib * MIB, 5);
        g.throughput(Throughput::Bytes(v.len() as u64));
        g.bench_with_input(BenchmarkId::new("put_state", mib), &v, |b, v| {
            b.iter(|| tier.put_state(&tokens, 4000, v).unwrap())
        });
        tier.put_state(&tokens, 4000, &v).unwrap();
        g.bench_with_input(BenchmarkId::new("get_state", mib), &v, |b, v| {
            b.iter(|| match tier.get_state(&tokens, 4000).unwrap() {
                Lookup::Hit(p) => assert_eq!(p.len(), v.len()),
                Lookup::Miss(k) => panic!("miss {k:?}"),
            })
        });
    }
    g.finish();
}

fn config() -> TierConfig {
    let mut c = TierConfig::new("bench", 16);
    c.max_value_bytes = 128 * MIB;
    c
}

fn dir(c: &mut Criterion) {
    let d = tempfile::tempdir().unwrap();
    let s = DirStore::new(d.path(), Duration::from_secs(10)).unwrap();
    let tier = StoreTier::new(Box::new(s), config()).unwrap();
    round_trips(c, "dir", &tier);
}

fn redis(c: &mut Criterion) {
    let Some(bin) = common::server_binary() else {
        eprintln!("redis benches skipped: no redis-server or valkey-server on PATH");
        return;
    };
    let server = common::Server::start(&bin);
    let mut rc = RedisConfig::new(&server.url());
    // State-sized values: bounds fit a 64 MiB transfer on loopback.
    rc.timeout = Duration::from_secs(2);
    rc.connect_timeout = Duration::from_millis(200);
    let tier = StoreTier::new(Box::new(RedisStore::new(rc).unwrap()), config()).unwrap();
    round_trips(c, "redis", &tier);
}

criterion_group!(benches, envelope, dir, redis);
criterion_main!(benches);
