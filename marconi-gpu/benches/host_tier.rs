//! Host tier throughput: demote (device units → host units) and promote
//! (host → device) of whole states through `HostPool`, against a plain
//! memcpy of the same bytes between two heap buffers, at 64 KiB, 1 MiB,
//! 16 MiB and 64 MiB per state; prints GB/s and the fraction of memcpy.
//!
//! The device pool is the memfd backend (the host stand-in for device
//! memory), so demote and promote are real memcpys between two mappings;
//! the figures are what the handle checks and the mappings cost over
//! memcpy (the `mapped` column: a memcpy between the same units with no
//! checks). A batch moves at least 32 MiB (many small states, or one big
//! one); every figure is the median of the runs, the four kinds
//! interleaved (each run starting with the next) so that they share the
//! machine's load.
//!
//! `cargo bench -p marconi-gpu --bench host_tier` (about 10 s;
//! `-- --runs N` for N runs per figure, default 15).

use std::hint::black_box;
use std::time::{Duration, Instant};

use marconi_gpu::host::{HostPool, HostPoolConfig, UnitMemory};
use marconi_gpu::phys::{BackedPool, MemfdBackend};
use marconi_gpu::{DualPool, DualPoolConfig, MigrationPolicy, PoolAllocator, PoolKind};

const STATE_BYTES: [u64; 4] = [64 << 10, 1 << 20, 16 << 20, 64 << 20];
const BATCH_BYTES: u64 = 32 << 20;
const CHUNK: u64 = 2 << 20;
/// KV pages are not moved here; the pools still need one page size.
const PAGE: u64 = 64 << 10;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn main() {
    let mut runs = 15usize;
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--runs") {
        runs = args
            .get(i + 1)
            .and_then(|s| s.parse().ok())
            .filter(|&n: &usize| n > 0)
            .expect("--runs N, N > 0");
    }
    println!(
        "{:>10} {:>6} {:>12} {:>12} {:>12} {:>9} {:>12} {:>9}",
        "state",
        "batch",
        "memcpy GB/s",
        "mapped GB/s",
        "demote GB/s",
        "of memcpy",
        "promote GB/s",
        "of memcpy"
    );
    for state in STATE_BYTES {
        let batch = (BATCH_BYTES / state).max(1);
        let bytes = batch * state;
        // Each pool: the batch's states plus one chunk of pages, in whole chunks.
        let state_share = (bytes).div_ceil(CHUNK) * CHUNK;
        let total = state_share + CHUNK;
        let dual = DualPool::new(
            "device",
            DualPoolConfig {
                total_bytes: total,
                ssm_ratio: (state_share as f64 + 0.5) / total as f64,
                kv_unit: PAGE,
                ssm_unit: state,
                policy: MigrationPolicy::Static,
            },
        )
        .expect("device pool");
        let chunks = usize::try_from(total / CHUNK).expect("chunks");
        let mut dev = BackedPool::new(dual, MemfdBackend::new(chunks).expect("memfd"))
            .expect("device backing");
        let mut host = HostPool::new(HostPoolConfig {
            capacity_bytes: total,
            state_fraction: state_share as f64 / total as f64,
            page_bytes: PAGE,
            state_bytes: state,
            chunk_bytes: CHUNK,
        })
        .expect("host pool");
        let n = u32::try_from(batch).expect("batch");
        let mut d = Vec::new();
        dev.allocate(PoolKind::Ssm, n, &mut d)
            .expect("device states");
        let mut h = Vec::new();
        host.allocate(PoolKind::Ssm, n, &mut h)
            .expect("host states");
        // Touch every page once so no run pays the first-touch faults.
        let fill = vec![7u8; usize::try_from(state).expect("state")];
        for (&a, &b) in d.iter().zip(&h) {
            dev.write_unit(a, 0, &fill).expect("write");
            host.write_unit(b, 0, &fill).expect("write");
        }
        let down: Vec<_> = d.iter().copied().zip(h.iter().copied()).collect();
        let up: Vec<_> = h.iter().copied().zip(d.iter().copied()).collect();
        let len = usize::try_from(bytes).expect("bytes");
        let src = vec![3u8; len];
        let mut dst = vec![1u8; len];
        // The same units' addresses, for a memcpy with no checks between
        // the two mappings.
        let spans: Vec<(usize, usize, usize)> = d
            .iter()
            .zip(&h)
            .map(|(&a, &b)| {
                let (src, n) = dev.unit_span(a).expect("device unit");
                let (dst, _) = host.unit_span(b).expect("host unit");
                (src, dst, usize::try_from(n).expect("unit"))
            })
            .collect();
        let (mut t_copy, mut t_mapped, mut t_down, mut t_up) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for run in 0..runs {
            // Each run starts with another kind, so none always follows
            // the same one.
            for k in 0..4 {
                let t = Instant::now();
                match (run + k) % 4 {
                    0 => {
                        dst.copy_from_slice(black_box(&src));
                        black_box(&mut dst);
                        t_copy.push(t.elapsed());
                    }
                    1 => {
                        for &(src, dst, n) in &spans {
                            // SAFETY: live units of two distinct memfd
                            // mappings, `n` bytes each; nothing else
                            // touches them during the copy.
                            unsafe {
                                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n);
                            }
                        }
                        t_mapped.push(t.elapsed());
                    }
                    2 => {
                        host.demote(&dev, black_box(&down)).expect("demote");
                        t_down.push(t.elapsed());
                    }
                    _ => {
                        host.promote(&mut dev, black_box(&up)).expect("promote");
                        t_up.push(t.elapsed());
                    }
                }
            }
        }
        let (c, m, dn, u) = (
            median(t_copy),
            median(t_mapped),
            median(t_down),
            median(t_up),
        );
        let (gc, gm, gd, gu) = (
            gbps(bytes, c),
            gbps(bytes, m),
            gbps(bytes, dn),
            gbps(bytes, u),
        );
        println!(
            "{:>10} {:>6} {:>12.2} {:>12.2} {:>12.2} {:>8.0}% {:>12.2} {:>8.0}%",
            format!("{} KiB", state >> 10),
            batch,
            gc,
            gm,
            gd,
            100.0 * gd / gc,
            gu,
            100.0 * gu / gc
        );
    }
}
