// [notes]: docs/notes/cuda_sm90.md, the development history these comments cite
// Combine of split-KV partial results (LSE-weighted merge). Two callers of one merge routine:
// - mla_combine_kernel: its own launch after the decode, one 128-thread block per (row, request), or per
//   (row, part boundary) where the batch has more requests than boundaries;
// - combine_in_grid: the tail of a cooperatively launched decode kernel (DecodeParams::fuse_combine),
//   after a grid-wide barrier, spread over every warp of the grid (no second launch).
// Same arithmetic as mla_dispatch.metadata.schedule.combine_splits, with the max taken batch by batch
// (online rescale, as the Triton combine in kernels/triton/combine.py). A row with a NaN piece (the decode met a bad
// block id in that item: epilogue.cuh, poison_sum) gets NaN for out and lse, never the empty row's 0 / +inf.
#pragma once
#include <cooperative_groups.h>

#include <cmath>
#include <cstdint>

#include "config.h"
#include "epilogue.cuh"
#include "params.h"
#include "ptx.cuh"
#include "traits.cuh"

namespace mla_sm90 {

constexpr int kCombineThreads = 128;
// kFusedMaxSplits (config.h): split requests a fused combine can list in shared memory. A request is split only where
// a part boundary falls inside it, so there are at most num_parts - 1 of them (the binding checks num_parts).
// Shared memory combine_in_grid uses (the list, then a count per warp); the kernels assert it fits sQ.
template <int kThreads>
constexpr int kFusedScratchBytes = (4 * kFusedMaxSplits + kThreads / 32) * (int)sizeof(int);

// One warp merges the n > 1 partial rows of (request b, row) over the quarter row of 128 channels from c0: lane
// owns the 8 bytes at position c0 + 4 lane of each partial row (params.h: fp16 channels 2q, 2q + 1, 8 + 2q, 9 + 2q
// of a 16-channel block, q = lane % 4) and the quarter's shift. Slots are read kSlots at a time (kSlots loads in
// flight per lane) and folded in with an online max. No shared memory and no barrier, so
// any warp can take any row. Partials are read through L2 (ld.global.cg): in the fused combine other
// SMs wrote them during this launch. Writes out (and lse when c0 == 0).
template <typename T, int kSlots>
__device__ __forceinline__ void combine_row_part(const CombineParams& p, int b, int n, int64_t first, int row, int c0,
                                                 int lane) {
  using TT = TypeTraits<T>;
  const int rows = p.q_len * p.heads_q;
  const int i = row / p.heads_q, h = row % p.heads_q;
  const float* __restrict__ plse = p.partial_lse + first * rows + row;
  const char* prow = partial_row(p.partial_out, first * rows + row);
  const char* __restrict__ src = prow + 2 * (c0 + 4 * lane);
  const char* __restrict__ shift = prow + kPartialShiftByte + kPartialShiftStride * (c0 / 128);
  const int64_t slot_bytes = (int64_t)rows * kPartialRowBytes;

  float m = -INFINITY, denom = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < n; s0 += kSlots) {
    float l[kSlots];
    uint2 v[kSlots];
    int sh[kSlots];
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const bool ok = s0 + j < n;
      const int64_t off = (s0 + j) * slot_bytes;
      l[j] = ok ? __ldcg(plse + (int64_t)(s0 + j) * rows) : -INFINITY;
      v[j] = ok ? __ldcg(reinterpret_cast<const uint2*>(src + off)) : make_uint2(0u, 0u);
      sh[j] = ok ? __ldcg(reinterpret_cast<const signed char*>(shift + off)) : 0;
    }
    float mb = m;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) mb = fmax_nan(mb, l[j]);  // a NaN slot makes m, and so out and lse, NaN
    if (mb == -INFINITY) continue;  // no slot so far saw a key (a -inf slot wrote out = 0)
    const float r = __expf(m - mb);  // m = -inf: 0, and acc, denom are 0 anyway
    denom *= r;
    acc = make_float4(acc.x * r, acc.y * r, acc.z * r, acc.w * r);
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const float w = l[j] == -INFINITY ? 0.f : __expf(l[j] - mb);
      const float ws = w * pow2i(-sh[j]);  // the stored values are out * 2^sh
      const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v[j].x));
      const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v[j].y));
      denom += w;
      acc.x += ws * lo.x;
      acc.y += ws * lo.y;
      acc.z += ws * hi.x;
      acc.w += ws * hi.y;
    }
    m = mb;
  }
  // acc holds channels blk + 2q, +1 (x, y) and blk + 8 + 2q, +1 (z, w)
  T* dst = out_row<T>(p, b, i, h) + c0 + 16 * (lane / 4) + 2 * (lane % 4);
  // no slot saw a key: out = 0, lse = +inf. A sink s scales the row by exp(lse) / (exp(lse) + exp(s)), lse = m +
  // log(denom): 1 / (denom + exp(s - m)) in all (+inf: 0)
  const float sink = p.attn_sink != nullptr ? __expf(p.attn_sink[h] - m) : 0.f;
  const float inv = m == -INFINITY ? 0.f : 1.f / (denom + sink);
  *reinterpret_cast<typename TT::T2*>(dst) = TT::from_float2(acc.x * inv, acc.y * inv);
  *reinterpret_cast<typename TT::T2*>(dst + 8) = TT::from_float2(acc.z * inv, acc.w * inv);
  if (c0 == 0 && lane == 0)
    lse_at(p, b, i, h) = m == -INFINITY ? INFINITY : m + logf(denom);
}

// One 128-thread block per (row, request): warp w merges channels 128 w .. +128, 4 slots in flight
// (v1 walked the slots one dependent load at a time: 30 us for 64 splits). A 512-thread variant with
// 4 slot groups per row was tried and measured slower on many-request batches (16K blocks that mostly
// exit at once) and barely faster at b=1 (24.2 vs 25.3 us).
// kByBoundary: blockIdx.y is a part boundary k (between parts k and k + 1) instead of a request. At most
// num_parts - 1 requests are split (a split request holds a boundary), so with more requests than that
// the grid shrinks to the boundaries and the blocks of unsplit requests, which only read num_splits and
// exit, are never launched (b=512, h_q=128, 66 parts: 8K blocks instead of 64K). A split request's
// second partial piece starts at a boundary, so it is the first item of the part after it; that
// boundary's blocks merge the request, the others exit.
// 16 blocks per SM (32 registers; without the bound ptxas takes 40-56 for the fp16 rows' addressing, 9-12 blocks):
// the combine waits on its loads, and blocks per SM, not loads per thread, is what it has ([notes], small batches).
template <typename T, bool kByBoundary>
__global__ void __launch_bounds__(kCombineThreads, 16) mla_combine_kernel(const __grid_constant__ CombineParams p) {
  int b = blockIdx.y;
  if constexpr (kByBoundary) {
    const int part = blockIdx.y + 1;
    const int it = p.part_offsets[part];
    if (it >= p.part_offsets[part + 1]) return;  // the part has no item
    const int4 item = reinterpret_cast<const int4*>(p.items)[it];
    b = item.x;
    if (b < 0 || item.w < 0 || item.w != p.first_slot[b] + 1) return;  // not a request's second piece
  }
  const int n = p.num_splits[b];
  if (n <= 1) return;
  combine_row_part<T, 4>(p, b, n, p.first_slot[b], blockIdx.x, 128 * (threadIdx.x / 32), threadIdx.x % 32);
}

// The combine as the tail of the decode kernel: called by every thread of every CTA after its last
// item, when the kernel was launched cooperatively (all CTAs resident; DecodeParams::fuse_combine).
// Each CTA builds the same ordered list of split requests in shared memory (warp ballots over
// num_splits; each entry: request, splits, first slot, so a unit's only global loads are its
// partials) while other CTAs may still be decoding (it reads the schedule only), then waits at a
// grid-wide barrier (every partial written), and the grid's warps take the (request, row, channel
// quarter) units of the list round-robin, 8 slots in flight per lane (b = 1, h_q = 128: 512 units
// over 512 or 1056 warps).
// `scratch`: kFusedScratchBytes<kThreads> of shared memory the kernel no longer uses.
template <typename T, int kThreads>
__device__ void combine_in_grid(const DecodeParams& d, int* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  constexpr int kWarps = kThreads / 32;
  cp_async_drain();  // nothing of the mainloop lands in scratch later
  __syncthreads();

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  int4* list = reinterpret_cast<int4*>(scratch);  // (request, splits, first slot, -)
  int* warp_count = scratch + 4 * kFusedMaxSplits;
  int count = 0;
  for (int base = 0; base < d.batch; base += kThreads) {
    const int b = base + tid;
    const int n = b < d.batch ? d.num_splits[b] : 0;
    const int first = b < d.batch ? d.first_slot[b] : 0;  // both loads in flight together
    const bool split = n > 1;
    const unsigned ballot = __ballot_sync(0xffffffffu, split);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int pos = count + __popc(ballot & ((1u << lane) - 1u));
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) pos += warp_count[w];
      count += warp_count[w];
    }
    if (split && pos < kFusedMaxSplits) list[pos] = make_int4(b, n, first, 0);
    __syncthreads();  // warp_count is rewritten by the next chunk; the list is complete after the last
  }
  count = min(count, kFusedMaxSplits);
  cooperative_groups::this_grid().sync();  // every CTA's partials are written (and visible: the barrier fences)

  const CombineParams c = combine_params(d);
  const int rows = d.q_len * d.heads_q;
  const int cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int warps = gridDim.x * gridDim.y * gridDim.z * kWarps;
  // units: (list entry, row, channel quarter); count * rows * 4 < 2^31 (the binding checks num_parts * rows * 4)
  for (int u = cta * kWarps + warp; u < count * rows * 4; u += warps) {
    const int r = u / 4;
    const int4 e = list[r / rows];
    combine_row_part<T, 8>(c, e.x, e.y, e.z, r % rows, 128 * (u % 4), lane);
  }
}

}  // namespace mla_sm90
