// Test kernels: the device Philox against cuRAND's Philox4_32_10. Only the GPU tests load this.
#include <curand_kernel.h>

#include "philox.cuh"

// out[t] = our Philox words for counter ctr[t] and key key[t].
extern "C" __global__ void philox_ours(const uint4* ctr, const uint2* key, uint4* out, int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const flash::Philox4 r = flash::philox4x32_10(ctr[t].x, ctr[t].y, ctr[t].z, ctr[t].w, key[t].x, key[t].y);
    out[t] = make_uint4(r.x, r.y, r.z, r.w);
}

// The same through cuRAND's public API. curand_init(seed, subsequence, offset) keys
// Philox4_32_10 with (seed lo, seed hi), puts subsequence in counter words (z, w) and
// advances the low words (x, y) by offset / 4 four-word outputs; so counter
// (x, y, z, w) is subsequence = z | w << 32 and offset = 4 * (x | y << 32) (y < 2^30).
extern "C" __global__ void philox_curand(const uint4* ctr, const uint2* key, uint4* out, int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const unsigned long long seed = key[t].x | (static_cast<unsigned long long>(key[t].y) << 32);
    const unsigned long long subsequence = ctr[t].z | (static_cast<unsigned long long>(ctr[t].w) << 32);
    const unsigned long long offset = 4ull * (ctr[t].x | (static_cast<unsigned long long>(ctr[t].y) << 32));
    curandStatePhilox4_32_10_t state;
    curand_init(seed, subsequence, offset, &state);
    out[t] = curand4(&state);
}
