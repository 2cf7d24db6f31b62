//! CUDA backend (feature `cuda`): the physical-memory trait over the driver's
//! virtual memory API, and the snapshot operations as one kernel launch per batch.
//!
//! Layering follows cudarc's:
//!
//! - [`driver`]: one thin checked wrapper per virtual-memory driver call
//!   (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`,
//!   `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`,
//!   `cuMemGetAllocationGranularity`), which cudarc exposes only as raw `sys`
//!   functions. Other calls use `cudarc::driver::result` directly.
//! - RAII types that undo themselves on drop: [`Device`] (a retained primary
//!   context), [`Stream`], [`DeviceBuffer`], and in [`vmm`] the
//!   [`vmm::Reservation`], [`vmm::PhysicalChunk`] and [`vmm::Mapping`].
//! - [`phys::CudaPhysical`]: [`crate::phys::PhysicalMemory`] on top of them.
//! - [`snapshot`]: the copy kernel (NVRTC, or the checked-in PTX) and
//!   [`snapshot::CudaStateArena`], the device twin of
//!   [`crate::snapshot::StateArena`].
//!
//! cudarc is built with `dynamic-loading`: the crate compiles and links without a
//! CUDA toolkit or driver, and libcuda / libnvrtc are opened at first use. cudarc
//! panics when a library is missing, so every entry point here checks
//! [`driver_available`] (or [`snapshot::nvrtc_available`]) first and returns
//! [`CudaError::NoDriver`] instead.

pub mod driver;
pub mod phys;
pub mod snapshot;
pub mod vmm;

use std::sync::{Arc, OnceLock};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use crate::snapshot::SnapshotError;

/// Failures of the CUDA backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// libcuda cannot be loaded or initialised, or there is no such device: no
    /// GPU path can run on this machine.
    #[error("no usable CUDA driver: {0}")]
    NoDriver(String),
    /// A driver call failed.
    #[error("{call} failed: {error}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// What it returned.
        error: DriverError,
    },
    /// No kernel could be built: NVRTC is absent or failed, and the fallback
    /// could not be loaded either.
    #[error("snapshot kernel unavailable: {0}")]
    Kernel(String),
    /// A snapshot batch or layout was refused before anything ran.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// An argument the driver would reject (unaligned size, range outside a
    /// reservation, range already mapped, ...), caught before calling it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Tags a driver result with the name of the call, for [`CudaError::Driver`].
pub(crate) trait CallContext<T> {
    fn call(self, call: &'static str) -> Result<T, CudaError>;
}

impl<T> CallContext<T> for Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T, CudaError> {
        self.map_err(|error| CudaError::Driver { call, error })
    }
}

/// Checks that libcuda can be loaded and `cuInit` succeeds (once per process).
/// Call before anything else in this module: without libcuda, cudarc panics.
///
/// # Errors
/// [`CudaError::NoDriver`] saying which step failed.
pub fn driver_available() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen the library names cudarc would use.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoDriver(
                "libcuda.so (or libcuda.so.1) not found by the dynamic loader".into(),
            ));
        }
        result::init().map_err(|e| CudaError::NoDriver(format!("cuInit failed: {e}")))
    })
    .clone()
}

/// A GPU with its primary context retained: every other RAII type holds an
/// `Arc<Device>`, so the context outlives all memory made in it.
#[derive(Debug)]
pub struct Device {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context may be used from any thread; every call that needs it
// makes it current on the calling thread first (`bind`).
unsafe impl Send for Device {}
// SAFETY: as above; `Device` has no interior state besides driver handles.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `ordinal` and retains its primary context (the one the CUDA
    /// runtime and most engines use, so memory made here is usable by them).
    ///
    /// # Errors
    /// [`CudaError::NoDriver`] when there is no driver or no such device;
    /// driver failures.
    pub fn open(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        driver_available()?;
        let count = result::device::get_count().call("cuDeviceGetCount")?;
        let ordinal = i32::try_from(ordinal)
            .ok()
            .filter(|&o| o < count)
            .ok_or_else(|| {
                CudaError::NoDriver(format!("device {ordinal} requested, {count} present"))
            })?;
        let dev = result::device::get(ordinal).call("cuDeviceGet")?;
        // SAFETY: `dev` was just returned by cuDeviceGet.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.call("cuDevicePrimaryCtxRetain")?;
        let device = Self { ordinal, dev, ctx };
        device.bind()?;
        Ok(Arc::new(device))
    }

    /// Makes this device's context current on the calling thread.
    ///
    /// # Errors
    /// Driver failure.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is retained until drop.
        unsafe { result::ctx::set_current(self.ctx) }.call("cuCtxSetCurrent")
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Compute capability `(major, minor)`.
    ///
    /// # Errors
    /// Driver failure.
    pub fn compute_capability(&self) -> Result<(i32, i32), CudaError> {
        use sys::CUdevice_attribute::*;
        // SAFETY: `dev` came from cuDeviceGet.
        let major = unsafe {
            result::device::get_attribute(self.dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        }
        .call("cuDeviceGetAttribute")?;
        // SAFETY: as above.
        let minor = unsafe {
            result::device::get_attribute(self.dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        }
        .call("cuDeviceGetAttribute")?;
        Ok((major, minor))
    }

    /// Whether the device supports the virtual memory management API.
    ///
    /// # Errors
    /// Driver failure.
    pub fn supports_vmm(&self) -> Result<bool, CudaError> {
        use sys::CUdevice_attribute::*;
        // SAFETY: `dev` came from cuDeviceGet.
        // Attribute 102, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        // in cuda.h; the bindings keep only its older alias.
        let v = unsafe {
            result::device::get_attribute(
                self.dev,
                CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            )
        }
        .call("cuDeviceGetAttribute")?;
        Ok(v != 0)
    }

    /// Name reported by the driver.
    ///
    /// # Errors
    /// Driver failure.
    pub fn name(&self) -> Result<String, CudaError> {
        result::device::get_name(self.dev).call("cuDeviceGetName")
    }

    /// Waits for all work in the context, on every stream.
    ///
    /// # Errors
    /// Driver failure (including errors of earlier asynchronous work).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        result::ctx::synchronize().call("cuCtxSynchronize")
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: `dev` came from cuDeviceGet and its primary context was
        // retained once by `open`.
        if let Err(e) = unsafe { result::primary_ctx::release(self.dev) } {
            tracing::error!("cuDevicePrimaryCtxRelease failed: {e}");
        }
    }
}

/// A non-blocking stream; synchronised and destroyed on drop.
#[derive(Debug)]
pub struct Stream {
    device: Arc<Device>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream may be used from any thread of its context; calls bind the
// context first.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream that does not synchronise with the legacy default stream.
    ///
    /// # Errors
    /// Driver failure.
    pub fn new(device: &Arc<Device>) -> Result<Self, CudaError> {
        device.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .call("cuStreamCreate")?;
        Ok(Self {
            device: Arc::clone(device),
            raw,
        })
    }

    /// Blocks until all work queued on the stream has finished.
    ///
    /// # Errors
    /// Driver failure (including errors of the queued work).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: `raw` is live until drop.
        unsafe { result::stream::synchronize(self.raw) }.call("cuStreamSynchronize")
    }

    /// The raw handle, for launching work on it.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            tracing::error!("stream synchronise before destroy failed: {e}");
        }
        // SAFETY: `raw` came from cuStreamCreate and is destroyed once, after its
        // work finished.
        if let Err(e) = unsafe { result::stream::destroy(self.raw) } {
            tracing::error!("cuStreamDestroy failed: {e}");
        }
    }
}

/// Plain device memory from `cuMemAlloc` (kernel argument tables, test and
/// benchmark buffers); freed on drop after the context is idle.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1) of device memory, 256-byte aligned.
    ///
    /// # Errors
    /// Driver failure (out of memory included).
    pub fn new(device: &Arc<Device>, bytes: usize) -> Result<Self, CudaError> {
        device.bind()?;
        // SAFETY: a context is current (bind).
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.call("cuMemAlloc")?;
        Ok(Self {
            device: Arc::clone(device),
            ptr,
            bytes,
        })
    }

    /// Device address.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `data` to the start of the buffer, synchronously.
    ///
    /// # Errors
    /// [`CudaError::InvalidArgument`] when `data` is longer than the buffer;
    /// driver failure.
    pub fn upload(&self, data: &[u8]) -> Result<(), CudaError> {
        if data.len() > self.bytes {
            return Err(CudaError::InvalidArgument(format!(
                "{} bytes into a {}-byte buffer",
                data.len(),
                self.bytes
            )));
        }
        self.device.bind()?;
        // SAFETY: the buffer is live and at least data.len() bytes long.
        unsafe { result::memcpy_htod_sync(self.ptr, data) }.call("cuMemcpyHtoD")
    }

    /// Copies the start of the buffer into `out`, synchronously.
    ///
    /// # Errors
    /// [`CudaError::InvalidArgument`] when `out` is longer than the buffer;
    /// driver failure.
    pub fn download(&self, out: &mut [u8]) -> Result<(), CudaError> {
        if out.len() > self.bytes {
            return Err(CudaError::InvalidArgument(format!(
                "{} bytes from a {}-byte buffer",
                out.len(),
                self.bytes
            )));
        }
        self.device.bind()?;
        // SAFETY: the buffer is live and at least out.len() bytes long.
        unsafe { result::memcpy_dtoh_sync(out, self.ptr) }.call("cuMemcpyDtoH")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Work queued on any stream may still use the buffer.
        if let Err(e) = self.device.synchronize() {
            tracing::error!("synchronise before cuMemFree failed: {e}");
        }
        // SAFETY: `ptr` came from cuMemAlloc, is freed once, and no work uses it.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::error!("cuMemFree failed: {e}");
        }
    }
}
