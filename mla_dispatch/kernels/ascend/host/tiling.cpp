// Host tiling of the AMLA decode kernel (see tiling.h).
#include "tiling.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace amla {

namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

void Require(bool ok, const std::string &msg) {
    if (!ok) {
        throw std::invalid_argument(msg);
    }
}

} // namespace

Partition PartitionWork(const std::vector<int32_t> &seqlens, uint32_t numCores, uint32_t overhead) {
    Require(numCores >= 1, "numCores must be >= 1, got " + std::to_string(numCores));
    Require(overhead >= 1, "overhead must be >= 1, got " + std::to_string(overhead));
    const size_t batch = seqlens.size();
    Partition p;
    p.numSplits.assign(batch, 0);
    p.partOffsets.assign(numCores + 1, 0);
    if (batch == 0) {
        return p;
    }
    // Cost axis: request b occupies [start[b], start[b] + cost[b]).
    std::vector<int64_t> start(batch), chunks(batch);
    int64_t total = 0;
    for (size_t b = 0; b < batch; ++b) {
        Require(seqlens[b] >= 0, "seqlens[" + std::to_string(b) + "] must be >= 0, got " + std::to_string(seqlens[b]));
        chunks[b] = CeilDiv(static_cast<uint64_t>(seqlens[b]), kKvBlock);
        start[b] = total;
        total += chunks[b] + overhead;
    }
    const int64_t perPart = static_cast<int64_t>(CeilDiv(total, numCores));
    // Walk the requests; a part boundary inside a request's token chunks splits it.
    for (uint32_t part = 0; part < numCores; ++part) {
        const int64_t lo = std::min<int64_t>(total, part * perPart);
        const int64_t hi = std::min<int64_t>(total, (part + 1) * perPart);
        p.partOffsets[part] = static_cast<int32_t>(p.items.size());
        for (size_t b = 0; b < batch && lo < hi; ++b) {
            const int64_t s = start[b], e = start[b] + chunks[b] + overhead;
            if (e <= lo || s >= hi) {
                continue;
            }
            const int64_t tokenStart = s + overhead; // axis position of the first token chunk
            const int64_t cLo = std::max<int64_t>(lo, tokenStart) - tokenStart;
            const int64_t cHi = std::min<int64_t>(hi, e) - tokenStart;
            const int32_t tb = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(cLo, 0) * kKvBlock, seqlens[b]));
            const int32_t te = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(cHi, 0) * kKvBlock, seqlens[b]));
            const bool ownsEmpty = chunks[b] == 0 && s >= lo; // a zero-length request's owner: where it starts
            if (te > tb || ownsEmpty) {
                p.items.push_back({static_cast<int32_t>(b), tb, te, -1});
                p.numSplits[b] += 1;
            }
        }
    }
    p.partOffsets[numCores] = static_cast<int32_t>(p.items.size());
    // Slots for split requests, in request order then token order.
    std::vector<int32_t> firstSlot(batch, -1);
    int32_t next = 0;
    for (size_t b = 0; b < batch; ++b) {
        if (p.numSplits[b] > 1) {
            firstSlot[b] = next;
            next += p.numSplits[b];
        }
    }
    p.numSlots = static_cast<uint32_t>(next);
    std::vector<int32_t> rank(batch, 0);
    // Items are in part order = cost-axis order, so a request's pieces appear in token order.
    for (auto &it : p.items) {
        if (firstSlot[it.req] >= 0) {
            it.slot = firstSlot[it.req] + rank[it.req]++;
        }
    }
    return p;
}

uint64_t BufferPlan::Used(const std::string &memory) const {
    uint64_t sum = 0;
    for (const auto &b : buffers) {
        if (b.memory == memory) {
            sum += b.Total();
        }
    }
    return sum;
}

BufferPlan PlanBuffers(uint32_t rowTile, uint32_t tokenTile, uint32_t depthTile, uint32_t vecRows) {
    constexpr uint64_t kIn = 2;  // bf16 / fp16 operand bytes
    constexpr uint64_t kAcc = 4; // fp32
    BufferPlan p{rowTile, tokenTile, depthTile, vecRows, {}};
    // L1: the Q tile stays resident for the whole work item; K tiles of tokenTile tokens x 576 are
    // double-buffered and also serve as V (V = K[:, :512], the MLA property: V is never loaded
    // twice); the P~ tile of the PV matmul is double-buffered.
    p.buffers.push_back({"L1", "Q tile [rowTile, 576]", uint64_t(rowTile) * kHeadDimQk * kIn, 1});
    p.buffers.push_back({"L1", "K/V tile [tokenTile, 576]", uint64_t(tokenTile) * kHeadDimQk * kIn, 2});
    p.buffers.push_back({"L1", "P~ tile [rowTile, tokenTile]", uint64_t(rowTile) * tokenTile * kIn, 2});
    // L0A/L0B: one K-slice of each operand, ping-pong. QK: A = Q[:, k0:k0+depth], B = K[n, k0:k0+depth];
    // PV: A = P~[:, n], B = V[n, d0:d0+depthTile]. The larger of the two uses sizes the buffer.
    p.buffers.push_back({"L0A", "A slice (Q or P~)", uint64_t(rowTile) * std::max(depthTile, tokenTile) * kIn, 2});
    p.buffers.push_back({"L0B", "B slice (K or V)", uint64_t(tokenTile) * depthTile * kIn, 2});
    // L0C: fp32 result tile, ping-pong (S [rowTile, tokenTile] or O [rowTile, depthTile]).
    p.buffers.push_back({"L0C", "fp32 result tile", uint64_t(rowTile) * std::max(tokenTile, depthTile) * kAcc, 2});
    // UB (each AIV owns half the rows, processed vecRows at a time over a whole 512-token block).
    p.buffers.push_back({"UB", "S rows in [vecRows, 512] fp32", uint64_t(vecRows) * kKvBlock * kAcc, 2});
    p.buffers.push_back({"UB", "P~ rows out [vecRows, 512] bf16", uint64_t(vecRows) * kKvBlock * kIn, 2});
    p.buffers.push_back({"UB", "row state m,l,n,c,s16 x preload", uint64_t(kMaxRows / 2) * 5 * kAcc * kPreload, 1});
    p.buffers.push_back({"UB", "N broadcast [64, 128] int32", uint64_t(64) * 128 * 4, 1});
    p.buffers.push_back({"UB", "vector temporaries [vecRows, 512] fp32", uint64_t(vecRows) * kKvBlock * kAcc, 1});
    return p;
}

std::vector<std::string> CheckFits(const BufferPlan &plan, const CoreMemory &mem) {
    std::vector<std::string> errors;
    const std::pair<const char *, uint64_t> caps[] = {
        {"L1", mem.l1}, {"L0A", mem.l0a}, {"L0B", mem.l0b}, {"L0C", mem.l0c}, {"UB", mem.ub}};
    for (const auto &cap : caps) {
        const uint64_t used = plan.Used(cap.first);
        if (used > cap.second) {
            errors.push_back(std::string(cap.first) + ": " + std::to_string(used) + " > " + std::to_string(cap.second) +
                             " bytes");
        }
    }
    for (const auto &b : plan.buffers) {
        if (b.bytes % 32 != 0) {
            errors.push_back(b.memory + " buffer '" + b.name + "' is not 32-byte aligned (" + std::to_string(b.bytes) + ")");
        }
    }
    return errors;
}

AmlaTiling ComputeTiling(const std::vector<int32_t> &seqlens, uint32_t qLen, uint32_t numHeads, uint32_t pageSize,
                         uint32_t maxBlocks, uint32_t numCores, float softmaxScale, bool causal, bool bf16) {
    Require(qLen >= 1 && qLen <= 4, "qLen (s_q) must be in [1, 4], got " + std::to_string(qLen));
    Require(numHeads >= 1 && numHeads <= 128, "numHeads (h_q) must be in [1, 128], got " + std::to_string(numHeads));
    Require(pageSize >= 16 && kKvBlock % pageSize == 0,
            "pageSize must divide 512 and be >= 16, got " + std::to_string(pageSize));
    Require(softmaxScale > 0.0f, "softmaxScale must be > 0");
    for (size_t b = 0; b < seqlens.size(); ++b) {
        Require(seqlens[b] <= int64_t(maxBlocks) * pageSize,
                "seqlens[" + std::to_string(b) + "]=" + std::to_string(seqlens[b]) + " exceeds maxBlocks*pageSize=" +
                    std::to_string(uint64_t(maxBlocks) * pageSize));
    }
    AmlaTiling t{};
    const uint32_t rows = qLen * numHeads;
    // Row tiles of <= 128 rows, 16-aligned (the cube's fractal): 512 rows -> 4 tiles of 128.
    const uint32_t numRowTiles = static_cast<uint32_t>(CeilDiv(rows, 128));
    const uint32_t rowTile = static_cast<uint32_t>(CeilDiv(CeilDiv(rows, numRowTiles), 16) * 16);
    t.partition = PartitionWork(seqlens, numCores);
    t.buffers = PlanBuffers(rowTile);
    auto errors = CheckFits(t.buffers);
    Require(errors.empty(), "buffer plan does not fit: " + (errors.empty() ? std::string() : errors[0]));

    AmlaTilingHeader &h = t.header;
    h.batch = static_cast<uint32_t>(seqlens.size());
    h.qLen = qLen;
    h.numHeads = numHeads;
    h.rows = rows;
    h.rowTile = rowTile;
    h.numRowTiles = numRowTiles;
    h.pageSize = pageSize;
    h.maxBlocks = maxBlocks;
    h.numCores = numCores;
    h.numItems = static_cast<uint32_t>(t.partition.items.size());
    h.numSlots = t.partition.numSlots;
    h.causal = causal ? 1 : 0;
    h.softmaxScale = softmaxScale;
    h.dtypeIsBf16 = bf16 ? 1 : 0;
    // GM workspace, per core, 512-byte aligned regions.
    auto align = [](uint64_t x) { return CeilDiv(x, 512) * 512; };
    uint64_t off = 0;
    h.wsScoresOffset = off;
    off += align(uint64_t(kPreload) * rowTile * kKvBlock * 4);
    h.wsProbsOffset = off;
    off += align(uint64_t(kPreload) * rowTile * kKvBlock * 2);
    h.wsAccumOffset = off;
    off += align(uint64_t(kPreload) * rowTile * kHeadDimV * 4);
    h.wsPerCoreBytes = off;
    h.wsPartialOutOffset = off * numCores;
    h.wsPartialLseOffset = h.wsPartialOutOffset + align(uint64_t(h.numSlots) * rows * kHeadDimV * 4);
    h.wsTotalBytes = h.wsPartialLseOffset + align(uint64_t(h.numSlots) * rows * 4);
    return t;
}

std::vector<uint8_t> AmlaTiling::Serialize() const {
    const size_t nItems = partition.items.size();
    const size_t nOffsets = partition.partOffsets.size();
    std::vector<uint8_t> blob(sizeof(AmlaTilingHeader) + nItems * sizeof(AmlaWorkItem) + nOffsets * sizeof(int32_t));
    uint8_t *p = blob.data();
    std::memcpy(p, &header, sizeof(header));
    p += sizeof(header);
    if (nItems) {
        std::memcpy(p, partition.items.data(), nItems * sizeof(AmlaWorkItem));
    }
    p += nItems * sizeof(AmlaWorkItem);
    std::memcpy(p, partition.partOffsets.data(), nOffsets * sizeof(int32_t));
    return blob;
}

} // namespace amla
