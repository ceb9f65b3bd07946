// Warpgroup MMA (wgmma, HGMMA in SASS) for the SM90 decode mainloops, through CuTe's SM90 GMMA atoms
// (cute/arch/mma_sm90_gmma.hpp): shared-memory descriptors, register fences, the atoms each mainloop issues, and the
// two GEMMs of a 64-token tile with KV tokens on the M side that v6 and v7 share.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "ptx.cuh"

namespace mla_sm90 {

// Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA "matrix descriptor";
// LBO/SBO in 16-byte units: K-major uses SBO = 1024 B between 8-row groups; MN-major
// uses LBO = distance between 64-element column blocks, SBO = 1024 B between 8-row
// groups along K).
__device__ __forceinline__ uint64_t gmma_desc_sw128_addr(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= (uint64_t)((addr >> 4) & 0x3FFF);
  d |= (uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= (uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= (uint64_t)1 << 62;  // SWIZZLE_128B
  return d;
}

// The same descriptor from a shared-memory pointer.
__device__ __forceinline__ uint64_t gmma_desc_sw128(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return gmma_desc_sw128_addr(smem_u32(smem), lbo_bytes, sbo_bytes);
}

template <class Op, size_t... I>
__device__ __forceinline__ void gmma_call(uint64_t da, uint64_t db, float* acc, bool accumulate,
                                          std::index_sequence<I...>) {
  Op::fma(da, db, acc[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}

template <class Op, size_t... I>
__device__ __forceinline__ void gmma_rs_call(const uint32_t* a, uint64_t db, float* acc, bool accumulate,
                                             std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, acc[I]...,
          accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// ---- the atoms, by operand roles ----------------------------------------------------------
// v2 and v5: S = Q K^T (QK: a warpgroup's 32 tokens; QK64: all 64), O += P V with P from shared memory (PV)
template <typename T> struct Gmma;
template <> struct Gmma<__nv_bfloat16> {
  using QK = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using QK64 = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using PV = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};
template <> struct Gmma<__half> {
  using QK = cute::SM90::GMMA::MMA_64x32x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using QK64 = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using PV = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};

// v5: O += P V with P in registers
template <typename T> struct GmmaRS;
template <> struct GmmaRS<__nv_bfloat16> {
  using PV = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};
template <> struct GmmaRS<__half> {
  using PV = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};

// v6 and v7: S^T = K Q^T (KQ) and O^T += V^T P^T (VP) with N query rows
template <typename T, int N> struct GmmaEtap;
template <> struct GmmaEtap<__nv_bfloat16, 16> {
  using KQ = cute::SM90::GMMA::MMA_64x16x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using VP = cute::SM90::GMMA::MMA_64x16x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::MN, cute::SM90::GMMA::Major::K>;
};
template <> struct GmmaEtap<__nv_bfloat16, 32> {
  using KQ = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using VP = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::MN, cute::SM90::GMMA::Major::K>;
};
template <> struct GmmaEtap<__half, 16> {
  using KQ = cute::SM90::GMMA::MMA_64x16x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using VP = cute::SM90::GMMA::MMA_64x16x16_F32F16F16_SS<cute::SM90::GMMA::Major::MN, cute::SM90::GMMA::Major::K>;
};
template <> struct GmmaEtap<__half, 32> {
  using KQ = cute::SM90::GMMA::MMA_64x32x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using VP = cute::SM90::GMMA::MMA_64x32x16_F32F16F16_SS<cute::SM90::GMMA::Major::MN, cute::SM90::GMMA::Major::K>;
};

// v8: K and V^T converted from fp8 in registers (A), Q and P^T from shared memory (B)
template <int kN> struct GmmaFp8RS {  // A (K or V^T) from registers, B (Q or P^T) K-major from shared memory
  using Op = std::conditional_t<
      kN == 16, cute::SM90::GMMA::MMA_64x16x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>,
      cute::SM90::GMMA::MMA_64x32x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>>;
};

// ---- tokens on M (v6, v7) ---------------------------------------------------------------
// The two GEMMs of a 64-token tile with tokens on the wgmma M side (FlashMLA-ETAP's orientation), shared by v6
// (etap/etap.cuh) and v7 (fp8t/fp8t.cuh). Operands are 16-bit, in nine [rows][64] column blocks with the
// 128-byte swizzle.
// S^T = K Q^T: 9 column blocks x 4 k-steps of G::KQ (m64 x kN x k16) into `acc`, K at `dk` (blocks of 64 x 64), Q at
// `dq` (blocks kQBlock elements apart); `block_ready(blk)` runs before the wgmmas of block blk (v6's TMA waits, with
// the warpgroup_arrive ptxas needs after each: C7520; a no-op elsewhere). Returns with the wgmmas done.
template <typename G, int kQBlock, int kAcc, typename BlockReady>
__device__ __forceinline__ void etap_gemm_s(uint64_t dk, uint64_t dq, float (&acc)[kAcc], BlockReady&& block_ready) {
  fence_regs<kAcc>(acc);
  cute::warpgroup_arrive();
#pragma unroll
  for (int blk = 0; blk < 9; ++blk) {
    block_ready(blk);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t off_k = (uint64_t)(((blk * 64 * 64 + kk * 16) * 2) >> 4);
      const uint64_t off_q = (uint64_t)(((blk * kQBlock + kk * 16) * 2) >> 4);
      gmma_call<typename G::KQ>(dk + off_k, dq + off_q, acc, blk + kk > 0, std::make_index_sequence<kAcc>{});
    }
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence_regs<kAcc>(acc);
}

// O^T = 0, the zeroing pinned where it is (a mov that ptxas sinks between wgmmas in flight serialises them all: C7515).
template <int kAcc>
__device__ __forceinline__ void etap_zero_acc_o(float (&acc_o)[8][kAcc]) {
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc_o[mb][i] = 0.f;
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) fence_regs<kAcc>(acc_o[mb]);
}

// O^T += V^T P^T: 8 blocks of 64 channels x 4 k-steps of 16 tokens of G::VP, V^T read MN-major from the first 512
// columns of the tile at `stage`, P^T ([kN][64] tokens, K-major) at `dp`. Returns with the wgmmas done.
template <typename G, int kAcc, typename E>
__device__ __forceinline__ void etap_gemm_pv(const E* stage, uint64_t dp, float (&acc_o)[8][kAcc]) {
  static_assert(sizeof(E) == 2, "16-bit operands");
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) fence_regs<kAcc>(acc_o[mb]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const uint64_t dv = gmma_desc_sw128(stage + mb * 64 * 64, 64 * 64 * 2, 1024);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      const uint64_t off_v = (uint64_t)((kt * 16 * 64 * 2) >> 4);
      const uint64_t off_p = (uint64_t)((kt * 16 * 2) >> 4);
      gmma_call<typename G::VP>(dv + off_v, dp + off_p, acc_o[mb], true, std::make_index_sequence<kAcc>{});
    }
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) fence_regs<kAcc>(acc_o[mb]);
}

}  // namespace mla_sm90
