// Combine of split-KV partial results (LSE-weighted merge), one warp per
// (request, query token, head) row; requests that were not split exit at once.
// Same arithmetic as mla_dispatch.metadata.combine_splits.
#pragma once
#include <cmath>
#include <cstdint>

#include "config.cuh"
#include "params.h"

namespace mla_sm90 {

constexpr int kCombineWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kCombineWarps * 32) mla_combine_kernel(const __grid_constant__ CombineParams p) {
  using TT = TypeTraits<T>;
  const int b = blockIdx.x;
  const int n = p.num_splits[b];
  if (n <= 1) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = p.q_len * p.heads_q;
  const int row = blockIdx.y * kCombineWarps + warp;
  if (row >= rows) return;
  const int i = row / p.heads_q, h = row % p.heads_q;
  const int64_t first = p.first_slot[b];
  const float* plse = p.partial_lse + first * rows + row;

  float m = -INFINITY;
  for (int s = lane; s < n; s += 32) m = fmaxf(m, plse[(int64_t)s * rows]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));

  T* dst = reinterpret_cast<T*>(p.out) + (int64_t)b * p.out_stride_b + (int64_t)i * p.out_stride_s +
           (int64_t)h * p.out_stride_h;
  float* lse_dst = p.lse + (int64_t)b * p.lse_stride_b + (int64_t)h * p.lse_stride_h + i;
  if (m == -INFINITY) {  // no slot saw a key
    for (int d = lane * 2; d < DecodeConfig::kHeadDimV; d += 64)
      *reinterpret_cast<typename TT::T2*>(dst + d) = TT::from_float2(0.f, 0.f);
    if (lane == 0) *lse_dst = INFINITY;
    return;
  }
  float acc[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) acc[k] = 0.f;
  float denom = 0.f;
  for (int s = 0; s < n; ++s) {
    const float l = plse[(int64_t)s * rows];
    const float w = l == -INFINITY ? 0.f : __expf(l - m);
    denom += w;
    if (w == 0.f) continue;
    const float4* src = reinterpret_cast<const float4*>(p.partial_out + ((first + s) * rows + row) * DecodeConfig::kHeadDimV);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 v = src[lane + 32 * k];
      acc[4 * k + 0] += w * v.x;
      acc[4 * k + 1] += w * v.y;
      acc[4 * k + 2] += w * v.z;
      acc[4 * k + 3] += w * v.w;
    }
  }
  const float inv = 1.f / denom;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int d = (lane + 32 * k) * 4;
    *reinterpret_cast<typename TT::T2*>(dst + d) = TT::from_float2(acc[4 * k] * inv, acc[4 * k + 1] * inv);
    *reinterpret_cast<typename TT::T2*>(dst + d + 2) = TT::from_float2(acc[4 * k + 2] * inv, acc[4 * k + 3] * inv);
  }
  if (lane == 0) *lse_dst = m + logf(denom);
}

}  // namespace mla_sm90
