// Global -> shared tile copies for the attention kernels, and the named barriers that hand
// shared-memory tiles between warps.
//
// A tile is ROWS rows of COLS elements (COLS = the kernel's padded head dim) stored
// with a row pitch of LD elements. Rows >= valid_rows and columns >= valid_cols are
// zero-filled, so padded head dims and partial tiles contribute exact zeros to every
// product. The host guarantees 16-byte aligned rows (pointers, strides and stored head
// dims; misaligned inputs are copied once into padded buffers), so every chunk of 16
// bytes is either all valid or all padding and goes through cp.async (sm_80+,
// asynchronous, zero-fill by src-size 0) or a 16-byte load.
#pragma once

#include "params.cuh"


namespace flash {

// The first `bytes` (0 to 16) bytes of a 16-byte chunk from src to dst (both 16-byte
// aligned), the rest of dst's 16 zero-filled; src is not read when bytes is 0.
__device__ __forceinline__ void cp_async_16_partial(void* dst, const void* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 d = static_cast<u32>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
#else
    if (bytes == 16) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
        for (int b = 0; b < 16; ++b)
            static_cast<unsigned char*>(dst)[b] = b < bytes ? static_cast<const unsigned char*>(src)[b] : 0;
    }
#endif
}

// A 16-byte chunk, or 16 zero bytes where !valid (src-size 0: nothing is read). The
// operand tiles' copy, written out rather than through cp_async_16_partial: the plain
// kernels keep the instruction order they were measured with.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 d = static_cast<u32>(__cvta_generic_to_shared(dst));
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
#else
    *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

// One 4- or 8-byte element (per-row statistics such as lse), zero when !valid.
template <typename E>
__device__ __forceinline__ void cp_async_elem(E* dst, const E* src, bool valid) {
    static_assert(sizeof(E) == 4 || sizeof(E) == 8, "cp.async.ca copies 4 or 8 bytes here");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 d = static_cast<u32>(__cvta_generic_to_shared(dst));
    const int bytes = valid ? static_cast<int>(sizeof(E)) : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(sizeof(E)), "r"(bytes));
#else
    *dst = valid ? *src : E(0);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    // The clobber keeps the compiler from moving shared-memory reads of the copies above it.
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Named barrier `id` (1 to 15; 0 is __syncthreads') of `threads` threads, a multiple of 32:
// arrive signals without waiting, sync waits for all. The shared-memory writes a thread made
// before arriving are visible to the threads that sync on the barrier (PTX's bar semantics).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Copies the 16-byte chunks [0, CHUNKS) of rows [0, ROWS) of a global matrix (row stride
// `stride` elements) to shared memory, chunk c of row r at dst(r, c), zero-filling outside
// (valid_rows, valid_cols). All THREADS threads call it, thread `tid` in [0, THREADS)
// (threadIdx.x unless the block has other warps). Where THREADS is a multiple of CHUNKS
// (kStridedChunks), thread tid copies chunk tid % CHUNKS of the rows tid / CHUNKS + STEP k,
// STEP = THREADS / CHUNKS, in a fully unrolled loop: no division, and addresses a fixed
// stride apart (per tile, these copies are otherwise a large share of a Hopper kernel's
// instructions). float64 keeps the rolled loop: its kernels are at the register limit, and
// the unrolled one spills there.
template <typename T, int ROWS, int CHUNKS, int THREADS>
constexpr bool kStridedChunks = sizeof(T) < 8 && THREADS % CHUNKS == 0 && ROWS % (THREADS / CHUNKS) == 0;

template <typename T, int ROWS, int CHUNKS, int THREADS, typename Dst>
__device__ __forceinline__ void copy_chunks(const T* gmem, i64 stride, int valid_rows, int valid_cols, Dst dst,
                                            u32 tid = threadIdx.x) {
    constexpr int VEC = 16 / sizeof(T);
    if constexpr (kStridedChunks<T, ROWS, CHUNKS, THREADS>) {
        constexpr int STEP = THREADS / CHUNKS;
        const int c = tid % CHUNKS, r0 = tid / CHUNKS;
        const bool col_valid = c * VEC < valid_cols;
        const T* src = gmem + r0 * stride + c * VEC;
#pragma unroll
        for (int k = 0; k < ROWS / STEP; ++k) {
            const bool valid = col_valid && r0 + k * STEP < valid_rows;
            cp_async_16(dst(r0 + k * STEP, c), valid ? src + k * STEP * stride : gmem, valid);
        }
    } else {
#pragma unroll 4
        for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool valid = r < valid_rows && c * VEC < valid_cols;
            cp_async_16(dst(r, c), valid ? gmem + r * stride + c * VEC : gmem, valid);
        }
    }
}

// Copy rows [0, ROWS) of a (rows, cols) global matrix with row stride `stride` (elements)
// into shared memory with row pitch LD, zero-filling outside (valid_rows, valid_cols).
template <typename T, int ROWS, int COLS, int LD, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, i64 stride, int valid_rows, int valid_cols) {
    constexpr int VEC = 16 / sizeof(T);
    static_assert(COLS % VEC == 0, "tile width is a whole number of 16-byte chunks");
    copy_chunks<T, ROWS, COLS / VEC, THREADS>(gmem, stride, valid_rows, valid_cols,
                                              [smem](int r, int c) { return smem + r * LD + c * VEC; });
}

// row[col] = a and row[col + 1] = b, converted to T, each only below cols: one store of
// both where `paired` (the row's even columns start pairs aligned for a two-element store)
// and both land, else one store each. Output rows leave the kernels this way: a warp's
// 2-byte stores to 8 rows would reach each 32-byte sector in pieces, which shows at short
// sequences (bench/NOTES.md, 'Output stores in pairs').
template <typename T, typename Acc>
__device__ __forceinline__ void store_pair(T* row, int col, int cols, Acc a, Acc b, bool paired) {
    struct alignas(2 * sizeof(T)) Two {
        T x, y;
    };
    if (paired && col + 1 < cols) {
        *reinterpret_cast<Two*>(row + col) = Two{static_cast<T>(a), static_cast<T>(b)};
    } else {
        if (col < cols) row[col] = static_cast<T>(a);
        if (col + 1 < cols) row[col + 1] = static_cast<T>(b);
    }
}


}  // namespace flash
