// State snapshot copy kernel of libmarconi (marconi-gpu/src/cuda/snapshot.rs).
//
// One launch runs a whole validated copy batch: every (src, dst) slot pair in
// every plane. Slot s of plane p is plane_slot_bytes[p] bytes at
// plane_base[p] + s * plane_slot_bytes[p]. The host validated the batch (slots in
// range, no slot written twice, no slot both read and written), so the copies
// are independent and may run in any order.
//
// Grid: blockIdx.y strides over (pair, plane) items, the x dimension strides
// over the item's 16-byte words (bytes when a plane is not 16-byte aligned).
//
// Compiled at run time with NVRTC; kernels/snapshot.ptx is this file compiled
// for compute_70 and is loaded when NVRTC is absent.

extern "C" __global__ void marconi_snapshot_copy(
    const unsigned long long* __restrict__ plane_base,
    const unsigned long long* __restrict__ plane_slot_bytes,
    unsigned int n_planes,
    const unsigned int* __restrict__ pairs,
    unsigned int n_pairs)
{
    const unsigned long long items = (unsigned long long)n_pairs * n_planes;
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long nthreads = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long item = blockIdx.y; item < items; item += gridDim.y) {
        const unsigned int pair = (unsigned int)(item / n_planes);
        const unsigned int plane = (unsigned int)(item % n_planes);
        const unsigned long long bytes = plane_slot_bytes[plane];
        const unsigned long long base = plane_base[plane];
        const unsigned long long src = base + (unsigned long long)pairs[2 * pair] * bytes;
        const unsigned long long dst = base + (unsigned long long)pairs[2 * pair + 1] * bytes;
        if (((base | bytes) & 15ull) == 0) {
            const uint4* s = (const uint4*)src;
            uint4* d = (uint4*)dst;
            const unsigned long long words = bytes >> 4;
            for (unsigned long long w = tid; w < words; w += nthreads) {
                d[w] = s[w];
            }
        } else {
            const unsigned char* s = (const unsigned char*)src;
            unsigned char* d = (unsigned char*)dst;
            for (unsigned long long b = tid; b < bytes; b += nthreads) {
                d[b] = s[b];
            }
        }
    }
}
