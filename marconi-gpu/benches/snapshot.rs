//! Host snapshot throughput: a batched slot copy against a plain memcpy of the
//! same bytes, and a fork into k candidate slots.
//!
//! Run: `cargo bench -p marconi-gpu --bench snapshot`. Throughput is reported in
//! bytes copied per second.

#![expect(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use marconi_gpu::snapshot::{CopyBatch, SlotPair, SnapshotBackend, StateArena};

/// Slot sizes: a small per-layer state, and a whole multi-layer state.
const SLOT_BYTES: [usize; 2] = [64 << 10, 4 << 20];
/// Copies per batch.
const BATCH: u32 = 8;

fn copy_vs_memcpy(c: &mut Criterion) {
    let mut group = c.benchmark_group("snapshot_copy");
    group.sample_size(20);
    for slot_bytes in SLOT_BYTES {
        let slots = 2 * BATCH;
        let bytes = slot_bytes * BATCH as usize;
        group.throughput(Throughput::Bytes(bytes as u64));

        // Baseline: one memcpy of the batch's bytes between two buffers.
        let src = vec![7u8; bytes];
        let mut dst = vec![0u8; bytes];
        group.bench_with_input(BenchmarkId::new("memcpy", slot_bytes), &bytes, |b, _| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            })
        });

        let mut mem = vec![1u8; slot_bytes * slots as usize];
        let pairs: Vec<SlotPair> = (0..BATCH).map(|i| SlotPair::new(i, BATCH + i)).collect();
        for threads in [1usize, 2] {
            let mut arena = StateArena::new(&mut mem, slots).expect("layout");
            arena.set_parallelism(threads, 2 << 20);
            let id = BenchmarkId::new(format!("batch_copy_t{threads}"), slot_bytes);
            group.bench_with_input(id, &bytes, |b, _| {
                b.iter(|| {
                    let batch = CopyBatch::new(pairs.clone(), slots).expect("valid batch");
                    arena.copy(black_box(&batch)).expect("copy");
                })
            });
        }
    }
    group.finish();
}

fn fork(c: &mut Criterion) {
    let mut group = c.benchmark_group("snapshot_fork");
    group.sample_size(20);
    let slot_bytes = 1 << 20;
    for k in [2u32, 4, 8] {
        let slots = k + 1;
        group.throughput(Throughput::Bytes((slot_bytes * k as usize) as u64));
        let mut mem = vec![3u8; slot_bytes * slots as usize];
        let mut arena = StateArena::new(&mut mem, slots).expect("layout");
        let dsts: Vec<u32> = (1..=k).collect();
        group.bench_with_input(BenchmarkId::new("fork_1MiB", k), &k, |b, _| {
            b.iter(|| arena.fork(0, black_box(&dsts)).expect("fork"))
        });
    }
    group.finish();
}

criterion_group!(benches, copy_vs_memcpy, fork);
criterion_main!(benches);
