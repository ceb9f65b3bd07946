// Cube (AIC) side of the AMLA decode kernel: S = Q K^T and the fp32 atomic add of P~ V into O.
//
// STATUS: written, not compiled or run on hardware.
//
// Per work item (request, 512-aligned token range) and row tile (<= 128 query rows):
//   Q tile -> L1 once (ND -> NZ), resident for the whole range.
//   Pipeline with preload depth 2 (paper Thm 4.1): step s issues QK(s) then PV(s-1), so the vector
//   cores' softmax of block s overlaps the cube's PV of block s-1.
//   QK(s):  for each 128-token tile of block s: gather its K rows through the block table into L1
//           (double-buffered), then for each 128-wide depth slice of 576 (4 x 128 + 64): L1 -> L0A/L0B,
//           Mmad accumulate into L0C; Fixpipe the fp32 [rowTile, 128] tile to the GM scores ring.
//   PV(s):  wait PROBS_READY(s) and NUPDATE_DONE(s) (the vector's int32 add of N_s on O, which must land
//           first: AMLA's ordering); for each 128-column group of D_v = 512: accumulate over the block's
//           128-token tiles P~[:, tile] (L1 -> L0A) x V[tile, cols] (K rows, first 512 channels: V is the
//           K tile re-read, an L2 hit) into L0C; Fixpipe with fp32 atomic add into O.
#pragma once

#include "amla_common.h"

namespace amla {

template <typename T>
class AmlaCubeBlock {
public:
    __aicore__ inline void Init(GM_ADDR q, GM_ADDR kv, GM_ADDR blockTable, GM_ADDR workspace,
                                const TilingView &tv, TPipe *pipe) {
        tv_ = tv;
        const AmlaTilingHeader &h = tv_.h;
        qGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(q));
        kvGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(kv));
        blockTable_ = reinterpret_cast<__gm__ int32_t *>(blockTable);
        GM_ADDR core = workspace + uint64_t(GetBlockIdx()) * h.wsPerCoreBytes;
        scoresGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(core + h.wsScoresOffset));
        probsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(core + h.wsProbsOffset));
        accumGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(core + h.wsAccumOffset));
        // Buffer sizes are those of host/tiling.cpp PlanBuffers (checked there against L1/L0 capacities).
        pipe->InitBuffer(qL1_, h.rowTile * kHeadDimQk * sizeof(T));
        pipe->InitBuffer(kL1_, 2 * kTokenTile * kHeadDimQk * sizeof(T));
        pipe->InitBuffer(pL1_, 2 * h.rowTile * kTokenTile * sizeof(T));
        pipe->InitBuffer(aL0_, 2 * h.rowTile * kDepthTile * sizeof(T));
        pipe->InitBuffer(bL0_, 2 * kTokenTile * kDepthTile * sizeof(T));
        pipe->InitBuffer(cL0_, 2 * h.rowTile * kTokenTile * sizeof(float));
    }

    __aicore__ inline void Process() {
        const int32_t begin = tv_.partOffsets[GetBlockIdx()];
        const int32_t end = tv_.partOffsets[GetBlockIdx() + 1];
        for (int32_t i = begin; i < end; ++i) {
            const AmlaWorkItem item = tv_.items[i];
            const uint32_t nBlocks = CeilDivU(uint32_t(item.tokEnd - item.tokBegin), kKvBlock);
            for (uint32_t rt = 0; rt < tv_.h.numRowTiles; ++rt) {
                if (nBlocks == 0) {
                    continue;  // the vector cores write out = 0, lse = +inf on their own
                }
                LoadQ(item.req, rt);
                for (uint32_t s = 0; s <= nBlocks; ++s) {
                    if (s < nBlocks) {
                        if (s >= kPreload) {
                            CrossCoreWaitFlag(SCORES_FREE + s % kPreload);
                        }
                        ComputeQK(item, rt, s);
                        CrossCoreSetFlag<kSyncMode, PIPE_FIX>(QK_READY + s % kPreload);
                    }
                    if (s >= 1) {
                        ComputePV(item, rt, s - 1);
                    }
                }
                ++tileCounter_;
            }
        }
    }

private:
    __aicore__ inline uint32_t TileRows(uint32_t rt) const {
        const uint32_t r0 = rt * tv_.h.rowTile;
        return (tv_.h.rows - r0 < tv_.h.rowTile) ? tv_.h.rows - r0 : tv_.h.rowTile;
    }

    // Q rows of request `req` are contiguous: q[req, i, h, :] = row (i * heads + h).
    __aicore__ inline void LoadQ(int32_t req, uint32_t rt) {
        LocalTensor<T> qL1 = qL1_.Get<T>();
        const uint32_t rows = TileRows(rt);
        Nd2NzParams p;
        p.ndNum = 1;
        p.nValue = rows;
        p.dValue = kHeadDimQk;
        p.srcNdMatrixStride = 0;
        p.srcDValue = kHeadDimQk;
        p.dstNzC0Stride = CeilDivU(rows, 16) * 16;
        p.dstNzNStride = 1;
        p.dstNzMatrixStride = 0;
        DataCopy(qL1, qGm_[(uint64_t(req) * tv_.h.rows + rt * tv_.h.rowTile) * kHeadDimQk], p);
        SetFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);
    }

    // Gather the K rows of tokens [t0, t0 + n) of `req` into L1 buffer `buf` (NZ), page by page.
    __aicore__ inline void LoadKTile(int32_t req, uint32_t t0, uint32_t n, uint32_t buf) {
        LocalTensor<T> kL1 = kL1_.Get<T>()[buf * kTokenTile * kHeadDimQk];
        uint32_t done = 0;
        while (done < n) {
            const uint32_t t = t0 + done;
            const uint32_t inPage = tv_.h.pageSize - t % tv_.h.pageSize;
            const uint32_t cnt = (n - done < inPage) ? n - done : inPage;
            Nd2NzParams p;
            p.ndNum = 1;
            p.nValue = cnt;
            p.dValue = kHeadDimQk;
            p.srcNdMatrixStride = 0;
            p.srcDValue = kHeadDimQk;
            p.dstNzC0Stride = kTokenTile;
            p.dstNzNStride = 1;
            p.dstNzMatrixStride = 0;
            DataCopy(kL1[done * 16], kvGm_[TokenOffset(blockTable_, tv_.h, req, t)], p);  // rows `done..` of the NZ tile
            done += cnt;
        }
    }

    __aicore__ inline void ComputeQK(const AmlaWorkItem &item, uint32_t rt, uint32_t s) {
        const uint32_t rows = TileRows(rt);
        const uint32_t blockStart = uint32_t(item.tokBegin) + s * kKvBlock;
        const uint32_t blockLen = (uint32_t(item.tokEnd) - blockStart < kKvBlock) ? uint32_t(item.tokEnd) - blockStart
                                                                                  : kKvBlock;
        const uint32_t ring = s % kPreload;
        for (uint32_t nt = 0; nt * kTokenTile < blockLen; ++nt) {
            const uint32_t n = (blockLen - nt * kTokenTile < kTokenTile) ? blockLen - nt * kTokenTile : kTokenTile;
            const uint32_t buf = (kTileCounter_++) & 1;
            WaitFlag<HardEvent::MTE1_MTE2>(buf);  // the L1 K buffer is free (set initially in Run)
            LoadKTile(item.req, blockStart + nt * kTokenTile, n, buf);
            SetFlag<HardEvent::MTE2_MTE1>(buf);
            WaitFlag<HardEvent::MTE2_MTE1>(buf);
            LocalTensor<float> c = cL0_.Get<float>()[buf * tv_.h.rowTile * kTokenTile];
            for (uint32_t k0 = 0; k0 < kHeadDimQk; k0 += kDepthTile) {
                const uint32_t depth = (kHeadDimQk - k0 < kDepthTile) ? kHeadDimQk - k0 : kDepthTile;  // 128 x4, 64
                LocalTensor<T> a = aL0_.Get<T>()[buf * tv_.h.rowTile * kDepthTile];
                LocalTensor<T> b = bL0_.Get<T>()[buf * kTokenTile * kDepthTile];
                LoadSlice(a, qL1_.Get<T>(), CeilDivU(rows, 16) * 16, k0, depth, false);
                LoadSlice(b, kL1_.Get<T>()[buf * kTokenTile * kHeadDimQk], kTokenTile, k0, depth, true);
                SetFlag<HardEvent::MTE1_M>(buf);
                WaitFlag<HardEvent::MTE1_M>(buf);
                MmadParams mp;
                mp.m = rows;
                mp.n = n;
                mp.k = depth;
                mp.cmatrixInitVal = (k0 == 0);
                Mmad(c, a, b, mp);
                SetFlag<HardEvent::M_MTE1>(buf);
                WaitFlag<HardEvent::M_MTE1>(buf);
            }
            SetFlag<HardEvent::MTE1_MTE2>(buf);
            SetFlag<HardEvent::M_FIX>(buf);
            WaitFlag<HardEvent::M_FIX>(buf);
            // S tile -> GM scores ring [ring][row][512] (row stride 512 floats), unscaled fp32.
            FixpipeParamsV220 fp;
            fp.nSize = n;
            fp.mSize = rows;
            fp.srcStride = CeilDivU(rows, 16) * 16;
            fp.dstStride = kKvBlock;
            fp.ndNum = 1;
            Fixpipe(scoresGm_[uint64_t(ring) * tv_.h.rowTile * kKvBlock + nt * kTokenTile], c, fp);
        }
    }

    // P~_s (bf16, GM probs ring) x V_s, added atomically (fp32) onto O after the vector's int32 add.
    __aicore__ inline void ComputePV(const AmlaWorkItem &item, uint32_t rt, uint32_t s) {
        const uint32_t rows = TileRows(rt);
        const uint32_t blockStart = uint32_t(item.tokBegin) + s * kKvBlock;
        const uint32_t blockLen = (uint32_t(item.tokEnd) - blockStart < kKvBlock) ? uint32_t(item.tokEnd) - blockStart
                                                                                  : kKvBlock;
        const uint32_t ring = s % kPreload;
        CrossCoreWaitFlag(PROBS_READY + ring);
        CrossCoreWaitFlag(NUPDATE_DONE + ring);  // AMLA ordering: bits(O) += N_s lands before O += P~_s V_s
        LocalTensor<float> c = cL0_.Get<float>();
        const uint64_t accumBase = uint64_t(tileCounter_ % kPreload) * tv_.h.rowTile * kHeadDimV;
        for (uint32_t d0 = 0; d0 < kHeadDimV; d0 += kDepthTile) {  // 4 column groups of 128
            for (uint32_t nt = 0; nt * kTokenTile < blockLen; ++nt) {
                const uint32_t n = (blockLen - nt * kTokenTile < kTokenTile) ? blockLen - nt * kTokenTile : kTokenTile;
                const uint32_t buf = (kTileCounter_++) & 1;
                WaitFlag<HardEvent::MTE1_MTE2>(buf);
                LoadKTile(item.req, blockStart + nt * kTokenTile, n, buf);  // V = K[:, :512]; L2-resident re-read
                LoadProbs(ring, rows, nt, n, buf);
                SetFlag<HardEvent::MTE2_MTE1>(buf);
                WaitFlag<HardEvent::MTE2_MTE1>(buf);
                LocalTensor<T> a = aL0_.Get<T>()[buf * tv_.h.rowTile * kDepthTile];
                LocalTensor<T> b = bL0_.Get<T>()[buf * kTokenTile * kDepthTile];
                LoadSlice(a, pL1_.Get<T>()[buf * tv_.h.rowTile * kTokenTile], CeilDivU(rows, 16) * 16, 0, n, false);
                LoadSliceTransposed(b, kL1_.Get<T>()[buf * kTokenTile * kHeadDimQk], n, d0, kDepthTile);
                SetFlag<HardEvent::MTE1_M>(buf);
                WaitFlag<HardEvent::MTE1_M>(buf);
                MmadParams mp;
                mp.m = rows;
                mp.n = kDepthTile;
                mp.k = n;
                mp.cmatrixInitVal = (nt == 0);
                Mmad(c, a, b, mp);
                SetFlag<HardEvent::M_MTE1>(buf);
                WaitFlag<HardEvent::M_MTE1>(buf);
                SetFlag<HardEvent::MTE1_MTE2>(buf);
            }
            SetFlag<HardEvent::M_FIX>(EVENT_ID0);
            WaitFlag<HardEvent::M_FIX>(EVENT_ID0);
            FixpipeParamsV220 fp;
            fp.nSize = kDepthTile;
            fp.mSize = rows;
            fp.srcStride = CeilDivU(rows, 16) * 16;
            fp.dstStride = kHeadDimV;
            fp.ndNum = 1;
            SetAtomicAdd<float>();  // every block, block 0 included: O was pre-filled with 2^-80
            Fixpipe(accumGm_[accumBase + d0], c, fp);
            SetAtomicNone();
        }
        CrossCoreSetFlag<kSyncMode, PIPE_FIX>(PV_DONE + ring);
    }

    // P~ rows [0, rows) x tokens [nt*128, nt*128 + n) of the probs ring -> L1 (NZ).
    __aicore__ inline void LoadProbs(uint32_t ring, uint32_t rows, uint32_t nt, uint32_t n, uint32_t buf) {
        Nd2NzParams p;
        p.ndNum = 1;
        p.nValue = rows;
        p.dValue = n;
        p.srcNdMatrixStride = 0;
        p.srcDValue = kKvBlock;
        p.dstNzC0Stride = CeilDivU(rows, 16) * 16;
        p.dstNzNStride = 1;
        p.dstNzMatrixStride = 0;
        DataCopy(pL1_.Get<T>()[buf * tv_.h.rowTile * kTokenTile],
                 probsGm_[uint64_t(ring) * tv_.h.rowTile * kKvBlock + nt * kTokenTile], p);
    }

    // L1 (NZ) -> L0 (ZZ for A, ZN for B) for columns [k0, k0 + depth) of a [rows16, *] matrix.
    __aicore__ inline void LoadSlice(const LocalTensor<T> &dst, const LocalTensor<T> &src, uint32_t rows16,
                                     uint32_t k0, uint32_t depth, bool transpose) {
        LoadData2DParams p;
        p.repeatTimes = CeilDivU(depth, 16) * rows16 / 16;
        p.srcStride = 1;
        p.ifTranspose = transpose;
        LoadData(dst, src[k0 * rows16], p);
    }

    __aicore__ inline void LoadSliceTransposed(const LocalTensor<T> &dst, const LocalTensor<T> &src, uint32_t n,
                                               uint32_t d0, uint32_t depth) {
        LoadData2DParams p;
        p.repeatTimes = CeilDivU(n, 16) * depth / 16;
        p.srcStride = 1;
        p.ifTranspose = false;  // V[n, d] is already the (k, n) operand of P~ V
        LoadData(dst, src[d0 * kTokenTile], p);
    }

    TilingView tv_;
    GlobalTensor<T> qGm_, kvGm_, probsGm_;
    GlobalTensor<float> scoresGm_, accumGm_;
    __gm__ int32_t *blockTable_ = nullptr;
    TBuf<TPosition::A1> qL1_, kL1_, pL1_;
    TBuf<TPosition::A2> aL0_;
    TBuf<TPosition::B2> bL0_;
    TBuf<TPosition::CO1> cL0_;
    uint32_t tileCounter_ = 0;   // (item, row tile) pairs processed: selects the O accumulator ring slot
    uint32_t kTileCounter_ = 0;  // K tiles loaded: selects the L1/L0 ping-pong buffer
};

}  // namespace amla
