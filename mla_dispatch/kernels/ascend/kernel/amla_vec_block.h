// Vector (AIV) side of the AMLA decode kernel: online softmax, the AMLA rescale, final normalisation.
//
// STATUS: written, not compiled or run on hardware. The op order of every step below is the
// order of mla_dispatch/kernels/ascend/amla_emulation.py (amla_rows), which is the oracle.
//
// Each AIV of the 1:2 group owns half of a row tile's rows and processes them kVecRows at a time.
// Per KV block i:
//   vec1:    wait QK_READY(i); S -> UB; scale; mask tokens past each row's visible range; m, P, l;
//            n = rint(-m/ln2); s32 = exp((m/ln2 + n) ln2); s16 = fp32(bf16(s32));
//            P~ = bf16(P * s16) -> GM probs ring; c = s32/s16; eps = (c_prev/c - 1) * 1.5;
//            N = int32(rint((max(n - n_prev, -30) + (eps + 1e-6)) * 2^23)); SCORES_FREE, PROBS_READY.
//   nupdate: block 0: O <- 2^-80 (plain copy); block i > 0: wait PV_DONE(i-1), then the int32 atomic add
//            of N (broadcast to 128 columns, 4 column groups) onto O's bits in GM. NUPDATE_DONE(i).
//   vec2:    after the last block: wait PV_DONE(last); O -> UB; O = (|O| <= 1e10) ? O : 0 (NaN -> 0 too);
//            out = O / (l * s16_last) -> bf16 out (or fp32 partial); lse = m + ln(l).
#pragma once

#include "amla_common.h"

namespace amla {

template <typename T>
class AmlaVecBlock {
public:
    __aicore__ inline void Init(GM_ADDR out, GM_ADDR lse, GM_ADDR seqlens, GM_ADDR workspace, const TilingView &tv,
                                TPipe *pipe) {
        tv_ = tv;
        const AmlaTilingHeader &h = tv_.h;
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(out));
        lseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(lse));
        seqlens_ = reinterpret_cast<__gm__ int32_t *>(seqlens);
        const uint32_t cube = GetBlockIdx() / 2;  // two AIV per AIC in a MIX 1:2 launch
        GM_ADDR core = workspace + uint64_t(cube) * h.wsPerCoreBytes;
        scoresGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(core + h.wsScoresOffset));
        probsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(core + h.wsProbsOffset));
        accumGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(core + h.wsAccumOffset));
        accumBitsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(core + h.wsAccumOffset));  // same bytes
        partialOutGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(workspace + h.wsPartialOutOffset));
        partialLseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(workspace + h.wsPartialLseOffset));
        // UB plan = host/tiling.cpp PlanBuffers (UB part), checked there against 192 KB.
        pipe->InitBuffer(sUb_, 2 * kVecRows * kKvBlock * sizeof(float));
        pipe->InitBuffer(pUb_, 2 * kVecRows * kKvBlock * sizeof(T));
        pipe->InitBuffer(stateUb_, (kMaxRows / 2) * 5 * sizeof(float) * kPreload);
        pipe->InitBuffer(bcastUb_, 64 * kBcastCols * sizeof(int32_t));
        pipe->InitBuffer(tmpUb_, kVecRows * kKvBlock * sizeof(float));
    }

    __aicore__ inline void Process() {
        const uint32_t cube = GetBlockIdx() / 2;
        const int32_t begin = tv_.partOffsets[cube];
        const int32_t end = tv_.partOffsets[cube + 1];
        for (int32_t i = begin; i < end; ++i) {
            const AmlaWorkItem item = tv_.items[i];
            const int32_t length = seqlens_[item.req];
            const uint32_t nBlocks = CeilDivU(uint32_t(item.tokEnd - item.tokBegin), kKvBlock);
            for (uint32_t rt = 0; rt < tv_.h.numRowTiles; ++rt) {
                RowRange(rt);
                if (rowCount_ == 0) {
                    continue;
                }
                if (nBlocks == 0) {
                    WriteEmpty(item);
                    continue;
                }
                for (uint32_t s = 0; s < nBlocks; ++s) {
                    Vec1(item, length, s);
                    NUpdate(s);
                }
                Vec2(item, nBlocks);
                ++tileCounter_;
            }
        }
    }

private:
    // This AIV's rows of row tile rt: the first AIV takes the first ceil(half/16)*16 rows.
    __aicore__ inline void RowRange(uint32_t rt) {
        const uint32_t r0 = rt * tv_.h.rowTile;
        const uint32_t tileRows = (tv_.h.rows - r0 < tv_.h.rowTile) ? tv_.h.rows - r0 : tv_.h.rowTile;
        const uint32_t firstHalf = (tileRows <= 16) ? tileRows : CeilDivU(CeilDivU(tileRows, 2), 16) * 16;
        const bool second = (GetSubBlockIdx() == 1);
        rowBegin_ = r0 + (second ? firstHalf : 0);
        rowCount_ = second ? tileRows - firstHalf : firstHalf;
        rowTileBase_ = r0;
    }

    // State vectors for this AIV's rows (<= 256): m, l, n, c, s16.
    __aicore__ inline LocalTensor<float> State(uint32_t which) {
        return stateUb_.Get<float>()[which * (kMaxRows / 2)];
    }
    enum { M = 0, L = 1, N = 2, C = 3, S16 = 4 };

    __aicore__ inline void Vec1(const AmlaWorkItem &item, int32_t length, uint32_t s) {
        const uint32_t ring = s % kPreload;
        const uint32_t blockStart = uint32_t(item.tokBegin) + s * kKvBlock;
        const uint32_t blockLen = (uint32_t(item.tokEnd) - blockStart < kKvBlock) ? uint32_t(item.tokEnd) - blockStart
                                                                                  : kKvBlock;
        CrossCoreWaitFlag(QK_READY + ring);
        LocalTensor<int32_t> nOut = bcastUb_.Get<int32_t>();  // N per row, broadcast later
        for (uint32_t r = 0; r < rowCount_; r += kVecRows) {
            const uint32_t rows = (rowCount_ - r < kVecRows) ? rowCount_ - r : kVecRows;
            const uint32_t local = rowBegin_ - rowTileBase_ + r;  // row inside the tile (GM ring row)
            LocalTensor<float> sc = sUb_.Get<float>()[(r / kVecRows % 2) * kVecRows * kKvBlock];
            DataCopy(sc, scoresGm_[uint64_t(ring) * tv_.h.rowTile * kKvBlock + uint64_t(local) * kKvBlock],
                     rows * kKvBlock);
            SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
            WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
            Muls(sc, sc, tv_.h.softmaxScale, rows * kKvBlock);
            SetFlag<HardEvent::V_S>(EVENT_ID0);
            WaitFlag<HardEvent::V_S>(EVENT_ID0);
            for (uint32_t k = 0; k < rows; ++k) {
                const uint32_t row = rowBegin_ + r + k;  // row of the request (token-major)
                const int32_t vis = VisibleKeys(tv_.h, length, row) - int32_t(blockStart);
                const uint32_t valid = vis <= 0 ? 0 : (uint32_t(vis) < blockLen ? uint32_t(vis) : blockLen);
                // Tokens past the row's visible range (block tail, causal cut) -> -inf. Vector operands
                // must start 32-byte aligned: the up-to-7 elements before the next multiple of 8 are set
                // by the scalar unit, the rest by Duplicate.
                const uint32_t aligned = CeilDivU(valid, 8) * 8;
                for (uint32_t t = valid; t < aligned && t < kKvBlock; ++t) {
                    sc.SetValue(k * kKvBlock + t, kNegInf);
                }
                if (aligned < kKvBlock) {
                    SetFlag<HardEvent::S_V>(EVENT_ID0);
                    WaitFlag<HardEvent::S_V>(EVENT_ID0);
                    Duplicate(sc[k * kKvBlock + aligned], kNegInf, kKvBlock - aligned);
                }
            }
            SetFlag<HardEvent::S_V>(EVENT_ID0);
            WaitFlag<HardEvent::S_V>(EVENT_ID0);
            PipeBarrier<PIPE_V>();
            Step(sc, rows, r, s, ring, nOut);
        }
        CrossCoreSetFlag<kSyncMode, PIPE_MTE2>(SCORES_FREE + ring);
        CrossCoreSetFlag<kSyncMode, PIPE_MTE3>(PROBS_READY + ring);
    }

    // One UB pass: the AMLA step for `rows` rows whose scores are in `sc` ([rows, 512], scaled, masked).
    __aicore__ inline void Step(const LocalTensor<float> &sc, uint32_t rows, uint32_t r, uint32_t s, uint32_t ring,
                                const LocalTensor<int32_t> &nOut) {
        LocalTensor<float> tmp = tmpUb_.Get<float>();
        LocalTensor<T> pt = pUb_.Get<T>()[(r / kVecRows % 2) * kVecRows * kKvBlock];
        for (uint32_t k = 0; k < rows; ++k) {
            const uint32_t j = r + k;  // index into this AIV's state vectors
            LocalTensor<float> row = sc[k * kKvBlock];
            ReduceMax(tmp, row, tmp[kKvBlock], kKvBlock, false);
            SetFlag<HardEvent::V_S>(EVENT_ID0);
            WaitFlag<HardEvent::V_S>(EVENT_ID0);
            const float mOld = (s == 0) ? kNegInf : State(M).GetValue(j);
            const float rmax = tmp.GetValue(0);
            const float mNew = rmax > mOld ? rmax : mOld;
            const bool seen = mNew > kNegInf;  // a row with no visible key so far computes with m = 0
            const float mSafe = seen ? mNew : 0.0f;
            // P = exp(S - m) (masked entries: exp(-inf) = 0)
            Adds(row, row, -mSafe, kKvBlock);
            PipeBarrier<PIPE_V>();
            Exp(row, row, kKvBlock);
            PipeBarrier<PIPE_V>();
            ReduceSum(tmp, row, tmp[kKvBlock], kKvBlock);
            SetFlag<HardEvent::V_S>(EVENT_ID0);
            WaitFlag<HardEvent::V_S>(EVENT_ID0);
            const float rowSum = tmp.GetValue(0);
            // l = l * exp(m_old - m) + rowsum(P); exp computed on the vector unit like the emulation's torch.exp
            float alpha = 0.0f;
            if (s > 0 && mOld > kNegInf) {
                tmp.SetValue(0, mOld - mSafe);
                Exp(tmp, tmp, 8);
                SetFlag<HardEvent::V_S>(EVENT_ID0);
                WaitFlag<HardEvent::V_S>(EVENT_ID0);
                alpha = tmp.GetValue(0);
            }
            const float lOld = (s == 0) ? 0.0f : State(L).GetValue(j);
            const float l = lOld * alpha + rowSum;
            // n = rint(m * (-1/ln2)); dn = n - n_prev (0 for block 0)
            const float n = RintF(mSafe * (-kRecipLn2));
            const float dn = (s == 0) ? 0.0f : n - State(N).GetValue(j);
            // s32 = exp((m * (1/ln2) + n) * ln2); s16 = fp32(bf16(s32))
            tmp.SetValue(0, (mSafe * kRecipLn2 + n) * kLn2);
            Exp(tmp, tmp, 8);
            PipeBarrier<PIPE_V>();
            Cast(tmp.template ReinterpretCast<T>()[64], tmp, RoundMode::CAST_RINT, 8);
            PipeBarrier<PIPE_V>();
            Cast(tmp[64], tmp.template ReinterpretCast<T>()[64], RoundMode::CAST_NONE, 8);
            SetFlag<HardEvent::V_S>(EVENT_ID0);
            WaitFlag<HardEvent::V_S>(EVENT_ID0);
            const float s32 = tmp.GetValue(0);
            const float s16 = tmp.GetValue(64);
            // P~ = bf16(P * s16)
            Muls(row, row, s16, kKvBlock);
            PipeBarrier<PIPE_V>();
            Cast(pt[k * kKvBlock], row, RoundMode::CAST_RINT, kKvBlock);
            // compensation: eps = (c_prev / c - 1) * 1.5; N = int32(rint((max(dn, -30) + (eps + 1e-6)) * 2^23))
            const float c = s32 / s16;
            const float cPrev = (s == 0) ? 1.0f : State(C).GetValue(j);
            const float eps = (cPrev / c - 1.0f) * kEpsMantissa;
            const float dnc = dn > kDnClamp ? dn : kDnClamp;
            nOut.SetValue(j, int32_t(RintF((dnc + (eps + kEpsBias)) * kMantissaOne)));
            State(M).SetValue(j, mNew);
            State(L).SetValue(j, l);
            State(N).SetValue(j, n);
            State(C).SetValue(j, c);
            State(S16).SetValue(j, s16);
        }
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        const uint32_t local = rowBegin_ - rowTileBase_ + r;
        DataCopy(probsGm_[uint64_t(ring) * tv_.h.rowTile * kKvBlock + uint64_t(local) * kKvBlock], pt,
                 rows * kKvBlock);
    }

    // Round half to even in fp32 (CAST_RINT semantics on the scalar unit): |x| < 2^22 here.
    __aicore__ static inline float RintF(float x) {
        const float magic = 12582912.0f;  // 1.5 * 2^23
        return (x >= 0.0f) ? (x + magic) - magic : (x - magic) + magic;
    }

    __aicore__ inline uint64_t AccumBase() const {
        return uint64_t(tileCounter_ % kPreload) * tv_.h.rowTile * kHeadDimV;
    }

    __aicore__ inline void NUpdate(uint32_t s) {
        const uint32_t ring = s % kPreload;
        const uint64_t base = AccumBase() + uint64_t(rowBegin_ - rowTileBase_) * kHeadDimV;
        LocalTensor<int32_t> bc = bcastUb_.Get<int32_t>()[kMaxRows / 2];  // after the N vector
        if (s == 0) {
            // O <- 2^-80 everywhere: no element is exactly 0 when the first int32 add lands.
            Duplicate(bc, kFirstBlockBias, 16 * kHeadDimV / 2);
            SetFlag<HardEvent::V_MTE3>(EVENT_ID1);
            WaitFlag<HardEvent::V_MTE3>(EVENT_ID1);
            for (uint32_t r = 0; r < rowCount_; r += 8) {
                const uint32_t rows = (rowCount_ - r < 8) ? rowCount_ - r : 8;
                DataCopy(accumBitsGm_[base + uint64_t(r) * kHeadDimV], bc, rows * kHeadDimV);
            }
        } else {
            CrossCoreWaitFlag(PV_DONE + (s - 1) % kPreload);  // P~_{s-1} V_{s-1} has landed in O
            LocalTensor<int32_t> nOut = bcastUb_.Get<int32_t>();
            for (uint32_t r = 0; r < rowCount_; r += 8) {
                const uint32_t rows = (rowCount_ - r < 8) ? rowCount_ - r : 8;
                for (uint32_t k = 0; k < rows; ++k) {  // N[row] -> 128 columns
                    Duplicate(bc[k * kBcastCols], nOut.GetValue(r + k), kBcastCols);
                }
                SetFlag<HardEvent::V_MTE3>(EVENT_ID1);
                WaitFlag<HardEvent::V_MTE3>(EVENT_ID1);
                DataCopyParams p;
                p.blockCount = rows;
                p.blockLen = kBcastCols * sizeof(int32_t) / 32;
                p.srcStride = 0;
                p.dstStride = (kHeadDimV - kBcastCols) * sizeof(int32_t) / 32;
                SetAtomicAdd<int32_t>();  // two's-complement add on the fp32 bit patterns: the AMLA rescale
                for (uint32_t g = 0; g < kHeadDimV / kBcastCols; ++g) {
                    DataCopy(accumBitsGm_[base + uint64_t(r) * kHeadDimV + g * kBcastCols], bc, p);
                }
                SetAtomicNone();
                SetFlag<HardEvent::MTE3_V>(EVENT_ID1);
                WaitFlag<HardEvent::MTE3_V>(EVENT_ID1);
            }
        }
        CrossCoreSetFlag<kSyncMode, PIPE_MTE3>(NUPDATE_DONE + ring);
    }

    __aicore__ inline void Vec2(const AmlaWorkItem &item, uint32_t nBlocks) {
        CrossCoreWaitFlag(PV_DONE + (nBlocks - 1) % kPreload);
        const uint64_t base = AccumBase() + uint64_t(rowBegin_ - rowTileBase_) * kHeadDimV;
        LocalTensor<float> o = sUb_.Get<float>();
        LocalTensor<float> tmp = tmpUb_.Get<float>();
        LocalTensor<uint8_t> mask = pUb_.Get<uint8_t>();
        for (uint32_t r = 0; r < rowCount_; r += kVecRows) {
            const uint32_t rows = (rowCount_ - r < kVecRows) ? rowCount_ - r : kVecRows;
            DataCopy(o, accumGm_[base + uint64_t(r) * kHeadDimV], rows * kHeadDimV);
            SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
            WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
            // Guard: keep O only where |O| <= 1e10 (false for NaN, so NaN -> 0 as well).
            Abs(tmp, o, rows * kHeadDimV);
            PipeBarrier<PIPE_V>();
            CompareScalar(mask, tmp, kZeroGuard, CMPMODE::LE, rows * kHeadDimV);
            PipeBarrier<PIPE_V>();
            Select(o, mask, o, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, rows * kHeadDimV);
            PipeBarrier<PIPE_V>();
            for (uint32_t k = 0; k < rows; ++k) {
                const uint32_t j = r + k;
                const float l = State(L).GetValue(j);
                const float denom = l * State(S16).GetValue(j);
                const uint32_t row = rowBegin_ + j;
                float lseValue;
                if (l > 0.0f) {
                    Muls(o[k * kHeadDimV], o[k * kHeadDimV], 1.0f / denom, kHeadDimV);  // emulation: o / (l * s16)
                    tmp.SetValue(0, l);
                    Ln(tmp, tmp, 8);
                    SetFlag<HardEvent::V_S>(EVENT_ID0);
                    WaitFlag<HardEvent::V_S>(EVENT_ID0);
                    lseValue = State(M).GetValue(j) + tmp.GetValue(0);
                } else {
                    Duplicate(o[k * kHeadDimV], 0.0f, kHeadDimV);
                    lseValue = item.slot >= 0 ? kNegInf : -kNegInf;  // partial: -inf; final: +inf
                }
                WriteLse(item, row, lseValue);
            }
            PipeBarrier<PIPE_V>();
            WriteOut(item, o, r, rows);
        }
    }

    __aicore__ inline void WriteOut(const AmlaWorkItem &item, const LocalTensor<float> &o, uint32_t r, uint32_t rows) {
        const uint32_t row0 = rowBegin_ + r;
        if (item.slot >= 0) {  // partial: fp32 [slot, row, 512]
            SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
            DataCopy(partialOutGm_[(uint64_t(item.slot) * tv_.h.rows + row0) * kHeadDimV], o, rows * kHeadDimV);
        } else {  // final: out[req, i, h, :] in T (row = i * heads + h is contiguous per request)
            LocalTensor<T> ot = pUb_.Get<T>()[kVecRows * kKvBlock];
            Cast(ot, o, RoundMode::CAST_RINT, rows * kHeadDimV);
            SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
            DataCopy(outGm_[(uint64_t(item.req) * tv_.h.rows + row0) * kHeadDimV], ot, rows * kHeadDimV);
        }
        SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    }

    // lse[req, h, i] for row = i * heads + h (the FlashMLA layout [B, h_q, s_q]); partial: [slot, row].
    __aicore__ inline void WriteLse(const AmlaWorkItem &item, uint32_t row, float value) {
        if (item.slot >= 0) {
            partialLseGm_.SetValue(uint64_t(item.slot) * tv_.h.rows + row, value);
        } else {
            const uint32_t i = row / tv_.h.numHeads, h = row % tv_.h.numHeads;
            lseGm_.SetValue((uint64_t(item.req) * tv_.h.numHeads + h) * tv_.h.qLen + i, value);
        }
    }

    // A request with no tokens: out = 0, lse = +inf (never split: its single item has slot -1).
    __aicore__ inline void WriteEmpty(const AmlaWorkItem &item) {
        LocalTensor<T> z = pUb_.Get<T>();
        Duplicate(z, T(0), kVecRows * kHeadDimV);
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        for (uint32_t r = 0; r < rowCount_; r += kVecRows) {
            const uint32_t rows = (rowCount_ - r < kVecRows) ? rowCount_ - r : kVecRows;
            DataCopy(outGm_[(uint64_t(item.req) * tv_.h.rows + rowBegin_ + r) * kHeadDimV], z, rows * kHeadDimV);
            for (uint32_t k = 0; k < rows; ++k) {
                WriteLse(item, rowBegin_ + r + k, -kNegInf);
            }
        }
    }

    TilingView tv_;
    GlobalTensor<T> outGm_, probsGm_;
    GlobalTensor<float> lseGm_, scoresGm_, accumGm_, partialOutGm_, partialLseGm_;
    GlobalTensor<int32_t> accumBitsGm_;
    __gm__ int32_t *seqlens_ = nullptr;
    TBuf<TPosition::VECCALC> sUb_, pUb_, stateUb_, bcastUb_, tmpUb_;
    uint32_t rowBegin_ = 0, rowCount_ = 0, rowTileBase_ = 0, tileCounter_ = 0;
};

}  // namespace amla
