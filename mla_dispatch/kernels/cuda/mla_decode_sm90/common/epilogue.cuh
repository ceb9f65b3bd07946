// Epilogues of the SM90 decode mainloops: where a finished query row goes (out and lse for a request that one item
// covers, else the item's partial row and LSE in the workspace, params.h) and how a partial row is scaled into fp16.
// Row-major accumulators (v2, v5: a quad of lanes holds a row) store from registers (store_acc_row); the tokens-on-M
// mainloops (v6, v7, v8) hold O^T and store rows from shared memory, a warp per quarter row (store_row_quad).
#pragma once
#include <cmath>
#include <cstdint>

#include "params.h"
#include "traits.cuh"

namespace mla_sm90 {

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
// An item's row sum as its epilogue uses it: NaN where the item met a bad block id (loads.cuh, checked_page), so that
// its out rows (times 1 / sum) and LSE (log2 of the sum) are NaN, in out / lse or in its partial rows, which the
// combine keeps NaN. A row has keys where sum != 0 (0: no visible key; NaN: poisoned).
__device__ __forceinline__ float poison_sum(float sum, bool poisoned) { return poisoned ? NAN : sum; }
// 2^s for s in [-126, 127], exactly.
__device__ __forceinline__ float pow2i(int s) { return __uint_as_float((uint32_t)(127 + s) << 23); }
__device__ __forceinline__ uint32_t half2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
// A shift byte repeated over a 32-bit word: its sector of the partial row is filled with it (params.h).
__device__ __forceinline__ uint32_t shift_word(int shift) { return ((uint32_t)shift & 0xffu) * 0x01010101u; }

// ---- row-major accumulators (v2, v5) -------------------------------------------------------
// This thread's two accumulator rows (wgmma C layout: rows lane/4 and lane/4 + 8 of
// its warp's 16, warp group rg): row in the tile, query position, query head, row exists.
__device__ __forceinline__ void acc_rows(const DecodeParams& p, int row_tile, int kvh, int rg, int lane,
                                         int (&local)[2], int (&qi)[2], int (&head)[2], bool (&ok)[2]) {
  const int heads_per_kv = p.heads_q / p.heads_kv;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    local[h] = rg * 16 + lane / 4 + 8 * h;
    const int r = row_tile * Cfg::kBlockM + local[h];
    ok[h] = r < p.rows_per_kv_head;
    const int rc = ok[h] ? r : 0;
    qi[h] = rc / heads_per_kv;
    head[h] = kvh * heads_per_kv + rc % heads_per_kv;
  }
}

// Accumulator row h of this thread (acc_o[4 n + 2 h + {0, 1}], n < 32: its 64 of the 256 output
// channels from col0), times inv, into out (unsplit item, slot < 0) or the item's partial row (params.h: fp16,
// scaled per quarter row; one shift for the quad's 256 channels); the row's LSE from the thread with writes_lse.
// The four lanes of the thread's quad hold the row and call it together (their shuffles name only the quad).
template <typename T>
__device__ __forceinline__ void store_acc_row(const DecodeParams& p, const float* acc_o, int h, int col0, float inv,
                                              float lse_val, int req, int slot, int qi, int head, bool writes_lse) {
  using TT = TypeTraits<T>;
  const int lane = threadIdx.x % 32;
  if (slot < 0) {
    T* dst = out_row<T>(p, req, qi, head) + col0 + (lane % 4) * 2;
#pragma unroll
    for (int n = 0; n < 32; ++n)
      *reinterpret_cast<typename TT::T2*>(dst + n * 8) =
          TT::from_float2(acc_o[4 * n + 2 * h] * inv, acc_o[4 * n + 2 * h + 1] * inv);
    if (writes_lse) lse_at(p, req, qi, head) = lse_val;
  } else {
    float m = 0.f;
#pragma unroll
    for (int n = 0; n < 32; ++n) m = fmaxf(m, fmaxf(fabsf(acc_o[4 * n + 2 * h]), fabsf(acc_o[4 * n + 2 * h + 1])));
    const unsigned quad = 0xfu << (lane & 28);
    m = fmaxf(m, __shfl_xor_sync(quad, m, 1));
    m = fmaxf(m, __shfl_xor_sync(quad, m, 2));
    const int shift = partial_shift(m * inv, inv);
    const float pscale = inv * pow2i(shift);
    const int64_t prow = partial_index(p, slot, qi, head);
    char* row = partial_row(p.partial_out, prow);
    __half* dst = reinterpret_cast<__half*>(row) + col0 + (lane % 4) * 4;
#pragma unroll
    for (int k = 0; k < 16; ++k) {  // pairs n = 2k (channels 16k + 2q ..) and 2k + 1 (16k + 8 + 2q ..)
      const float* a = acc_o + 8 * k + 2 * h;
      *reinterpret_cast<uint2*>(dst + 16 * k) =
          make_uint2(half2_bits(__floats2half2_rn(a[0] * pscale, a[1] * pscale)),
                     half2_bits(__floats2half2_rn(a[4] * pscale, a[5] * pscale)));
    }
    // both quarters of the 256 channels take the shift: lanes 0, 1 fill the first one's sector, lanes 2, 3 the next
    const uint32_t w = shift_word(shift);
    *reinterpret_cast<uint4*>(row + kPartialShiftByte + kPartialShiftStride * (col0 / 128) + 16 * (lane % 4)) =
        make_uint4(w, w, w, w);
    if (writes_lse) p.partial_lse[prow] = lse_val;
  }
}

// ---- rows from shared memory (v6, v7, v8) ---------------------------------------------------
// Channels ch .. ch + 3 (ch % 4 == 0) of a finished query row (req, qi, head), times inv, from the row's fp32 sums in
// shared memory (srow[sch] holds channel ch): into out (unsplit item, slot < 0) or into the item's partial row
// (params.h: position ch of the fp16 row holds channels 2q, 2q + 1, 8 + 2q, 9 + 2q of its 16-channel block, q =
// ch % 16 / 4, scaled by one power of two per quarter row). For a split item the calling warp's 32 lanes must hold one
// quarter row (consecutive ch, the same row), since they agree on its scale by shuffles. v6 and v7 write rows so.
// store_row_quad's stores: v, the four values of position ch (out's channels ch .. + 3, or a partial row's order),
// times inv; m, the largest |value| of the quarter row, sets a partial row's scale. fp8t_rows_out (fp8t/fp8t.cuh)
// calls it after reading and reducing several rows at once.
template <typename T>
__device__ __forceinline__ void store_quad(const DecodeParams& p, float4 v, float m, int ch, float inv, int req,
                                           int qi, int head, int slot) {
  using TT = TypeTraits<T>;
  if (slot < 0) {
    T* dst = out_row<T>(p, req, qi, head) + ch;
    *reinterpret_cast<typename TT::T2*>(dst) = TT::from_float2(v.x * inv, v.y * inv);
    *reinterpret_cast<typename TT::T2*>(dst + 2) = TT::from_float2(v.z * inv, v.w * inv);
    return;
  }
  const int shift = partial_shift(m * inv, inv);
  const float pscale = inv * pow2i(shift);
  char* row = partial_row(p.partial_out, partial_index(p, slot, qi, head));
  *reinterpret_cast<uint2*>(reinterpret_cast<__half*>(row) + ch) =
      make_uint2(half2_bits(__floats2half2_rn(v.x * pscale, v.y * pscale)),
                 half2_bits(__floats2half2_rn(v.z * pscale, v.w * pscale)));
  if (ch % 128 < 16) {  // lanes 0 .. 3 fill the quarter's shift sector
    const uint32_t w = shift_word(shift);
    *reinterpret_cast<uint2*>(row + kPartialShiftByte + kPartialShiftStride * (ch / 128) + 2 * (ch % 128)) =
        make_uint2(w, w);
  }
}
template <typename T>
__device__ __forceinline__ void store_row_quad(const DecodeParams& p, const float* srow, int sch, int ch, float inv,
                                               int req, int qi, int head, int slot) {
  if (slot < 0) {
    store_quad<T>(p, *reinterpret_cast<const float4*>(srow + sch), 0.f, ch, inv, req, qi, head, slot);
    return;
  }
  const float* o = srow + (sch & ~15) + 2 * ((sch & 15) / 4);
  const float2 lo = *reinterpret_cast<const float2*>(o), hi = *reinterpret_cast<const float2*>(o + 8);
  float m = fmaxf(fmaxf(fabsf(lo.x), fabsf(lo.y)), fmaxf(fabsf(hi.x), fabsf(hi.y)));
#pragma unroll
  for (int d = 1; d < 32; d *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  store_quad<T>(p, make_float4(lo.x, lo.y, hi.x, hi.y), m, ch, inv, req, qi, head, slot);
}

}  // namespace mla_sm90
