// Numerical helpers shared by every kernel: the log2 domain, -inf, widening to the
// accumulator type, and the transcendental functions in float and double.
//
// Scores are kept in the log2 domain (multiplied by log2(e)) so that the softmax can use
// exp2; -inf is exact in both domains.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "params.cuh"

namespace flash {

constexpr double kLog2e = 1.4426950408889634073599246810018921;
// -infinity, the score of a masked (row, key): exp2(-inf) is exactly 0 and max() keeps it.
template <typename Acc> __device__ __forceinline__ Acc neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000u); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ull); }
template <typename Acc> __device__ __forceinline__ Acc quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000u); }
template <> __device__ __forceinline__ double quiet_nan<double>() { return __longlong_as_double(0x7ff8000000000000ull); }

// A value in its accumulator type: float16 and bfloat16 widen to float, float and double stay.
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }

// exp2 of a score already reduced by its row's maximum or log-sum-exp (x <= 0 up to
// rounding): one MUFU.EX2 (ex2.approx.ftz, ~2 ulp) instead of exp2f's denormal handling
// (a compare and two predicated multiplies around it). Results below 2^-126 flush to 0, far
// under any tolerance on a probability, and exp2(-inf) = 0.
__device__ __forceinline__ float softmax_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ double softmax_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }
// tanh in one MUFU.TANH (tanh.approx.f32, sm_75+: relative error about 2^-11, an ulp of
// float16), for scores from 16-bit inputs: tanhf is a libdevice routine of an exp2, a
// reciprocal and a polynomial, and softcap called it on every score.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }

}  // namespace flash
