// Combine of split-KV partial results (LSE-weighted merge), one warp per
// (request, query token, head) row; requests that were not split exit at once.
// Same arithmetic as mla_dispatch.metadata.combine_splits.
#pragma once
#include <cmath>
#include <cstdint>

#include "config.cuh"
#include "params.h"

namespace mla_sm90 {

// One 128-thread block per (request, row); each thread owns 4 of the 512 channels.
// The slot loop is unrolled so several 16-byte loads are in flight per thread
// (v1 walked the slots one dependent load at a time: 30 us for 64 splits). A 512-thread
// variant with 4 slot groups per row was tried and measured slower on many-request
// batches (16K blocks that mostly exit at once) and barely faster at b=1 (24.2 vs 25.3 us).
constexpr int kCombineThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const __grid_constant__ CombineParams p) {
  using TT = TypeTraits<T>;
  const int b = blockIdx.y;
  const int n = p.num_splits[b];
  if (n <= 1) return;
  const int rows = p.q_len * p.heads_q;
  const int row = blockIdx.x;
  const int i = row / p.heads_q, h = row % p.heads_q;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t first = p.first_slot[b];
  const float* __restrict__ plse = p.partial_lse + first * rows + row;
  __shared__ float red[kCombineThreads / 32];

  float m = -INFINITY;
  for (int s = tid; s < n; s += kCombineThreads) m = fmaxf(m, plse[(int64_t)s * rows]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));

  T* dst = reinterpret_cast<T*>(p.out) + (int64_t)b * p.out_stride_b + (int64_t)i * p.out_stride_s +
           (int64_t)h * p.out_stride_h + tid * 4;
  float* lse_dst = p.lse + (int64_t)b * p.lse_stride_b + (int64_t)h * p.lse_stride_h + i;
  if (m == -INFINITY) {  // no slot saw a key
    *reinterpret_cast<typename TT::T2*>(dst) = TT::from_float2(0.f, 0.f);
    *reinterpret_cast<typename TT::T2*>(dst + 2) = TT::from_float2(0.f, 0.f);
    if (tid == 0) *lse_dst = INFINITY;
    return;
  }
  const float4* __restrict__ src =
      reinterpret_cast<const float4*>(p.partial_out + (first * rows + row) * DecodeConfig::kHeadDimV) + tid;
  const int64_t slot_stride4 = (int64_t)rows * DecodeConfig::kHeadDimV / 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float denom = 0.f;
#pragma unroll 8
  for (int s = 0; s < n; ++s) {
    const float l = plse[(int64_t)s * rows];
    const float w = l == -INFINITY ? 0.f : __expf(l - m);  // a -inf slot wrote out = 0
    const float4 v = src[s * slot_stride4];
    denom += w;
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  const float inv = 1.f / denom;
  *reinterpret_cast<typename TT::T2*>(dst) = TT::from_float2(acc.x * inv, acc.y * inv);
  *reinterpret_cast<typename TT::T2*>(dst + 2) = TT::from_float2(acc.z * inv, acc.w * inv);
  if (tid == 0) *lse_dst = m + logf(denom);
}

}  // namespace mla_sm90
