//! Thin checked wrappers over the CUDA driver's virtual memory management calls,
//! in the style of `cudarc::driver::result`: one function per driver call, the
//! `CUresult` turned into a `Result`, out-parameters returned by value, nothing
//! else. cudarc exposes these calls only as raw `driver::sys` functions.
//!
//! Every function here is `unsafe`: the driver must be loaded and initialised
//! (see [`super::Device`]), a context must be current on the calling thread, and
//! the handles and addresses passed must be live. The RAII types of
//! [`super::vmm`] uphold this; prefer them.

use std::mem::MaybeUninit;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

/// Allocation properties for pinned device memory on device `ordinal`, no
/// exportable handle: what `cuMemCreate` and `cuMemGetAllocationGranularity`
/// take.
pub fn device_allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Read-write access for device `ordinal`: what `cuMemSetAccess` takes after every
/// `cuMemMap`.
pub fn device_read_write(ordinal: i32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// `cuMemGetAllocationGranularity`: the size and alignment unit of physical
/// chunks and mappings for `prop` (2 MiB on current GPUs).
///
/// # Safety
/// The driver is initialised.
pub unsafe fn get_allocation_granularity(
    prop: &sys::CUmemAllocationProp,
    option: sys::CUmemAllocationGranularity_flags,
) -> Result<usize, DriverError> {
    let mut granularity = MaybeUninit::uninit();
    sys::cuMemGetAllocationGranularity(granularity.as_mut_ptr(), prop, option).result()?;
    Ok(granularity.assume_init())
}

/// `cuMemAddressReserve`: reserves `size` bytes of device virtual address space
/// aligned to `alignment` (0 for the default), no memory behind it.
///
/// # Safety
/// A context is current; `size` is a multiple of the granularity. The range must
/// be given back with [`address_free`] once nothing is mapped in it.
pub unsafe fn address_reserve(
    size: usize,
    alignment: usize,
) -> Result<sys::CUdeviceptr, DriverError> {
    let mut ptr = MaybeUninit::uninit();
    sys::cuMemAddressReserve(ptr.as_mut_ptr(), size, alignment, 0, 0).result()?;
    Ok(ptr.assume_init())
}

/// `cuMemAddressFree`: gives back a reserved range.
///
/// # Safety
/// `(ptr, size)` is exactly a range returned by [`address_reserve`], nothing is
/// mapped in it any more, and it is not freed twice.
pub unsafe fn address_free(ptr: sys::CUdeviceptr, size: usize) -> Result<(), DriverError> {
    sys::cuMemAddressFree(ptr, size).result()
}

/// `cuMemCreate`: creates `size` bytes of physical memory (the slow call, about
/// 200 µs per 2 MiB: create chunks ahead of time).
///
/// # Safety
/// A context is current; `size` is a multiple of the granularity for `prop`. The
/// handle must be released with [`release`].
pub unsafe fn create(
    size: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle, DriverError> {
    let mut handle = MaybeUninit::uninit();
    sys::cuMemCreate(handle.as_mut_ptr(), size, prop, 0).result()?;
    Ok(handle.assume_init())
}

/// `cuMemRelease`: drops the caller's reference to a physical allocation; the
/// memory is freed once no mapping refers to it either.
///
/// # Safety
/// `handle` came from [`create`] and is not released twice.
pub unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> Result<(), DriverError> {
    sys::cuMemRelease(handle).result()
}

/// `cuMemMap`: maps `size` bytes of `handle`, from `offset` in it, at `ptr`.
/// The range is not accessible until [`set_access`] is called on it.
///
/// # Safety
/// `[ptr, ptr + size)` lies inside a live reservation and is not mapped;
/// `offset + size` fits in the allocation; all granularity-aligned.
pub unsafe fn map(
    ptr: sys::CUdeviceptr,
    size: usize,
    offset: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), DriverError> {
    sys::cuMemMap(ptr, size, offset, handle, 0).result()
}

/// `cuMemSetAccess`: sets the access rights of a mapped range.
///
/// # Safety
/// `[ptr, ptr + size)` is fully mapped.
pub unsafe fn set_access(
    ptr: sys::CUdeviceptr,
    size: usize,
    desc: &[sys::CUmemAccessDesc],
) -> Result<(), DriverError> {
    sys::cuMemSetAccess(ptr, size, desc.as_ptr(), desc.len()).result()
}

/// `cuMemUnmap`: unmaps a range. Synchronous, and it must cover whole mappings.
///
/// # Safety
/// `[ptr, ptr + size)` covers exactly mappings made by [`map`], and no work
/// still queued on any stream touches it.
pub unsafe fn unmap(ptr: sys::CUdeviceptr, size: usize) -> Result<(), DriverError> {
    sys::cuMemUnmap(ptr, size).result()
}
