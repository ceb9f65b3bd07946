// Split-KV combine (vector cores, after all cores finished their items): the LSE-weighted merge of
// the partial results of split requests. Same math as mla_dispatch.metadata.schedule.combine_splits.
//
// STATUS: written, not compiled or run on hardware.
//
// For a split request and row r with slots k (partial out O_k normalised, lse_k; -inf if the
// piece saw no key for that row):   m = max_k lse_k,  w_k = exp(lse_k - m),
//   out = sum_k w_k O_k / sum_k w_k,   lse = m + ln(sum_k w_k)   (no mass: out 0, lse +inf).
#pragma once

#include "amla_common.h"

namespace amla {

template <typename T>
class AmlaCombine {
public:
    __aicore__ inline void Init(GM_ADDR out, GM_ADDR lse, GM_ADDR workspace, const TilingView &tv, TPipe *pipe) {
        tv_ = tv;
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(out));
        lseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(lse));
        partialOutGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(workspace + tv.h.wsPartialOutOffset));
        partialLseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(workspace + tv.h.wsPartialLseOffset));
        pipe->InitBuffer(inUb_, kHeadDimV * sizeof(float));
        pipe->InitBuffer(accUb_, kHeadDimV * sizeof(float));
        pipe->InitBuffer(outUb_, kHeadDimV * sizeof(T));
        pipe->InitBuffer(tmpUb_, 64 * sizeof(float));
    }

    // Rows of split requests are dealt round-robin over all vector cores.
    __aicore__ inline void Process() {
        const uint32_t nVec = GetBlockNum() * 2;
        uint32_t task = 0;
        for (uint32_t i = 0; i < tv_.h.numItems; ++i) {
            const AmlaWorkItem first = tv_.items[i];
            if (first.slot < 0 || (i > 0 && tv_.items[i - 1].req == first.req && tv_.items[i - 1].slot >= 0)) {
                continue;  // not split, or not the request's first piece
            }
            uint32_t pieces = 0;
            while (i + pieces < tv_.h.numItems && tv_.items[i + pieces].req == first.req) {
                ++pieces;
            }
            for (uint32_t row = 0; row < tv_.h.rows; ++row, ++task) {
                if (task % nVec == GetBlockIdx()) {
                    MergeRow(first.req, uint32_t(first.slot), pieces, row);
                }
            }
        }
    }

private:
    __aicore__ inline float ExpScalar(float x) {
        LocalTensor<float> t = tmpUb_.Get<float>();
        t.SetValue(0, x);
        Exp(t, t, 8);
        SetFlag<HardEvent::V_S>(EVENT_ID0);
        WaitFlag<HardEvent::V_S>(EVENT_ID0);
        return t.GetValue(0);
    }

    __aicore__ inline void MergeRow(int32_t req, uint32_t slot0, uint32_t pieces, uint32_t row) {
        float m = kNegInf;
        for (uint32_t k = 0; k < pieces; ++k) {
            const float l = partialLseGm_.GetValue(uint64_t(slot0 + k) * tv_.h.rows + row);
            m = l > m ? l : m;
        }
        LocalTensor<float> acc = accUb_.Get<float>();
        LocalTensor<float> in = inUb_.Get<float>();
        Duplicate(acc, 0.0f, kHeadDimV);
        float denom = 0.0f;
        const float mSafe = (m > kNegInf) ? m : 0.0f;
        for (uint32_t k = 0; k < pieces; ++k) {
            const float l = partialLseGm_.GetValue(uint64_t(slot0 + k) * tv_.h.rows + row);
            if (!(l > kNegInf)) {
                continue;  // this piece saw no key for the row
            }
            const float w = ExpScalar(l - mSafe);
            denom += w;
            DataCopy(in, partialOutGm_[(uint64_t(slot0 + k) * tv_.h.rows + row) * kHeadDimV], kHeadDimV);
            SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
            WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
            Axpy(acc, in, w, kHeadDimV);
            PipeBarrier<PIPE_V>();
            SetFlag<HardEvent::V_MTE2>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
        }
        float lseValue = -kNegInf;  // +inf: no key anywhere
        if (denom > 0.0f) {
            Muls(acc, acc, 1.0f / denom, kHeadDimV);
            LocalTensor<float> t = tmpUb_.Get<float>();
            t.SetValue(0, denom);
            Ln(t, t, 8);
            SetFlag<HardEvent::V_S>(EVENT_ID0);
            WaitFlag<HardEvent::V_S>(EVENT_ID0);
            lseValue = mSafe + t.GetValue(0);
        }
        PipeBarrier<PIPE_V>();
        LocalTensor<T> o = outUb_.Get<T>();
        Cast(o, acc, RoundMode::CAST_RINT, kHeadDimV);
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        DataCopy(outGm_[(uint64_t(req) * tv_.h.rows + row) * kHeadDimV], o, kHeadDimV);
        const uint32_t i = row / tv_.h.numHeads, h = row % tv_.h.numHeads;
        lseGm_.SetValue((uint64_t(req) * tv_.h.numHeads + h) * tv_.h.qLen + i, lseValue);
        SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    }

    TilingView tv_;
    GlobalTensor<T> outGm_;
    GlobalTensor<float> lseGm_, partialOutGm_, partialLseGm_;
    TBuf<TPosition::VECCALC> inUb_, accUb_, outUb_, tmpUb_;
};

}  // namespace amla
