//! Allocator benchmarks: handle allocate/free/resolve throughput, physical
//! migration cost per 2 MiB chunk on the memfd host backend, and the AVMP
//! replay's wall time per cell.
//!
//! `cargo bench -p marconi-gpu --bench alloc`

#![expect(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use marconi_gpu::avmp::{self, Model, Variant};
use marconi_gpu::phys::{BackedPool, MemfdBackend, PhysicalMemory};
use marconi_gpu::{DualPool, DualPoolConfig, MigrationPolicy, PoolAllocator, PoolKind};

fn jamba_4g(policy: MigrationPolicy) -> DualPool {
    DualPool::new(
        "bench",
        DualPoolConfig {
            total_bytes: 4 << 30,
            ssm_ratio: 0.5,
            kv_unit: 64 << 10,
            ssm_unit: 256 << 10,
            policy,
        },
    )
    .expect("valid config")
}

fn handles(c: &mut Criterion) {
    let mut g = c.benchmark_group("handles");
    g.throughput(Throughput::Elements(1));
    let mut p = jamba_4g(MigrationPolicy::Static);
    let mut out = Vec::with_capacity(64);
    g.bench_function("allocate+free 1 unit", |b| {
        b.iter(|| {
            out.clear();
            p.allocate(PoolKind::Kv, 1, &mut out).expect("capacity");
            p.free(black_box(out[0])).expect("live");
        });
    });
    g.throughput(Throughput::Elements(64));
    g.bench_function("allocate 64 + free 64", |b| {
        b.iter(|| {
            out.clear();
            p.allocate(PoolKind::Kv, 64, &mut out).expect("capacity");
            for &h in &out {
                p.free(h).expect("live");
            }
        });
    });
    let mut live = Vec::new();
    p.allocate(PoolKind::Kv, 4096, &mut live).expect("capacity");
    g.throughput(Throughput::Elements(live.len() as u64));
    g.bench_function("resolve 4096 live handles", |b| {
        b.iter(|| {
            let mut s = 0u64;
            for &h in &live {
                s = s.wrapping_add(p.resolve(black_box(h)).expect("live").byte_offset);
            }
            s
        });
    });
    g.finish();
}

fn migration(c: &mut Criterion) {
    let mut g = c.benchmark_group("migration");
    // One round trip moves 2 chunks: 8 SSM blocks (2 MiB) to KV, 32 KV pages back.
    g.throughput(Throughput::Elements(2));
    let pool = DualPool::new(
        "bench",
        DualPoolConfig {
            total_bytes: 64 << 20,
            ssm_ratio: 0.5,
            kv_unit: 64 << 10,
            ssm_unit: 256 << 10,
            policy: MigrationPolicy::forced(8),
        },
    )
    .expect("valid config");
    let mut p = BackedPool::new(pool, MemfdBackend::new(32).expect("memfd")).expect("backing");
    g.bench_function("pool round trip, per 2 MiB chunk x2", |b| {
        b.iter(|| {
            p.migrate_units(PoolKind::Kv, 8).expect("tail free");
            p.migrate_units(PoolKind::Ssm, 32).expect("tail free");
        });
    });
    let mut be = MemfdBackend::new(2).expect("memfd");
    let r1 = be.reserve(2 << 20).expect("reserve");
    let r2 = be.reserve(2 << 20).expect("reserve");
    let ch = be.create_chunk().expect("chunk");
    be.map(r1, 0, ch).expect("map");
    be.write(r1, 0, &vec![7u8; 2 << 20]).expect("touch");
    g.bench_function("backend unmap+map, per 2 MiB chunk x2", |b| {
        b.iter(|| {
            let c = be.unmap(r1, 0).expect("mapped");
            be.map(r2, 0, c).expect("map");
            let c = be.unmap(r2, 0).expect("mapped");
            be.map(r1, 0, c).expect("map");
        });
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("create+map+touch+unmap+release 2 MiB", |b| {
        b.iter_batched(
            || (),
            |()| {
                let c = be.create_chunk().expect("chunk");
                be.map(r2, 0, c).expect("map");
                be.write(r2, 0, &[1u8; 4096]).expect("touch");
                let c = be.unmap(r2, 0).expect("mapped");
                be.release_chunk(c).expect("release");
            },
            BatchSize::SmallInput,
        );
    });
    g.finish();
}

fn replay(c: &mut Criterion) {
    let traces = avmp::builtin_traces();
    let mut g = c.benchmark_group("avmp_replay_cell");
    g.sample_size(10);
    for (workload, variant, model, tb) in [
        (
            "uniform_short/1",
            Variant::AvmpDynamicB128,
            Model::Jamba15Mini,
            4,
        ),
        (
            "mixed_long/2",
            Variant::AvmpDynamicB128,
            Model::Mamba2_1b3,
            1,
        ),
        (
            "agentic_burst/3",
            Variant::FixedDualMr05,
            Model::Jamba15Mini,
            1,
        ),
        (
            "sharegpt_replay/4",
            Variant::PaddedUnified,
            Model::Mamba2_1b3,
            4,
        ),
    ] {
        let trace = &traces[workload];
        g.bench_function(
            format!("{} {} {} {tb}GiB", variant.name(), workload, model.name()),
            |b| {
                b.iter(|| avmp::run_cell(trace, variant, model, tb).expect("replay"));
            },
        );
    }
    g.finish();
}

criterion_group!(benches, handles, migration, replay);
criterion_main!(benches);
