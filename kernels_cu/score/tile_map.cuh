// Which score tiles a boolean mask or block mask leaves some score in, worked out once a call.
//
// A mainloop skips the tiles the masks rule out entirely. Testing a tile's mask elements
// when the mainloop reaches it costs a global round trip and a block barrier per tile (every
// thread's share of the test must be in), on the critical path of every tile the block
// computes. Instead tile_map reads the masks once before the attention kernel and writes, for
// each (batch, head) plane, each of a kernel's own tiles of rows (the outer tiles) and each
// tile along the axis its mainloop walks (the inner tiles), the first position at or after
// that tile's whose tile some score survives in, and whether the masks keep every score of
// that tile: the mainloop's step to its next tile is then one uniform load, and a tile kept
// whole reads no mask (the forward's copy and selection of the mask are skipped there).
//
//   query-major (Params::tiles): outer tiles of TI queries (the forward's and the dQ kernel's
//     row blocks), inner tiles of TJ keys; entry = first key of the next live key tile.
//   key-major (Params::tiles_t): outer tiles of TJ keys (the dK/dV kernel's key blocks),
//     inner tiles of TI queries; entry = first query of the next live query tile.
//
// Map element (b, h, o, n) at b * s_b + h * s_h + o * s_o + n, with zero strides on the axes
// every mask broadcasts over. An entry is a multiple of the inner tile (at least 8), plus
// kEntryWhole where that tile is kept whole; where no tile at or after n is live it is the
// inner axis' length rounded up to whole tiles, which is at least every kernel's end of range
// (hi <= kv_len <= lk; i_hi <= q_len <= lq). The tiles cover the (lq, lk) frame, clipped to
// it: a padded batch's rows past q_len or keys past kv_len may make a tile live that computes
// to nothing, or mixed where its valid part is whole, never the reverse.
#pragma once

#include "../bwd_params.cuh"
#include "band.cuh"

namespace flash {

constexpr int kTileMapChunk = 1024;  // inner tiles classified per pass (shared-memory classes)
constexpr int kEntryWhole = 1;       // an entry's bit 0: the masks keep every score of the tile it names

// The class of rows [i0, i1) x keys [j0, j1) of plane (b, h) under the mask (where MASK) and
// the block mask (where BLOCK_MASK): kTileDead (no score kept), kTileMixed, or kTileWhole
// (every score kept). Every lane of the calling warp calls it and gets the answer; the reads
// stop as soon as the tile is known to be mixed.
constexpr int kTileDead = 0, kTileMixed = 1, kTileWhole = 3;  // bit 0: some score kept; bit 1: all

template <bool MASK, bool BLOCK_MASK>
__device__ __forceinline__ int tile_kept(const Params& p, int b, int h, int i0, int i1, int j0, int j1) {
    const int lane = threadIdx.x & 31;
    bool any = false, all = true;  // over the elements read so far, warp-wide
    if constexpr (!MASK) {
        // The block mask alone: one read per (block_size, block_size) block the tile touches.
        const int bs = p.block_size;
        const int bi0 = i0 / bs, bj0 = j0 / bs, nbj = (j1 - 1) / bs - bj0 + 1;
        const int count = ((i1 - 1) / bs - bi0 + 1) * nbj;
        const bool* base = p.block_mask + b * p.bm_sb + h * p.bm_sh;
        for (int t0 = 0; t0 < count && !(any && !all); t0 += 32) {  // warp-uniform trips: the votes need every lane
            const int t = t0 + lane;
            const bool kept = t < count ? base[(bi0 + t / nbj) * p.bm_si + (bj0 + t % nbj) * p.bm_sj] : true;
            any = __any_sync(0xffffffffu, any || (t < count && kept));
            all = __all_sync(0xffffffffu, all && kept);
        }
    } else {
        const bool* m = p.mask + b * p.mask_sb + h * p.mask_sh;
        const bool* bm = BLOCK_MASK ? p.block_mask + b * p.bm_sb + h * p.bm_sh : nullptr;
        const int cols = j1 - j0;
        // 16 keys a load where rows are contiguous and 16-byte aligned (the staged copies' own
        // requirement, which flashcupy/cuda's _score_operand establishes) and j0 is a multiple
        // of 16; the block mask then needs a read per key: element by element.
        const bool vec = !BLOCK_MASK && p.mask_sj == 1 && p.mask_si % 16 == 0 && (reinterpret_cast<u64>(m) & 15) == 0
                         && j0 % 16 == 0;
        const int chunks = vec ? (cols + 15) / 16 : cols;
        const int count = (i1 - i0) * chunks;
        for (int t0 = 0; t0 < count && !(any && !all); t0 += 32) {
            const int t = t0 + lane;
            bool some = false, every = true;  // this lane's elements
            if (t < count) {
                const int i = i0 + t / chunks, c = t % chunks;
                const bool* row = m + i * p.mask_si;
                if (vec && j0 + 16 * c + 16 <= j1) {
                    const uint4 w = *reinterpret_cast<const uint4*>(row + j0 + 16 * c);  // 16 bools
                    some = (w.x | w.y | w.z | w.w) != 0;
                    // A zero byte among four: (x - 0x01010101) & ~x & 0x80808080 is non-zero.
                    auto zero_byte = [](u32 x) { return ((x - 0x01010101u) & ~x & 0x80808080u) != 0; };
                    every = !(zero_byte(w.x) || zero_byte(w.y) || zero_byte(w.z) || zero_byte(w.w));
                } else {
                    const int e0 = vec ? j0 + 16 * c : j0 + c, e1 = vec ? j1 : e0 + 1;  // a partial chunk, or one key
                    for (int j = e0; j < e1; ++j) {
                        bool kept = row[j * p.mask_sj];
                        if constexpr (BLOCK_MASK) kept = kept && bm[(i / p.block_size) * p.bm_si + (j / p.block_size) * p.bm_sj];
                        some = some || kept;
                        every = every && kept;
                    }
                }
            }
            any = __any_sync(0xffffffffu, any || some);
            all = __all_sync(0xffffffffu, all && every);
        }
    }
    return all ? kTileWhole : any ? kTileMixed : kTileDead;
}

// The forward problem of a launch's parameter block.
__device__ __forceinline__ const Params& problem_of(const Params& p) { return p; }
__device__ __forceinline__ const Params& problem_of(const BwdParams& bp) { return bp.f; }

// Writes the map of Params::tiles (query-major: outer tiles of TI queries, inner tiles of TJ
// keys) or, KEY_MAJOR, of Params::tiles_t (outer tiles of TJ keys, inner tiles of TI queries).
// Block: the launch's parameter block (Params, or the backward's BwdParams, whose launches share
// one block); THREADS threads a block (the host's launch); grid: x = outer tiles, planes over y
// and z (plane = (b, h) with h fastest; the host's grid covers the map's planes: one per axis a
// mask does not broadcast over). Each warp classifies inner tiles in turn; warp 0 then turns
// the classes into entries from the last tile back, 32 at a time.
template <int TI, int TJ, bool KEY_MAJOR, bool MASK, bool BLOCK_MASK, int THREADS, typename Block>
__global__ void __launch_bounds__(THREADS) tile_map(const Block block) {
    const Params& p = problem_of(block);
    static_assert(MASK || BLOCK_MASK, "a map is built from some mask");
    static_assert(THREADS % 32 == 0, "whole warps");
    constexpr int kWarps = THREADS / 32;
    constexpr int INNER = KEY_MAJOR ? TI : TJ;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    i32* const map = KEY_MAJOR ? p.tiles_t : p.tiles;
    const i64 s_b = KEY_MAJOR ? p.tt_sb : p.tiles_sb, s_h = KEY_MAJOR ? p.tt_sh : p.tiles_sh;
    const i64 s_o = KEY_MAJOR ? p.tt_so : p.tiles_so;
    const int planes_h = s_h != 0 ? p.hq : 1;
    const int plane = blockIdx.y + gridDim.y * blockIdx.z;
    const int b = plane / planes_h, h = plane - b * planes_h;
    if (b >= (s_b != 0 ? p.batch : 1)) return;
    const int o = blockIdx.x;
    const int outer_len = KEY_MAJOR ? p.lk : p.lq, inner_len = KEY_MAJOR ? p.lq : p.lk;
    const int outer0 = o * (KEY_MAJOR ? TJ : TI), outer1 = min(outer0 + (KEY_MAJOR ? TJ : TI), outer_len);
    const int tiles = (inner_len + INNER - 1) / INNER;
    i32* row = map + b * s_b + h * s_h + o * s_o;

    __shared__ unsigned char classes[kTileMapChunk];
    int next = tiles * INNER;  // warp 0: the entry of the first live tile after the chunk being written
    for (int c0 = (tiles - 1) / kTileMapChunk * kTileMapChunk; c0 >= 0; c0 -= kTileMapChunk) {
        const int c1 = min(c0 + kTileMapChunk, tiles);
        for (int n = c0 + warp; n < c1; n += kWarps) {
            const int in0 = n * INNER, in1 = min(in0 + INNER, inner_len);
            const int cls = KEY_MAJOR ? tile_kept<MASK, BLOCK_MASK>(p, b, h, in0, in1, outer0, outer1)
                                      : tile_kept<MASK, BLOCK_MASK>(p, b, h, outer0, outer1, in0, in1);
            if (lane == 0) classes[n - c0] = static_cast<unsigned char>(cls);
        }
        __syncthreads();
        if (warp == 0) {
            for (int base = c0 + (c1 - 1 - c0) / 32 * 32; base >= c0; base -= 32) {
                const int n = base + lane;
                const int cls = n < c1 ? classes[n - c0] : kTileDead;
                const unsigned live = __ballot_sync(0xffffffffu, cls != kTileDead);
                const unsigned whole = __ballot_sync(0xffffffffu, cls == kTileWhole);
                const unsigned here_or_after = live & (0xffffffffu << lane);  // live tiles from n in this group
                const int first = __ffs(here_or_after) - 1;
                if (n < c1) {
                    row[n] = here_or_after != 0 ? (base + first) * INNER | int((whole >> first) & 1u) : next;
                }
                if (live != 0) next = (base + __ffs(live) - 1) * INNER | int((whole >> (__ffs(live) - 1)) & 1u);
            }
        }
        __syncthreads();  // the classes are read before the next pass overwrites them
    }
}

// A key tile a forward block walks: its first key j, and whether the mask keeps every score
// of it (`whole`: nothing of the mask is copied or read for it).
struct KeyTile {
    int j;
    bool whole;
};

// The first key tile (of BLOCK_N keys) at or after key j (a multiple of BLOCK_N) below hi that
// some score of query tile i0 (a multiple of BLOCK_M) survives the masks in, or {hi, false}.
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ KeyTile next_live_key_tile(const Params& p, const HeadView& hv, int i0, int j, int hi) {
    if (j >= hi) return {hi, false};
    const i32* row = p.tiles + hv.b * p.tiles_sb + hv.h * p.tiles_sh + (i0 / BLOCK_M) * p.tiles_so;
    const int entry = row[j / BLOCK_N];
    return {min(entry & ~kEntryWhole, hi), (entry & kEntryWhole) != 0};
}

// The first query tile (of BLOCK_C queries) at or after query i (a multiple of BLOCK_C)
// below i_hi that some score of key block j0 (a multiple of BLOCK_R) survives in, or i_hi;
// `whole`: the masks keep every score of that tile.
template <int BLOCK_C, int BLOCK_R>
__device__ __forceinline__ int next_live_query_tile(const Params& p, const HeadView& hv, int j0, int i, int i_hi,
                                                    bool& whole) {
    whole = false;
    if (i >= i_hi) return i_hi;
    const i32* row = p.tiles_t + hv.b * p.tt_sb + hv.h * p.tt_sh + (j0 / BLOCK_R) * p.tt_so;
    const int entry = row[i / BLOCK_C];
    whole = (entry & kEntryWhole) != 0;
    return min(entry & ~kEntryWhole, i_hi);
}

}  // namespace flash
