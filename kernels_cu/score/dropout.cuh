// Dropout's keep bits as the accumulator layouts hold them: a thread's elements of an
// (16 MI, 8 NT) tile of S (rows queries) or of S^T (rows keys), from the bits of
// docs/semantics.md#dropout-bits: key 8 g + 2 w + h of query row i is kept where 16-bit half h
// of word w of Philox4x32-10 at counter (g, i, bh, offset) is >= the threshold. One call
// serves eight keys; the lanes that share a call's keys make it once and trade its bits.
#pragma once

#include "../params.cuh"
#include "../philox.cuh"

namespace flash {

// The keep bits of a thread's (16 MI, 8 NT) accumulator tile, or of a transposed one: bit
// 4 (n % 8) + e of word [mi][n / 8] for element e of quad (mi, n). Values, so a mainloop can
// draw them where it has the time (beside the tensor cores) and use them later.
template <int MI, int NT>
struct KeepBits {
    u32 w[MI][(NT + 7) / 8];
    __device__ __forceinline__ bool kept(int mi, int n, int e) const { return (w[mi][n / 8] >> (4 * (n % 8) + e)) & 1u; }
    static __device__ __forceinline__ KeepBits all() {
        KeepBits bits;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int x = 0; x < (NT + 7) / 8; ++x) bits.w[mi][x] = ~0u;
        return bits;
    }
};

// Philox's key (seed) and fourth counter word (offset) of a call with dropout: from the
// parameter block, or, where the call gave a device rng_state, from that array as the kernel
// runs (a captured CUDA graph replays with whatever the caller has advanced it to). Read once,
// where a kernel's Scores are made: a read in the key loop, even one predicated off, slowed
// the 16-bit forward by 4-8%.
struct DropoutKey {
    u64 seed;
    u32 offset;

    static __device__ __forceinline__ DropoutKey of(const Params& p) {
        if (p.rng_state == nullptr) return DropoutKey{p.seed, p.dropout_offset};
        return DropoutKey{p.rng_state[0], static_cast<u32>(p.rng_state[1])};
    }
};

// The keep bits of one (batch, query head) plane bh of a call with dropout.
struct DropoutBits {
    const Params& p;
    u32 bh;
    DropoutKey key;

    // Bit k of the result: key 8 group + k of query row `row` survives, k in [0, 8): the eight
    // 16-bit halves of one Philox call, low half of word 0 first, against the threshold.
    __device__ __forceinline__ unsigned byte(u32 group, u32 row) const {
        const Philox4 r = philox4x32_10(group, row, bh, key.offset, static_cast<u32>(key.seed),
                                        static_cast<u32>(key.seed >> 32));
        const u32 th = p.dropout_threshold, words[4] = {r.x, r.y, r.z, r.w};
        unsigned bits = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w)
            bits |= unsigned((words[w] & 0xffffu) >= th) << (2 * w) | unsigned((words[w] >> 16) >= th) << (2 * w + 1);
        return bits;
    }

    // One step of an 8-bit matrix transpose across lanes (row: lane, column: bit): the lane
    // and its partner `lanes` away swap their off-diagonal blocks of `width` bits. `upper`:
    // this lane is the pair's second; `low` masks the first block of every pair of blocks.
    static __device__ __forceinline__ unsigned swap_blocks(unsigned bits, bool upper, int lanes, int width,
                                                           unsigned low) {
        const unsigned got = __shfl_xor_sync(0xffffffffu, upper ? bits & low : (bits >> width) & low, lanes);
        return upper ? (bits & ~low & 0xffu) | got : (bits & low) | got << width;
    }

    // Bits 4 u + e of the result: element e of a thread's accumulator quads of key tiles n + u,
    // u in {0, 1}: rows i and i + 8, keys j + 8 u and j + 8 u + 1 (j = a multiple of 8 plus
    // 2 t, t = lane % 4). The four calls they need (rows i, i + 8 x tiles n, n + 1) are made
    // once in the quad, lane c making call c (row i + 8 (c & 1), tile n + (c >> 1)), and their
    // 2-bit key pairs transposed across the quad in two shuffles: lane t takes pair t of each
    // call, one call per eight scores a lane.
    __device__ __forceinline__ unsigned quads(int i, int j) const {
        const unsigned c = threadIdx.x & 3u;
        unsigned keep = byte((static_cast<u32>(j) >> 3) + (c >> 1), static_cast<u32>(i) + 8u * (c & 1u));
        keep = swap_blocks(keep, c & 2u, 2, 4, 0x0fu);  // pairs 2, 3 of calls 0, 1 <-> pairs 0, 1 of calls 2, 3
        return swap_blocks(keep, c & 1u, 1, 2, 0x33u);  // pair 1 of call 0 <-> pair 0 of call 1, and so on
    }

    // Bits 4 u + e of the result: element e of a thread's quads of a transposed accumulator
    // tile (S^T) at query columns 8 (n + u), u in {0, 1}: rows keys j and j + 8 (j = a multiple
    // of 16 plus the lane's group g = lane / 4), columns queries i + 8 u and i + 8 u + 1 (i
    // even). The eight lanes of column pair t need the same eight calls (queries i, i + 1,
    // i + 8, i + 9 x key groups j >> 3 and the next): lane g makes call c = g (element
    // c & 3 of tile n + (c >> 2)), and the 8 x 8 bit matrix (row: call, column: key) is
    // transposed across them in three shuffles, lane g taking key g of every call: one call
    // per eight scores a lane.
    __device__ __forceinline__ unsigned quads_transposed(int j, int i) const {
        const unsigned c = (threadIdx.x >> 2) & 7u;
        unsigned keep = byte((static_cast<u32>(j) >> 3) + ((c >> 1) & 1u), static_cast<u32>(i) + (c & 1u) + 8u * (c >> 2));
        keep = swap_blocks(keep, c & 4u, 16, 4, 0x0fu);
        keep = swap_blocks(keep, c & 2u, 8, 2, 0x33u);
        return swap_blocks(keep, c & 1u, 4, 1, 0x55u);
    }

    // The keep bits of a thread's (16 MI, 8 NT) tile: rows i + 16 mi and keys j + 8 n
    // (TRANSPOSED: keys j + 16 mi and queries i + 8 n). With NT odd (the float64 backward's
    // 8-query tiles) the last call draws a tile past the end too, unread. Every lane of the
    // warp calls it.
    template <int MI, int NT, bool TRANSPOSED = false>
    __device__ __forceinline__ KeepBits<MI, NT> tile(int i, int j) const {
        KeepBits<MI, NT> bits;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                const unsigned b = TRANSPOSED ? quads_transposed(j + 16 * mi, i + 8 * n) : quads(i + 16 * mi, j + 8 * n);
                bits.w[mi][n / 8] = (n % 8 == 0 ? 0u : bits.w[mi][n / 8]) | b << (4 * (n % 8));
            }
        return bits;
    }
};

}  // namespace flash
