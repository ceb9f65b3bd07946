// Tiling data shared by the host (host/tiling.cpp, plain C++) and the AMLA kernel (kernel/*.h).
// Plain C++: no CANN headers, so g++ compiles and unit-tests the host side. Its use in device code
// is written, not compiled (no bisheng here).
//
// The tiling blob the host copies to the device is
//   AmlaTilingHeader | AmlaWorkItem[numItems] | int32 partOffsets[numCores + 1]
// Item i of core c is items[partOffsets[c] + k], k < partOffsets[c + 1] - partOffsets[c].
#pragma once

#include <cstdint>

namespace amla {

constexpr uint32_t kKvBlock = 512;   // KV tokens per AMLA step (one rescale per block)
constexpr uint32_t kHeadDimQk = 576; // 512 latent (NoPE) + 64 RoPE
constexpr uint32_t kHeadDimV = 512;  // V = the first 512 channels of the cached token
constexpr uint32_t kPreload = 2;     // preload depth of the cube/vector pipeline (paper Thm 4.1)
constexpr uint32_t kMaxRows = 512;   // s_q * h_q: up to 4 query tokens x 128 heads

struct AmlaWorkItem {
    int32_t req;      // request index, -1 for padding
    int32_t tokBegin; // first KV token of the range (multiple of kKvBlock)
    int32_t tokEnd;   // one past the last KV token
    int32_t slot;     // -1: write out/lse directly; else partial-result row for the combine
};

struct AmlaTilingHeader {
    uint32_t batch;
    uint32_t qLen;       // s_q
    uint32_t numHeads;   // h_q (h_kv = 1)
    uint32_t rows;       // qLen * numHeads: query rows sharing the one KV head
    uint32_t rowTile;    // rows per cube M tile (multiple of 16)
    uint32_t numRowTiles;
    uint32_t pageSize;
    uint32_t maxBlocks;  // block_table row length
    uint32_t numCores;   // cube cores used (blockDim of the MIX launch)
    uint32_t numItems;
    uint32_t numSlots;   // partial-result rows for split requests
    uint32_t causal;
    float softmaxScale;
    uint32_t dtypeIsBf16;
    // GM workspace layout, bytes, per core (see host/tiling.cpp WorkspacePlan)
    uint64_t wsScoresOffset;  // fp32 S ring: kPreload x rowTile x kKvBlock
    uint64_t wsProbsOffset;   // bf16/fp16 P~ ring: kPreload x rowTile x kKvBlock
    uint64_t wsAccumOffset;   // fp32 O accumulator ring (AMLA target of int32/fp32 atomics): kPreload x rowTile x kHeadDimV
    uint64_t wsPerCoreBytes;
    uint64_t wsPartialOutOffset; // global: fp32 [numSlots, rows, kHeadDimV]
    uint64_t wsPartialLseOffset; // global: fp32 [numSlots, rows]
    uint64_t wsTotalBytes;
};

} // namespace amla
