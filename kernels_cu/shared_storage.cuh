// Shared-memory tile layouts, and where a kernel's SharedStorage starts in dynamic shared
// memory.
//
// A kernel declares its shared memory as a SharedStorage struct of tiles (arrays of ELEMS
// elements each) and takes the byte count the host launches it with as a template argument,
// checked against sizeof(SharedStorage) (plus the alignment slack of swizzled tiles) by
// static_assert: a host that computes another size fails to compile, in CI's NVRTC check.
#pragma once

#include "copy.cuh"

namespace flash {

// A (ROWS, COLS) tile with rows padded by one 16-byte chunk (row pitch LD elements), so
// that ldmatrix's and scalar loads' 8 rows fall on distinct banks.
template <typename T, int ROWS, int COLS>
struct PaddedTile {
    using Element = T;
    static constexpr int LD = COLS + 16 / sizeof(T);
    static constexpr int ELEMS = ROWS * LD;

    // Byte offset of the 16-byte chunk c of row r.
    static __device__ __forceinline__ int chunk_offset(int r, int c) { return r * LD * int(sizeof(T)) + 16 * c; }

    template <int THREADS>
    static __device__ __forceinline__ void load(T* smem, const T* gmem, i64 stride, int valid_rows, int valid_cols) {
        load_tile<T, ROWS, COLS, LD, THREADS>(smem, gmem, stride, valid_rows, valid_cols);
    }
};

// A (ROWS, COLS) tile in slabs of 128-byte rows (64 two-byte or 32 four-byte columns)
// with the 128-byte swizzle. The tile's base must be 1024-byte aligned (the swizzle
// pattern repeats every 8 rows).
template <typename T, int ROWS, int COLS>
struct Sw128Tile {
    using Element = T;
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "128-byte rows of 64 two-byte or 32 four-byte elements");
    static constexpr int SLAB_COLS = 128 / sizeof(T);
    static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte chunk
    static_assert(COLS % SLAB_COLS == 0 && ROWS % 8 == 0, "whole slabs of whole 8-row swizzle atoms");
    static constexpr int SLAB_BYTES = ROWS * 128;
    static constexpr int ELEMS = ROWS * COLS;

    // Element offset of column c, a multiple of SLAB_COLS: the start of its slab, from which
    // the columns to the right form again an Sw128 tile of ROWS rows.
    static __host__ __device__ constexpr int column(int c) { return c * ROWS; }

    // Byte offset of the 16-byte chunk c (columns VEC c .. VEC c + VEC - 1) of row r.
    static __device__ __forceinline__ int chunk_offset(int r, int c) {
        return (c >> 3) * SLAB_BYTES + r * 128 + (((c & 7) ^ (r & 7)) << 4);
    }

    // Rows [0, ROWS) of a (rows, cols) global matrix (row stride `stride` elements), zero
    // outside (valid_rows, valid_cols), as cp.async 16-byte chunks by THREADS threads, thread
    // `tid` (threadIdx.x unless the block has other warps): copy_chunks.
    template <int THREADS>
    static __device__ __forceinline__ void load(T* smem, const T* gmem, i64 stride, int valid_rows, int valid_cols,
                                                u32 tid = threadIdx.x) {
        unsigned char* base = reinterpret_cast<unsigned char*>(smem);
        copy_chunks<T, ROWS, COLS / VEC, THREADS>(gmem, stride, valid_rows, valid_cols,
                                                  [base](int r, int c) { return base + chunk_offset(r, c); }, tid);
    }
};

// The shared-memory layout of a policy's operand tiles: swizzled for warpgroup products,
// rows padded by 16 bytes for the warp policies' ldmatrix.
template <bool SWIZZLED> struct TileKind {
    template <typename T, int ROWS, int COLS> using type = PaddedTile<T, ROWS, COLS>;
};
template <> struct TileKind<true> {
    template <typename T, int ROWS, int COLS> using type = Sw128Tile<T, ROWS, COLS>;
};

// The start of a kernel's tiles in dynamic shared memory: swizzled tiles on a 1024-byte
// boundary (the swizzle pattern repeats every 8 rows of 128 bytes; the host adds 1024 bytes
// of slack), padded ones where the block's shared memory begins.
template <bool SWIZZLED>
__device__ __forceinline__ unsigned char* tiles_base(unsigned char* smem) {
    return smem + (SWIZZLED ? (1024 - (static_cast<u32>(__cvta_generic_to_shared(smem)) & 1023)) & 1023 : 0);
}

// The bytes of dynamic shared memory a kernel whose SharedStorage is `storage_bytes` long
// needs: swizzled tiles add 1024 bytes of slack for tiles_base's alignment.
template <bool SWIZZLED> __host__ __device__ constexpr int smem_bytes(int storage_bytes) { return storage_bytes + (SWIZZLED ? 1024 : 0); }

}  // namespace flash
