// fp8 -> 16-bit conversions of the SM90 decode mainloops. sm_90 converts e4m3 to fp16 in one instruction per pair
// (exact: every finite e4m3 value is a normal fp16 or zero) and has no e4m3 -> bf16 conversion (bf16 goes through
// fp32).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "traits.cuh"

namespace mla_sm90 {

// Two e4m3 values (the low 16 bits of `pair`) -> two values of T times `scale`, packed. The
// conversion to fp16 is exact (every finite e4m3 value is a normal fp16 or zero), so an unscaled fp16
// tile keeps it as is; bf16 goes through fp32 (sm_90 has no e4m3 -> bf16 conversion).
template <typename T, bool kScaled>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t pair, float scale) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  if constexpr (!TypeTraits<T>::kIsBf16 && !kScaled) {
    return static_cast<uint32_t>(hr.x) | (static_cast<uint32_t>(hr.y) << 16);
  } else {
    float2 f = __half22float2(__half2(hr));
    if constexpr (kScaled) f.x *= scale, f.y *= scale;
    typename TypeTraits<T>::T2 v = TypeTraits<T>::from_float2(f.x, f.y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// 8 bf16 rope values (fp8_ds_mla stores them as bf16) as T.
template <typename T>
__device__ __forceinline__ uint4 rope_as(uint4 rope) {
  if constexpr (!TypeTraits<T>::kIsBf16) {
    uint32_t w[4] = {rope.x, rope.y, rope.z, rope.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w[i]));
      __half2 h = __floats2half2_rn(f.x, f.y);
      w[i] = *reinterpret_cast<uint32_t*>(&h);
    }
    rope = make_uint4(w[0], w[1], w[2], w[3]);
  }
  return rope;
}

// Four e4m3 values (a word, lowest byte first) -> four fp16 values (two words, in order).
__device__ __forceinline__ uint2 e4m3x4_to_f16x4(uint32_t w) {
  uint2 r;
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
      : "=r"(r.x), "=r"(r.y)
      : "r"(w));
  return r;
}

// 16 e4m3 values -> 16 values of T (times `scale` where kScaled), as the two 16-byte chunks of columns
// [col, col + 16) of row `row`.
template <typename T, bool kScaled = false>
__device__ __forceinline__ void store_e4m3x16(T* st, int row, int col, uint4 raw, float scale = 1.f) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = fp8x2_to<T, kScaled>(w[i / 2] >> (16 * (i % 2)), scale);
  *reinterpret_cast<uint4*>(st + Gmma128Tile64::offset(row, col)) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4*>(st + Gmma128Tile64::offset(row, col + 8)) = make_uint4(o[4], o[5], o[6], o[7]);
}

}  // namespace mla_sm90
