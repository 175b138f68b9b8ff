// Hopper's warpgroup products (wgmma.mma_async, sm_90a) for float16/bfloat16 attention,
// forward and backward, and (wgmma_tf32x3.cuh) for the float32 forward as 3xTF32.
//
// A warpgroup (4 consecutive warps, 128 threads) multiplies a (64, K) A operand by a (K, N)
// B operand in one instruction per k-step (16 wide for float16/bfloat16, 8 for TF32); the
// tensor cores read B, and A when it is not in registers, straight from shared memory
// through a matrix descriptor, so no ldmatrix is issued and no fragment of K or V occupies
// registers. The accumulator of warp w of the warpgroup covers rows 16 w .. 16 w + 15 in
// exactly the layout of mma.sync m16n8 (flash_mma.cuh), one (16, 8) tile after the other,
// and the A fragment from registers is m16n8k16's: the score pipeline, the online softmax
// and pack_p work unchanged.
//
// Shared memory holds every operand in the canonical 128-byte-swizzled layout (Sw128Tile):
// slabs of 128-byte rows (64 two-byte or 32 four-byte elements), whose 16-byte chunk c of
// row r sits at chunk c ^ (r % 8). The XOR spreads the 8 rows of a core matrix over all 32 banks
// for the tensor cores' reads and for the 16-byte cp.async writes alike, with no padding.
//   Q and K are K-major operands (the head dim contiguous): one descriptor per k-step,
//   8-row groups 1024 bytes apart (SBO); a k-step advances the start by 32 bytes inside
//   the slab, whose swizzle the hardware applies to the full address.
//   V is the MN-major B operand of O += P V (Dv contiguous, transposed by the instruction):
//   8-key groups 1024 bytes apart (SBO), 64-column slabs ROWS * 128 bytes apart (LBO).
// The backward uses the same tiles in both roles: its streamed Q and dO are K-major B
// operands of S^T = K Q^T and dP^T = V dO^T and MN-major ones of dK += dS^T Q and
// dV += P^T dO; dQ = dS K reads dS^T (stored key by key) and K both MN-major.
#pragma once

#include "../shared_storage.cuh"
#include "f16.cuh"

namespace flash {

// The synchronisation helpers below are declared for every architecture, so that kernels
// can name them in branches only warpgroup policies take; their instructions exist on
// sm_90a alone and compile to nothing elsewhere (MmaWgmma itself is sm_90a-only).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_SM90A_ASM(...)
#else
#define FLASH_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#endif

// Matrix descriptor of a 128-byte-swizzled operand starting at shared address `addr`.
// Fields (16-byte units): start address [0, 14), leading-dimension byte offset [16, 30),
// stride-dimension byte offset [32, 46), base offset [49, 52) = 0 (1024-byte aligned
// atoms), swizzle mode [62, 64) = 1 (128 bytes).
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
    return u64((addr & 0x3ffffu) >> 4) | u64(lbo_bytes >> 4) << 16 | u64(sbo_bytes >> 4) << 32 | u64(1) << 62;
}

// sw128_desc(addr, 16, 1024) in two 32-bit halves, for the K-major operands of the TF32
// products: a k-step's descriptor is then one 32-bit addition to the start-address field
// (offsets inside shared memory never carry out of its 14 bits). The base is made opaque
// where it is formed, so that the compiler forms each derived descriptor where a product
// uses it instead of keeping dozens of them live across the loop.
struct Sw128Desc {
    u32 lo, hi;
    __device__ __forceinline__ explicit Sw128Desc(u32 addr)
        : lo(((addr & 0x3ffffu) >> 4) | (16u >> 4) << 16), hi((1024u >> 4) | 1u << 30) {
        asm volatile("" : "+r"(lo));
    }
    __device__ __forceinline__ u64 at(u32 byte_offset) const { return u64(lo + (byte_offset >> 4)) | u64(hi) << 32; }
};

__device__ __forceinline__ void wgmma_fence() { FLASH_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { FLASH_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed groups are still running (groups
// complete in commit order).
template <int N>
__device__ __forceinline__ void wgmma_wait() { FLASH_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Shared-memory writes of this thread (cp.async included) become visible to the tensor
// cores' asynchronous reads: each writer fences, then the block's barrier follows.
__device__ __forceinline__ void fence_proxy_async() { FLASH_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The compiler sees an asynchronous product as done when its asm statement ends. These
// empty statements, placed after wgmma.wait_group, re-define each accumulator register
// (and keep each register A operand alive) there, so no read or reuse moves above the wait.
__device__ __forceinline__ void fence_reg(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_reg(u32& x) { asm volatile("" : "+r"(x)::"memory"); }
template <typename R, int N>
__device__ __forceinline__ void fence_regs(R (&regs)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) fence_reg(regs[n][e]);
}

#undef FLASH_SM90A_ASM

// Waits for the copies of every cp.async group but the newest N, for all threads of the
// block. Before a warpgroup product reads them, each thread also fences its copies to the
// tensor cores' (asynchronous) view of shared memory.
template <int N, bool WARPGROUP>
__device__ __forceinline__ void wait_tiles() {
    cp_async_wait<N>();
    if constexpr (WARPGROUP) fence_proxy_async();
    __syncthreads();
}

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Accumulator operand lists: "+f" of acc[n][e] for register i = 4 n + e.
#define FLASH_ACC(i) "+f"(acc[(i) >> 2][(i) & 3])
#define FLASH_ACC8(i) FLASH_ACC(i), FLASH_ACC(i + 1), FLASH_ACC(i + 2), FLASH_ACC(i + 3), \
                      FLASH_ACC(i + 4), FLASH_ACC(i + 5), FLASH_ACC(i + 6), FLASH_ACC(i + 7)
#define FLASH_ACC16 FLASH_ACC8(0), FLASH_ACC8(8)
#define FLASH_ACC32 FLASH_ACC8(0), FLASH_ACC8(8), FLASH_ACC8(16), FLASH_ACC8(24)
#define FLASH_ACC64 FLASH_ACC32, FLASH_ACC8(32), FLASH_ACC8(40), FLASH_ACC8(48), FLASH_ACC8(56)
#define FLASH_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FLASH_REGS32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                         \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLASH_REGS64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                         \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D (64, N) += A (64, 16) B (16, N) for one warpgroup, float32 accumulators.
//   ss: A and B from shared memory, both K-major.
//   ss_mn: A and B from shared memory, both MN-major (transposed by the instruction).
//   rs: A from registers (m16n8k16's A fragment per warp), B MN-major (transposed).
// A0..A4: the operand numbers after the N / 2 accumulators.
#define FLASH_WGMMA(N, TYPE, ACC, REGS, A0, A1, A2, A3, A4)                                           \
    static __device__ __forceinline__ void ss(float (&acc)[N / 8][4], u64 a_desc, u64 b_desc) {          \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", %" A0   \
                     ", %" A1 ", 1, 1, 1, 0, 0;\n"                                                      \
                     : ACC : "l"(a_desc), "l"(b_desc));                                                 \
    }                                                                                                   \
    static __device__ __forceinline__ void ss_mn(float (&acc)[N / 8][4], u64 a_desc, u64 b_desc) {       \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", %" A0   \
                     ", %" A1 ", 1, 1, 1, 1, 1;\n"                                                      \
                     : ACC : "l"(a_desc), "l"(b_desc));                                                 \
    }                                                                                                   \
    static __device__ __forceinline__ void rs(float (&acc)[N / 8][4], const u32 (&a)[4], u64 b_desc) {   \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", {%" A0  \
                     ", %" A1 ", %" A2 ", %" A3 "}, %" A4 ", 1, 1, 1, 1;\n"                             \
                     : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));                 \
    }

template <typename T, int N> struct Wgmma;
template <> struct Wgmma<__half, 32> { FLASH_WGMMA(32, "f16", FLASH_ACC16, FLASH_REGS16, "16", "17", "18", "19", "20") };
template <> struct Wgmma<__half, 64> { FLASH_WGMMA(64, "f16", FLASH_ACC32, FLASH_REGS32, "32", "33", "34", "35", "36") };
template <> struct Wgmma<__half, 128> { FLASH_WGMMA(128, "f16", FLASH_ACC64, FLASH_REGS64, "64", "65", "66", "67", "68") };
template <> struct Wgmma<__nv_bfloat16, 32> { FLASH_WGMMA(32, "bf16", FLASH_ACC16, FLASH_REGS16, "16", "17", "18", "19", "20") };
template <> struct Wgmma<__nv_bfloat16, 64> { FLASH_WGMMA(64, "bf16", FLASH_ACC32, FLASH_REGS32, "32", "33", "34", "35", "36") };
template <> struct Wgmma<__nv_bfloat16, 128> { FLASH_WGMMA(128, "bf16", FLASH_ACC64, FLASH_REGS64, "64", "65", "66", "67", "68") };

// The same for float32 operands as TF32 (m64nNk8): both shared-memory operands K-major, as
// TF32 has no transposing form. SCALE_D = false overwrites D with A B instead of adding to it.
// A0..A5: the operand numbers after the N / 2 accumulators.
#define FLASH_WGMMA_TF32(N, ACC, REGS, A0, A1, A2, A3, A4, A5)                                         \
    template <bool SCALE_D>                                                                             \
    static __device__ __forceinline__ void ss(float (&acc)[N / 8][4], u64 a_desc, u64 b_desc) {          \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 " REGS ", %" A0 ", %" A1   \
                     ", %" A2 ", 1, 1;\n"                                                               \
                     : ACC : "l"(a_desc), "l"(b_desc), "n"(int(SCALE_D)));                              \
    }                                                                                                   \
    template <bool SCALE_D>                                                                             \
    static __device__ __forceinline__ void rs(float (&acc)[N / 8][4], const u32 (&a)[4], u64 b_desc) {   \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 " REGS ", {%" A0 ", %" A1  \
                     ", %" A2 ", %" A3 "}, %" A4 ", %" A5 ", 1, 1;\n"                                    \
                     : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(int(SCALE_D))); \
    }

template <int N> struct WgmmaTf32;
template <> struct WgmmaTf32<32> { FLASH_WGMMA_TF32(32, FLASH_ACC16, FLASH_REGS16, "16", "17", "18", "19", "20", "21") };
template <> struct WgmmaTf32<128> { FLASH_WGMMA_TF32(128, FLASH_ACC64, FLASH_REGS64, "64", "65", "66", "67", "68", "69") };

#undef FLASH_WGMMA_TF32
#undef FLASH_WGMMA
#undef FLASH_REGS64
#undef FLASH_REGS32
#undef FLASH_REGS16
#undef FLASH_ACC64
#undef FLASH_ACC32
#undef FLASH_ACC16
#undef FLASH_ACC8
#undef FLASH_ACC

// The forward's warp policy on Hopper: every warp owns 16 rows (MI = 1), a warpgroup 64.
// Products are only issued here, one commit group each; the caller waits for them
// (wgmma_wait, then fence_regs on the registers involved).
template <typename T>
struct MmaWgmma : MmaF16<T, 1> {
    static constexpr bool WARPGROUP = true;
    template <int ROWS, int COLS> using Tile = Sw128Tile<T, ROWS, COLS>;

    // S (16 per warp, N) += Q K^T for the calling warp's warpgroup: Q (BLOCK_M, HD) and
    // K (N, HD) Sw128 tiles; the warpgroup's 64 rows start at row 64 (warp / 4) of sQ.
    template <int BLOCK_M, int HD, int N>
    static __device__ __forceinline__ void qk_issue(const T* sQ, const T* sK, float (&s)[1][N / 8][4]) {
        const u32 q0 = smem_addr(sQ) + (threadIdx.x / 128) * 64 * 128, k0 = smem_addr(sK);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {  // slab kk / 4, 32 bytes per k-step inside it
            const u32 off = (kk % 4) * 32;
            Wgmma<T, N>::ss(s[0], sw128_desc(q0 + (kk / 4) * (BLOCK_M * 128) + off, 16, 1024),
                            sw128_desc(k0 + (kk / 4) * (N * 128) + off, 16, 1024));
        }
        wgmma_commit();
    }

    // O (16 per warp, DV) += P V: P (16 per warp, KEYS) as m16n8k16 A fragments, V (KEYS, DV)
    // an Sw128 tile; a DV wider than 128 in 128-column parts (two 64-column slabs each).
    template <int KEYS, int DV>
    static __device__ __forceinline__ void pv_issue(const u32 (&a)[1][KEYS / 16][4], const T* sV,
                                                    float (&o)[1][DV / 8][4]) {
        constexpr int N = DV < 128 ? DV : 128;
        static_assert(DV % N == 0, "whole 128-column parts");
        const u32 v0 = smem_addr(sV);
        wgmma_fence();
#pragma unroll
        for (int part = 0; part < DV / N; ++part) {
            float(&o_part)[N / 8][4] = *reinterpret_cast<float(*)[N / 8][4]>(&o[0][part * N / 8]);
            const u32 v_part = v0 + part * (N / 64) * (KEYS * 128);  // (N / 64) slabs of KEYS rows
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk)  // keys 16 kk .. 16 kk + 15: 16 rows of 128 bytes
                Wgmma<T, N>::rs(o_part, a[0][kk], sw128_desc(v_part + kk * 16 * 128, KEYS * 128, 1024));
        }
        wgmma_commit();
    }

    // D (64, N) += A B with both operands MN-major Sw128 tiles of KEYS rows: A^T (KEYS, 64)
    // and B (KEYS, *) from column col0 (the backward's dQ = dS K, with dS^T and K stored
    // key by key). A start col0 % 64 inside a slab's 128-byte rows works as the K-major
    // k-steps' 32-byte offsets do: the swizzle applies to the full address.
    template <int KEYS, int N>
    static __device__ __forceinline__ void mn_issue(const T* sAt, const T* sB, int col0, float (&acc)[1][N / 8][4]) {
        static_assert(N <= 64 || N % 64 == 0, "inside one slab, or whole slabs");
        const u32 a0 = smem_addr(sAt), b0 = smem_addr(sB) + (col0 / 64) * (KEYS * 128) + (col0 % 64) * 2;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk)  // keys 16 kk .. 16 kk + 15: 16 rows of 128 bytes
            Wgmma<T, N>::ss_mn(acc[0], sw128_desc(a0 + kk * 16 * 128, KEYS * 128, 1024),
                               sw128_desc(b0 + kk * 16 * 128, KEYS * 128, 1024));
        wgmma_commit();
    }

    // The calling warp's A fragments (its 16 rows, BN columns; pack_p's layout) into rows
    // 16 warp .. 16 warp + 15 of a (ROWS, BN) Sw128 tile. A store of 4-byte pairs by the
    // warp covers 8 rows whose chunks the swizzle puts on distinct banks.
    template <int ROWS, int BN>
    static __device__ __forceinline__ void store_p_swizzled(const u32 (&a)[1][BN / 16][4], T* sP) {
        unsigned char* base = reinterpret_cast<unsigned char*>(sP);
        const int lane = threadIdx.x & 31, row0 = 16 * (threadIdx.x / 32) + (lane >> 2), t = lane & 3;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r)  // register r: row + 8 if r is odd, columns 16 kk (+8 if r >= 2) + 2t
                *reinterpret_cast<u32*>(base + Sw128Tile<T, ROWS, BN>::chunk_offset(row0 + 8 * (r & 1), 2 * kk + (r >> 1))
                                        + 4 * t) = a[0][kk][r];
    }
};

#endif  // sm_90a

}  // namespace flash
