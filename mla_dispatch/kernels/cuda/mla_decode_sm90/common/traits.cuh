// Traits of the SM90 MLA decode family: the 64-row CTA tile and its shared memory (v2; v5 and v6 take the same
// stages), the 128-byte-swizzled operand layout every mainloop uses, and the two 16-bit element types.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "config.h"
#include "params.h"

namespace mla_sm90 {

struct DecodeConfig {
  static constexpr int kHeadDimQK = mla_sm90::kHeadDimQK;
  static constexpr int kHeadDimV = mla_sm90::kHeadDimV;
  static constexpr int kBlockM = mla_sm90::kBlockM;  // query rows (s_q x heads of one KV head) per CTA tile
  static constexpr int kBlockN = mla_sm90::kBlockN;  // KV tokens per mainloop step (= split-KV chunk_size)
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
using Cfg = DecodeConfig;

// Tile layout of the 16-bit wgmma operands: the canonical 128-byte-swizzled layout of
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

}  // namespace mla_sm90
