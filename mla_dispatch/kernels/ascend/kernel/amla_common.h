// Common definitions of the AMLA MLA-decode kernel (Ascend C, Atlas A2/A3: 910B/910C).
//
// STATUS: written, not compiled or run on hardware (no CANN toolkit or NPU was available).
// The numerics are specified by mla_dispatch/kernels/ascend/amla_emulation.py, which is tested.
//
// Algorithm: AMLA, "MUL by ADD in FlashAttention Rescaling", arXiv 2509.25224. Structure learned
// from (read, not copied; CANN Open Software License): hicann/ops-transformer
// attention/common/op_kernel/arch*/fia_{kernel,block_cube,block_vec}_nonquant_mla.h and
// hicann/catlass examples/19_mla + include/catlass/epilogue/block/block_epilogue_amla_tp1_*.hpp.
#pragma once

#include "kernel_operator.h"
#include "tiling_data.h"

namespace amla {

using namespace AscendC;

// Cross-core flags (cube <-> vector). One id per event; the preload ring index (i % kPreload)
// is folded in by using two ids per event so that block i and block i+1 never share one.
enum CoreFlag : uint16_t {
    QK_READY = 0,       // cube -> vec: S_i is in the GM scores ring (ids 0, 1)
    PROBS_READY = 2,    // vec -> cube: P~_i is in the GM probs ring (ids 2, 3)
    NUPDATE_DONE = 4,   // vec -> cube: int32 add of N_i on O landed (or O biased, block 0) (ids 4, 5)
    PV_DONE = 6,        // cube -> vec: fp32 atomic add of P~_i V_i landed (ids 6, 7)
    SCORES_FREE = 8,    // vec -> cube: scores ring slot may be overwritten (ids 8, 9)
};
constexpr uint8_t kSyncMode = 2;  // CrossCoreSetFlag mode: AIC <-> its two AIV

// Vector-side constants of the AMLA step (same values as the emulation).
constexpr float kRecipLn2 = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kDnClamp = -30.0f;           // shift the exponent by at most 30 per block
constexpr float kEpsMantissa = 1.5f;         // mid mantissa of the compensation
constexpr float kEpsBias = 1e-6f;
constexpr float kMantissaOne = 8388608.0f;   // 2^23: one unit of the exponent field
constexpr int32_t kFirstBlockBias = 0x17800000;  // fp32 2^-80: initial O, never exactly 0
constexpr float kZeroGuard = 1e10f;          // final: elements not |O| <= 1e10 are set to 0
constexpr float kNegInf = -3.4028234663852886e38f * 2.0f;

constexpr uint32_t kTokenTile = 128;  // KV tokens per L0 tile
constexpr uint32_t kDepthTile = 128;  // head-dim slice per L0 tile
constexpr uint32_t kVecRows = 16;     // rows per UB pass of a vector core
constexpr uint32_t kBcastCols = 128;  // N is broadcast to 128 columns and added 4 times (512 = 4 x 128)

__aicore__ inline uint32_t CeilDivU(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// View of the tiling blob in GM: header | items | partOffsets.
struct TilingView {
    AmlaTilingHeader h;
    __gm__ AmlaWorkItem *items;
    __gm__ int32_t *partOffsets;

    __aicore__ inline void Load(GM_ADDR tiling) {
        __gm__ uint32_t *src = reinterpret_cast<__gm__ uint32_t *>(tiling);
        uint32_t *dst = reinterpret_cast<uint32_t *>(&h);
        for (uint32_t i = 0; i < sizeof(AmlaTilingHeader) / sizeof(uint32_t); ++i) {
            dst[i] = src[i];
        }
        items = reinterpret_cast<__gm__ AmlaWorkItem *>(tiling + sizeof(AmlaTilingHeader));
        partOffsets = reinterpret_cast<__gm__ int32_t *>(tiling + sizeof(AmlaTilingHeader) +
                                                          h.numItems * sizeof(AmlaWorkItem));
    }
};

// Token t of request `req` lives at kv + (blockTable[req][t / pageSize] * pageSize + t % pageSize) * 576.
__aicore__ inline uint64_t TokenOffset(__gm__ int32_t *blockTable, const AmlaTilingHeader &h, int32_t req,
                                       uint32_t token) {
    const int32_t page = blockTable[uint64_t(req) * h.maxBlocks + token / h.pageSize];
    return (uint64_t(page) * h.pageSize + token % h.pageSize) * kHeadDimQk;
}

// Number of keys visible to row r of a request of length L (rows ordered token-major: r = i * heads + h).
__aicore__ inline int32_t VisibleKeys(const AmlaTilingHeader &h, int32_t length, uint32_t row) {
    if (!h.causal) {
        return length;
    }
    const int32_t i = int32_t(row / h.numHeads);
    const int32_t lim = length - int32_t(h.qLen) + 1 + i;
    return lim > 0 ? lim : 0;
}

}  // namespace amla
