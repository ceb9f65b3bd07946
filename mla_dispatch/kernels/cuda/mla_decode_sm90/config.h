// Constants of the SM90 MLA decode family that its plan needs before anything is built: the head dimensions, the
// tile shape, the cache formats, the mainloops and what each takes. Plain C++ (no CUDA, no torch): the kernels, the
// launcher and the binding include it. mla_dispatch/backends/cuda_sm90.py mirrors these values (it decides a plan on
// machines with no compiler), and tests/test_cuda_sm90_plan.py reads them from this file and compares.
#pragma once

namespace mla_sm90 {

constexpr int kHeadDimQK = 576;  // kv_lora_rank 512 + rope 64
constexpr int kHeadDimV = 512;
constexpr int kDsMlaTokenBytes = 656;  // fp8_ds_mla: 512 fp8 NoPE, 4 fp32 scales, 64 bf16 RoPE
// fp8_ds_v4 (DeepSeek-V4, FlashMLA's MODEL1; kvcache/formats.py): D_qk = D_v = 512, laid out per block: each token's
// 448 fp8 NoPE bytes and 64 bf16 RoPE values (kDsV4DataBytes, one token after the other), then each token's 7 ue8m0
// scales (one per 64 NoPE values) and a pad byte; kDsV4TokenBytes is the cache tensor's last dim
constexpr int kDsV4HeadDim = 512;
constexpr int kDsV4DataBytes = 576;
constexpr int kDsV4TokenBytes = 584;
constexpr int kBlockM = 64;  // query rows (s_q x heads of one KV head) of a CTA tile of the 64-row mainloops
constexpr int kBlockN = 64;  // KV tokens per mainloop step = the split-KV chunk size

// KV storage formats.
enum KvFormat : int {
  kKvSameAsQ = 0,   // bf16 or fp16, same dtype as q
  kKvFp8E4M3 = 1,   // float8_e4m3fn, one per-tensor fp32 scale (kv_scale)
  kKvFp8DsMla = 2,  // kDsMlaTokenBytes per token
  kKvFp8DsV4 = 3,   // DeepSeek-V4's per-block layout (kDsV4*); sparse only
};

// The mainloops a plan can pick (its `variant`). Each has one name, the enum member's in snake case: its folder
// (or, for the fp8t pair, its header in fp8t/), its kernel `mla_decode_<name>` and its entry of the Python table
// (backends/cuda_sm90.py, MAINLOOPS; tests/test_cuda_sm90_plan.py checks they agree). The numbers are the plans'.
enum Mainloop : int {
  kWgmma = 2,        // wgmma/: 64-row tiles, S -> softmax -> P V per tile in both warpgroups
  kSeesaw = 5,       // seesaw/: 64-row tiles, two tiles in flight (bf16/fp16 caches)
  kEtap = 6,         // etap/: KV tokens on the wgmma M side, 16 or 32 query rows
  kFp8tConvert = 7,  // fp8t/fp8t_convert.cuh: tokens on M for fp8_e4m3 (sparse: any fp8), a converting warpgroup
  kFp8tRegs = 8,     // fp8t/fp8t_regs.cuh: tokens on M for fp8_e4m3, the tile converted in registers
  kSeesawFp8 = 9,    // seesaw_fp8/: seesaw's schedule, fp8_e4m3 (sparse: fp8_ds_mla/_v4), a converting warpgroup
};

// seesaw and seesaw_fp8 leave their steady-state tiles unmasked, which needs every causal limit within the last 65
// tokens of a request: query lengths up to 64.
constexpr int kSeesawMaxQLen = 64;
// Query rows per KV head the tokens-on-M mainloops take: etap with a bf16/fp16 cache, etap with an fp8 cache (its
// register-staged tile does not fit beside 32 rows' accumulators), fp8t_convert and fp8t_regs. Their CTA tile has 16
// or 32 rows.
constexpr int kEtapMaxRows = 32;
constexpr int kEtapFp8MaxRows = 16;
constexpr int kFp8tMaxRows = 32;
// Split-KV parts a fused combine can merge (its list of split requests in shared memory: at most num_parts - 1).
constexpr int kFusedMaxSplits = 1024;

}  // namespace mla_sm90
