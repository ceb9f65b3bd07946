// Host tiling of the AMLA decode kernel: work partition, on-chip buffer plan, GM workspace.
// Plain C++17, no CANN headers (unit-tested with g++: host/tiling_test.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../kernel/tiling_data.h"

namespace amla {

// Ascend 910B (Atlas A2) per-core memories, bytes.
struct CoreMemory {
    uint64_t l1 = 512 * 1024;
    uint64_t l0a = 64 * 1024;
    uint64_t l0b = 64 * 1024;
    uint64_t l0c = 128 * 1024;
    uint64_t ub = 192 * 1024; // per vector core (AIV)
};

// Split-KV work partition: the requests laid end to end on one cost axis (one unit per
// 512-token block plus `overhead` per request), cut into numCores equal parts. The same
// algorithm as mla_dispatch.metadata.schedule.split_kv_schedule(chunk_size=512), so the emulation's
// schedule and the kernel's are identical (checked by tests/test_ascend_tiling.py).
struct Partition {
    std::vector<AmlaWorkItem> items;   // in part order, requests increasing within a part
    std::vector<int32_t> partOffsets;  // numCores + 1
    std::vector<int32_t> numSplits;    // per request
    uint32_t numSlots = 0;
};

Partition PartitionWork(const std::vector<int32_t> &seqlens, uint32_t numCores, uint32_t overhead = 1);

// One on-chip buffer: where it lives, what it holds, its size, and how many copies (ping-pong).
struct Buffer {
    std::string memory; // "L1", "L0A", "L0B", "L0C", "UB"
    std::string name;
    uint64_t bytes;
    uint32_t copies;
    uint64_t Total() const { return bytes * copies; }
};

struct BufferPlan {
    uint32_t rowTile;     // cube M (query rows per tile)
    uint32_t tokenTile;   // cube N for QK / K for PV (KV tokens per L0 tile)
    uint32_t depthTile;   // cube K for QK (head-dim slice per L0 tile)
    uint32_t vecRows;     // rows a vector core processes per UB pass
    std::vector<Buffer> buffers;
    uint64_t Used(const std::string &memory) const;
};

// Buffers for a row tile of `rowTile` rows (bf16/fp16 operands: 2 bytes).
BufferPlan PlanBuffers(uint32_t rowTile, uint32_t tokenTile = 128, uint32_t depthTile = 128, uint32_t vecRows = 16);

// Empty when the plan fits every memory; else one message per overflow ("L1: 540672 > 524288 bytes").
std::vector<std::string> CheckFits(const BufferPlan &plan, const CoreMemory &mem = CoreMemory());

// Everything the launch needs. Throws std::invalid_argument naming the argument on bad input.
struct AmlaTiling {
    AmlaTilingHeader header;
    Partition partition;
    BufferPlan buffers;
    std::vector<uint8_t> Serialize() const; // header | items | partOffsets
};

AmlaTiling ComputeTiling(const std::vector<int32_t> &seqlens, uint32_t qLen, uint32_t numHeads, uint32_t pageSize,
                         uint32_t maxBlocks, uint32_t numCores, float softmaxScale, bool causal, bool bf16);

} // namespace amla
