// Traits of the SM90 MLA decode kernel (tile shapes, shared-memory layout,
// swizzle). Kept apart from the mainloop (mainloop.cuh) so a new version of the
// hot path can reuse or replace them independently.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "params.h"

namespace mla_sm90 {

struct DecodeConfig {
  static constexpr int kHeadDimQK = 576;  // kv_lora_rank 512 + rope 64
  static constexpr int kHeadDimV = 512;
  static constexpr int kBlockM = 64;   // query rows (s_q x heads of one KV head) per CTA tile
  static constexpr int kBlockN = 64;   // KV tokens per mainloop step (= split-KV chunk_size)
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // Warp roles (v2, v5): warp w owns query rows 16*(w%4) .. +16 of the tile
  static constexpr int kRowGroups = 4;
  static constexpr int kChunksQK = kHeadDimQK / 8;  // 16-byte chunks of a bf16/fp16 row: 72
  // Shared memory: Q [64][576], K/V 2 stages of [64][576], P [64][64] (all in the
  // q dtype, 16-byte chunks XOR-swizzled by row), row max / row sum exchange.
  static constexpr int kQElems = kBlockM * kHeadDimQK;
  static constexpr int kKElems = kBlockN * kHeadDimQK;
  static constexpr int kStages = 2;
  static constexpr int kPElems = kBlockM * kBlockN;
  static constexpr int kSmemBytes =
      2 * (kQElems + kStages * kKElems + kPElems) + 2 * 2 * kBlockM * (int)sizeof(float) + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the SM90 per-block limit");
};

// v2 tile layout (wgmma operands): the canonical 128-byte-swizzled layout of
// CUTLASS/CuTe (Swizzle<3,4,3>): the 576 columns are cut into 9 blocks of 64
// (128 bytes); block b is a [64 rows][64] sub-tile at b * 64 * 64 elements, whose
// 16-byte chunks are XOR-swizzled by (row & 7). With a 1024-byte aligned base this
// is at once K-major for Q and K (S = Q K^T) and MN-major for V (O = P V).
struct Gmma128Tile64 {
  static __device__ __forceinline__ int offset(int row, int col) {
    return (col >> 6) * (64 * 64) + row * 64 + ((((col & 63) >> 3) ^ (row & 7)) << 3) + (col & 7);
  }
};

template <typename T> struct TypeTraits;
template <> struct TypeTraits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ T2 from_float2(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 to_float2(T2 v) { return __bfloat1622float2(v); }
  static constexpr bool kIsBf16 = true;
};
template <> struct TypeTraits<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ T2 from_float2(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 to_float2(T2 v) { return __half22float2(v); }
  static constexpr bool kIsBf16 = false;
};

// Output row (request b, query i, head h) and its LSE (params.h); P is DecodeParams or CombineParams, which name
// out, lse and their strides alike.
template <typename T, typename P>
__device__ __forceinline__ T* out_row(const P& p, int64_t b, int64_t i, int64_t h) {
  return reinterpret_cast<T*>(p.out) + b * p.out_stride_b + i * p.out_stride_s + h * p.out_stride_h;
}
template <typename P>
__device__ __forceinline__ float& lse_at(const P& p, int64_t b, int64_t i, int64_t h) {
  return p.lse[b * p.lse_stride_b + h * p.lse_stride_h + i];
}
// Index of the partial row of (slot, query qi, head) in the workspace: rows of partial_out and entries of partial_lse.
template <typename P>
__device__ __forceinline__ int64_t partial_index(const P& p, int slot, int qi, int head) {
  return ((int64_t)slot * p.q_len + qi) * p.heads_q + head;
}
// An item's LSE of (query qi, head): into lse for a whole request (slot < 0), else into its partial's entry.
template <typename P>
__device__ __forceinline__ void store_item_lse(const P& p, int req, int slot, int qi, int head, float lse_val) {
  if (slot < 0)
    lse_at(p, req, qi, head) = lse_val;
  else
    p.partial_lse[partial_index(p, slot, qi, head)] = lse_val;
}
// Partial row `prow` (partial_index) of the workspace, as bytes (params.h).
__device__ __forceinline__ char* partial_row(void* base, int64_t prow) {
  return static_cast<char*>(base) + prow * kPartialRowBytes;
}
__device__ __forceinline__ const char* partial_row(const void* base, int64_t prow) {
  return static_cast<const char*>(base) + prow * kPartialRowBytes;
}
// Partial rows (params.h). The shift s of a quarter row whose values x are stored as x * inv * 2^s, where
// m = max |x| * inv: s = 141 - E for m = 1.f 2^(E - 127) (E the biased exponent) puts m * 2^s in [2^14, 2^15).
// Clamped to [-113, 126], so that 2^s and 2^-s are normal floats, and to 254 - E(inv), so that inv * 2^s is finite
// (that bound binds only where max |x| < 2^-113, and such values keep fewer bits).
// A zero or subnormal m gets the upper clamp; an inf / NaN m gets -113 and the values stay inf / NaN.
__device__ __forceinline__ int partial_shift(float m, float inv) {
  const int em = (int)((__float_as_uint(m) >> 23) & 0xffu);
  const int ei = (int)((__float_as_uint(inv) >> 23) & 0xffu);
  return max(-113, min(min(126, 254 - ei), 141 - em));
}
// 2^s for s in [-126, 127], exactly.
__device__ __forceinline__ float pow2i(int s) { return __uint_as_float((uint32_t)(127 + s) << 23); }
__device__ __forceinline__ uint32_t half2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
// A shift byte repeated over a 32-bit word: its sector of the partial row is filled with it (params.h).
__device__ __forceinline__ uint32_t shift_word(int shift) { return ((uint32_t)shift & 0xffu) * 0x01010101u; }

}  // namespace mla_sm90
