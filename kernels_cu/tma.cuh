// Hopper's tensor memory accelerator (TMA) and the shared-memory barriers its copies complete
// on (sm_90+).
//
// A TensorMap describes a global tensor (up to 5 dims, 16-byte aligned strides) and a box
// shape; the host encodes it (flashcupy/cuda/tensor_map.py, cuTensorMapEncodeTiled) and passes
// it as a __grid_constant__ kernel parameter. One thread's copy moves a whole box into shared
// memory, zero-filling the part outside the tensor, and counts its bytes against an mbarrier's
// transaction count; the threads that read the box wait on that barrier's phase. With the
// 128-byte swizzle, chunk c (16 bytes) of box row r lands at chunk c ^ (r % 8) of the row's
// 128 bytes (the box 1024-byte aligned), so 8 consecutive rows read at one column fall in
// distinct banks.
#pragma once

#include "params.cuh"

namespace flash {

// cuTensorMapEncodeTiled's opaque 128-byte descriptor.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ u32 shared_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// A barrier whose phase completes after `count` arrivals and the bytes it was told to expect.
__device__ __forceinline__ void mbarrier_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes initialised barriers visible to the async proxy (the tensor copies) and the block.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also raises the phase's expected transaction bytes.
__device__ __forceinline__ void mbarrier_arrive_expect(u32 bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// An arrival once this thread's earlier cp.async copies have landed (the pending count is
// raised first, so the barrier's expected arrivals do not change).
__device__ __forceinline__ void cp_async_mbarrier_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(u32 bar, int parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

// Orders this thread's earlier shared-memory accesses (generic proxy: loads, cp.async) before
// later tensor copies into the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Starts fetching a tensor map (a __grid_constant__ parameter) into the TMA unit's cache, so the
// first copy through it does not wait for the descriptor as well as for its data.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// The box at coordinates (c0, c1, c2, c3) (innermost first, elements) of a 4-d tensor map
// into shared memory at dst, its bytes counted on barrier bar.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

#endif  // sm_90+

}  // namespace flash
