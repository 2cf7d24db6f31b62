//! Snapshot operations on the GPU: a validated [`CopyBatch`] runs as one kernel
//! launch over every (pair, plane), with the same semantics as the host
//! [`crate::snapshot::StateArena`].
//!
//! The kernel source (`kernels/snapshot.cu`) is embedded in the crate and
//! compiled at run time with NVRTC for the device's architecture. Where libnvrtc
//! is absent, the checked-in PTX (`kernels/snapshot.ptx`, the same source
//! compiled for compute_70) is loaded instead and JIT-compiled by the driver.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys};
use cudarc::nvrtc;

use super::{CallContext, CudaError, Device, DeviceBuffer, Stream};
use crate::snapshot::{CopyBatch, SnapshotBackend, SnapshotError};

/// CUDA source of the snapshot kernel.
pub const SNAPSHOT_CU: &str = include_str!("../../kernels/snapshot.cu");

/// [`SNAPSHOT_CU`] compiled to PTX for compute_70, loaded when NVRTC is absent.
pub const SNAPSHOT_PTX: &str = include_str!("../../kernels/snapshot.ptx");

/// Entry point of the copy kernel.
pub const COPY_KERNEL: &str = "marconi_snapshot_copy";

const BLOCK_THREADS: u32 = 256;
/// Grid y limit of the driver.
const MAX_GRID_Y: u64 = 65_535;
/// Enough blocks along x to keep every SM busy on one large slot.
const MAX_GRID_X: u64 = 1024;

/// Whether libnvrtc can be loaded. cudarc panics on first use otherwise.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library names cudarc would use.
    unsafe { nvrtc::sys::is_culib_present() }
}

/// Compiles [`SNAPSHOT_CU`] to PTX with NVRTC for `arch` (`"compute_90"`, ...).
/// Needs libnvrtc, no driver and no GPU.
///
/// # Errors
/// [`CudaError::Kernel`] when NVRTC is absent or compilation fails (with its log).
pub fn compile_ptx(arch: &str) -> Result<String, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::Kernel(
            "libnvrtc not found by the dynamic loader".into(),
        ));
    }
    let opts = nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some("snapshot.cu".into()),
        ..Default::default()
    };
    let ptx = nvrtc::compile_ptx_with_opts(SNAPSHOT_CU, opts)
        .map_err(|e| CudaError::Kernel(format!("NVRTC failed for {arch}: {e:?}")))?;
    Ok(ptx.to_src())
}

/// Where the loaded kernel came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelSource {
    /// Compiled by NVRTC for this architecture.
    Nvrtc(String),
    /// The checked-in compute_70 PTX, JIT-compiled by the driver.
    CheckedInPtx,
}

/// The snapshot kernel loaded into a device's context. Unloaded on drop.
#[derive(Debug)]
pub struct SnapshotKernels {
    device: Arc<Device>,
    module: sys::CUmodule,
    copy: sys::CUfunction,
    source: KernelSource,
}

// SAFETY: module and function handles are usable from any thread of their
// context; every use binds the context first.
unsafe impl Send for SnapshotKernels {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for SnapshotKernels {}

impl SnapshotKernels {
    /// Loads the kernel: NVRTC for the device's compute capability when libnvrtc
    /// is present, the checked-in PTX otherwise or when the NVRTC build cannot be
    /// compiled or loaded ([`SnapshotKernels::source`] says which).
    ///
    /// # Errors
    /// Driver failures loading the checked-in PTX.
    pub fn load(device: &Arc<Device>) -> Result<Arc<Self>, CudaError> {
        if !nvrtc_available() {
            return Self::load_checked_in(device);
        }
        let (major, minor) = device.compute_capability()?;
        let arch = format!("compute_{major}{minor}");
        // An NVRTC newer than the driver emits PTX the driver cannot JIT, and an
        // older one may not know the architecture: fall back to the checked-in
        // compute_70 PTX then, rather than failing.
        let nvrtc = compile_ptx(&arch)
            .and_then(|ptx| Self::load_ptx(device, &ptx, KernelSource::Nvrtc(arch.clone())));
        nvrtc.or_else(|e| {
            tracing::warn!("NVRTC kernel for {arch} unusable ({e}); loading the checked-in PTX");
            Self::load_checked_in(device)
        })
    }

    /// Loads the checked-in PTX, whether or not NVRTC is present.
    ///
    /// # Errors
    /// Driver failures loading the module.
    pub fn load_checked_in(device: &Arc<Device>) -> Result<Arc<Self>, CudaError> {
        Self::load_ptx(device, SNAPSHOT_PTX, KernelSource::CheckedInPtx)
    }

    fn load_ptx(
        device: &Arc<Device>,
        ptx: &str,
        source: KernelSource,
    ) -> Result<Arc<Self>, CudaError> {
        let image =
            CString::new(ptx).map_err(|_| CudaError::Kernel("PTX contains a NUL byte".into()))?;
        device.bind()?;
        // SAFETY: `image` is a NUL-terminated PTX text that outlives the call.
        let module =
            unsafe { result::module::load_data(image.as_ptr().cast()) }.call("cuModuleLoadData")?;
        let name = CString::new(COPY_KERNEL).expect("kernel name has no NUL");
        // SAFETY: `module` was just loaded.
        let copy = match unsafe { result::module::get_function(module, name) } {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: loaded above, unloaded once.
                let _ = unsafe { result::module::unload(module) };
                return Err(CudaError::Driver {
                    call: "cuModuleGetFunction",
                    error: e,
                });
            }
        };
        Ok(Arc::new(Self {
            device: Arc::clone(device),
            module,
            copy,
            source,
        }))
    }

    /// Where the kernel came from.
    pub fn source(&self) -> &KernelSource {
        &self.source
    }
}

impl Drop for SnapshotKernels {
    fn drop(&mut self) {
        // Launches may still be queued on some stream.
        if let Err(e) = self.device.synchronize() {
            tracing::error!("synchronise before cuModuleUnload failed: {e}");
        }
        // SAFETY: loaded in `load_ptx`, unloaded once, no work pending.
        if let Err(e) = unsafe { result::module::unload(self.module) } {
            tracing::error!("cuModuleUnload failed: {e}");
        }
    }
}

/// One plane of device state slots: slot `s` is the `slot_bytes` bytes at
/// `base + s * slot_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePlane {
    /// Device address of slot 0.
    pub base: sys::CUdeviceptr,
    /// Bytes per slot in this plane.
    pub slot_bytes: usize,
}

/// Device twin of [`crate::snapshot::StateArena`]: slots over device planes
/// (a pool mapping, a layer-major state tensor, ...), copied by one kernel launch
/// per batch on the arena's stream.
///
/// [`SnapshotBackend::copy`] returns once the copy is *ordered* on the stream
/// (like any CUDA launch); call [`CudaStateArena::synchronize`] or order later
/// work on the same stream.
#[derive(Debug)]
pub struct CudaStateArena {
    kernels: Arc<SnapshotKernels>,
    stream: Arc<Stream>,
    planes: Vec<DevicePlane>,
    slots: u32,
    /// `[bases..., slot_bytes...]` as u64, uploaded once.
    plane_table: DeviceBuffer,
    /// Interleaved `(src, dst)` u32 pairs of the current batch; grown on demand.
    pairs: Option<DeviceBuffer>,
}

impl CudaStateArena {
    /// An arena over `planes`, each holding `slots` slots.
    ///
    /// # Errors
    /// [`SnapshotError::InvalidLayout`] (as [`CudaError::Snapshot`]) for no plane,
    /// zero slots or slot sizes, overflowing or overlapping planes; driver failures
    /// uploading the plane table.
    ///
    /// # Safety
    /// Each plane's `slots * slot_bytes` bytes are device memory of the kernels'
    /// context that stays mapped and readable/writable for as long as the arena
    /// lives, and nothing else writes them while a batch may run.
    pub unsafe fn new(
        kernels: &Arc<SnapshotKernels>,
        stream: &Arc<Stream>,
        planes: Vec<DevicePlane>,
        slots: u32,
    ) -> Result<Self, CudaError> {
        let layout = |m: String| CudaError::Snapshot(SnapshotError::InvalidLayout(m));
        if planes.is_empty() || slots == 0 {
            return Err(layout(format!("{} planes of {slots} slots", planes.len())));
        }
        let mut ranges = Vec::with_capacity(planes.len());
        for (i, p) in planes.iter().enumerate() {
            let len = (p.slot_bytes as u64)
                .checked_mul(u64::from(slots))
                .filter(|&l| l > 0)
                .filter(|&l| p.base.checked_add(l).is_some())
                .ok_or_else(|| {
                    layout(format!(
                        "plane {i}: {slots} slots of {} bytes",
                        p.slot_bytes
                    ))
                })?;
            if p.base == 0 {
                return Err(layout(format!("plane {i}: null base")));
            }
            ranges.push((p.base, len, i));
        }
        ranges.sort_unstable();
        if let Some(w) = ranges.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(layout(format!("planes {} and {} overlap", w[0].2, w[1].2)));
        }
        let mut table: Vec<u8> = Vec::with_capacity(planes.len() * 16);
        for p in &planes {
            table.extend_from_slice(&p.base.to_ne_bytes());
        }
        for p in &planes {
            table.extend_from_slice(&(p.slot_bytes as u64).to_ne_bytes());
        }
        let plane_table = DeviceBuffer::new(&kernels.device, table.len())?;
        plane_table.upload(&table)?;
        Ok(Self {
            kernels: Arc::clone(kernels),
            stream: Arc::clone(stream),
            planes,
            slots,
            plane_table,
            pairs: None,
        })
    }

    /// The planes.
    pub fn planes(&self) -> &[DevicePlane] {
        &self.planes
    }

    /// Waits for every batch ordered so far.
    ///
    /// # Errors
    /// Driver failure (including a failed kernel).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize()
    }

    /// Grid for a batch: x covers the largest slot's 16-byte words (about four per
    /// thread), y the (pair, plane) items.
    fn grid(&self, items: u64) -> (u32, u32, u32) {
        let max_words = self
            .planes
            .iter()
            .map(|p| (p.slot_bytes as u64).div_ceil(16))
            .max()
            .unwrap_or(1);
        let x = max_words
            .div_ceil(u64::from(BLOCK_THREADS) * 4)
            .clamp(1, MAX_GRID_X);
        let y = items.clamp(1, MAX_GRID_Y);
        (x as u32, y as u32, 1)
    }
}

impl SnapshotBackend for CudaStateArena {
    type Error = CudaError;

    fn slots(&self) -> u32 {
        self.slots
    }

    fn slot_bytes(&self) -> usize {
        self.planes.iter().map(|p| p.slot_bytes).sum()
    }

    /// Uploads the pair list and launches the copy kernel once on the arena's
    /// stream; returns when the copy is ordered, not done.
    fn copy(&mut self, batch: &CopyBatch) -> Result<(), CudaError> {
        if batch.slots() > self.slots {
            return Err(SnapshotError::ArenaMismatch {
                batch_slots: batch.slots(),
                arena_slots: self.slots,
            }
            .into());
        }
        if batch.is_empty() {
            return Ok(());
        }
        let n_pairs = u32::try_from(batch.len())
            .ok()
            .filter(|&n| n < u32::MAX / 2)
            .ok_or_else(|| {
                CudaError::InvalidArgument(format!("{} pairs in one batch", batch.len()))
            })?;
        let mut words: Vec<u8> = Vec::with_capacity(batch.len() * 8);
        for p in batch.pairs() {
            words.extend_from_slice(&p.src.to_ne_bytes());
            words.extend_from_slice(&p.dst.to_ne_bytes());
        }
        let device = Arc::clone(&self.kernels.device);
        if self.pairs.as_ref().is_none_or(|b| b.len() < words.len()) {
            // Dropping the old buffer waits for the launches that read it.
            self.pairs = None;
            self.pairs = Some(DeviceBuffer::new(&device, words.len().next_power_of_two())?);
        }
        let pairs = self.pairs.as_ref().expect("allocated above");
        device.bind()?;
        // SAFETY: the buffer is live and large enough. Ordered on our stream, the
        // upload waits for earlier launches that read the buffer; from pageable
        // memory the call returns once `words` has been staged, so dropping
        // `words` afterwards is fine.
        unsafe { result::memcpy_htod_async(pairs.ptr(), &words, self.stream.raw()) }
            .call("cuMemcpyHtoDAsync")?;
        let mut plane_base = self.plane_table.ptr();
        let mut plane_bytes = self.plane_table.ptr() + 8 * self.planes.len() as u64;
        let mut n_planes = self.planes.len() as u32;
        let mut pairs_ptr = pairs.ptr();
        let mut n = n_pairs;
        let mut params: [*mut c_void; 5] = [
            (&mut plane_base as *mut u64).cast(),
            (&mut plane_bytes as *mut u64).cast(),
            (&mut n_planes as *mut u32).cast(),
            (&mut pairs_ptr as *mut u64).cast(),
            (&mut n as *mut u32).cast(),
        ];
        let grid = self.grid(u64::from(n_pairs) * u64::from(n_planes));
        // SAFETY: the function is live (the module is held by `kernels`); the
        // parameters match the kernel's signature (u64, u64, u32, u64, u32) and are
        // read at launch; the tables and planes are live device memory of this
        // context; the batch was validated against at most `self.slots` slots, so
        // every slot address is inside its plane and no byte is written twice or
        // both read and written.
        unsafe {
            result::launch_kernel(
                self.kernels.copy,
                grid,
                (BLOCK_THREADS, 1, 1),
                0,
                self.stream.raw(),
                &mut params,
            )
        }
        .call("cuLaunchKernel")
    }
}
