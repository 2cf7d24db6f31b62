//! Host snapshot throughput: a batched slot copy against a plain memcpy of the
//! same bytes, and a fork into k candidate slots.
//!
//! Run: `cargo bench -p marconi-gpu --bench snapshot`. Throughput is reported in
//! bytes copied per second.
//!
//! With `--features cuda` on a GPU machine it also measures the copy kernel
//! against `cuMemcpyDtoDAsync` of the same slots, and the cost of mapping and
//! unmapping one chunk and of creating one; without a driver those print
//! `SKIPPED` and measure nothing.

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

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use criterion::{BenchmarkId, Criterion, Throughput};
    use cudarc::driver::result;
    use marconi_gpu::cuda::snapshot::{CudaStateArena, DevicePlane, SnapshotKernels};
    use marconi_gpu::cuda::vmm::{self, Mapping, PhysicalChunk, Reservation};
    use marconi_gpu::cuda::{Device, DeviceBuffer, Stream};
    use marconi_gpu::snapshot::{CopyBatch, SlotPair, SnapshotBackend};

    pub(crate) fn bench(c: &mut Criterion) {
        let device = match Device::open(0) {
            Ok(d) => d,
            Err(e) => {
                println!("SKIPPED: GPU benchmarks, no libcuda ({e})");
                return;
            }
        };
        copy_kernel_vs_dtod(c, &device);
        map_unmap(c, &device);
    }

    fn copy_kernel_vs_dtod(c: &mut Criterion, device: &Arc<Device>) {
        let mut group = c.benchmark_group("gpu_snapshot_copy");
        group.sample_size(20);
        let (slots, batch) = (16u32, 8u32);
        for slot_bytes in [256usize << 10, 32 << 20] {
            let buf =
                DeviceBuffer::new(device, slot_bytes * slots as usize).expect("device memory");
            let kernels = SnapshotKernels::load(device).expect("kernel");
            let stream = Arc::new(Stream::new(device).expect("stream"));
            let plane = vec![DevicePlane {
                base: buf.ptr(),
                slot_bytes,
            }];
            // SAFETY: `buf` outlives the arena, nothing else touches it.
            let mut arena =
                unsafe { CudaStateArena::new(&kernels, &stream, plane, slots) }.expect("arena");
            let pairs: Vec<SlotPair> = (0..batch).map(|i| SlotPair::new(i, batch + i)).collect();
            let copy = CopyBatch::new(pairs.clone(), slots).expect("valid");
            group.throughput(Throughput::Bytes((slot_bytes * batch as usize) as u64));
            group.bench_function(BenchmarkId::new("kernel", slot_bytes), |b| {
                b.iter(|| {
                    arena.copy(&copy).expect("launch");
                    arena.synchronize().expect("sync");
                })
            });
            group.bench_function(BenchmarkId::new("memcpy_dtod", slot_bytes), |b| {
                b.iter(|| {
                    device.bind().expect("bind");
                    for p in &pairs {
                        let (src, dst) = (p.src as u64, p.dst as u64);
                        let at = |s: u64| buf.ptr() + s * slot_bytes as u64;
                        // SAFETY: both slots lie inside `buf` and do not overlap.
                        unsafe {
                            result::memcpy_dtod_async(at(dst), at(src), slot_bytes, stream.raw())
                        }
                        .expect("memcpy");
                    }
                    stream.synchronize().expect("sync");
                })
            });
        }
        group.finish();
    }

    fn map_unmap(c: &mut Criterion, device: &Arc<Device>) {
        let mut group = c.benchmark_group("gpu_vmm");
        group.sample_size(20);
        let g = vmm::granularity(device).expect("granularity");
        let res = Reservation::new(device, 4 * g).expect("reserve");
        let mut chunk = Some(PhysicalChunk::new(device, g).expect("chunk"));
        group.bench_function("map_set_access_unmap_per_chunk", |b| {
            b.iter(|| {
                let m = Mapping::new(&res, g, chunk.take().expect("chunk")).expect("map");
                chunk = Some(m.unmap().expect("unmap"));
            })
        });
        group.bench_function("create_release_per_chunk", |b| {
            b.iter(|| drop(PhysicalChunk::new(device, g).expect("chunk")))
        });
        group.finish();
    }
}

#[cfg(feature = "cuda")]
criterion_group!(benches, copy_vs_memcpy, fork, gpu::bench);
#[cfg(not(feature = "cuda"))]
criterion_group!(benches, copy_vs_memcpy, fork);
criterion_main!(benches);
