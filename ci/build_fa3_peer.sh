#!/bin/bash
# Build FlashAttention-3's MLA decode kernels (Dao-AILab/flash-attention hopper/: Q/K head dim 64 with the 512-wide
# latent as qv/V, bf16, paged, split, SM90) on the GPU machine, as the peer our fa3 backend and bench are run
# against (docs/design.md §6). Not part of the library: FA3 stays an optional peer.
#
#   bash ci/build_fa3_peer.sh FA_SRC_DIR
#
# FA_SRC_DIR: a plain source tree of Dao-AILab/flash-attention holding hopper/ (ci/fa3_peer.sh says how to make and
# carry a trimmed one). Needs nvcc, torch with CUDA, ninja and the nvidia-cutlass wheel (its CUTLASS 4.2 headers stand
# in for FA3's csrc/cutlass submodule: FA3's MLA kernel files compile against them with nvcc 13.0).
#
# FA3's setup.py builds every head dim, dtype and feature (~450 instantiation files of 8 kernels each: causal x varlen
# x qv). Here FA3's own flags leave out backward, fp16, fp8, softcap, local, append-KV, cluster, SM8x and every head
# dim but 64, and of hopper/instantiations/ only the five files of hdim 64 / hdim_v 512 bf16 are compiled: the five
# (Split, PagedKVNonTMA, PackGQA) specialisations of run_mha_fwd_ that flash_api's dispatch can pick for MLA decode
# (PackGQA is forced on with Split or PagedKVNonTMA). The same dispatch names the hdim 64 specialisations with V head
# dim 64 and 256 too; a file of our own defines them to raise. flash_attn_config.py records the flags (the fa3 adapter
# reads them: fp16 is declined with that reason). Afterwards PYTHONPATH=FA_SRC_DIR/hopper makes
# `import flash_attn_interface` work (its extension lands in hopper/flash_attn_3/_C.abi3.so). Compile times measured
# on a CPU: benchmarks/RESULTS.md, "FlashAttention-3".
set -e
FA=$(cd "${1:?usage: build_fa3_peer.sh FA_SRC_DIR}" && pwd)
H="$FA/hopper"
[ -f "$H/flash_fwd_launch_template.h" ] || { echo "build_fa3_peer: $H has no flash_fwd_launch_template.h"; exit 1; }
CUT=$(python3 -c "import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / 'source')")
OFF="BACKWARD FP16 FP8 SOFTCAP LOCAL APPENDKV CLUSTER HDIM96 HDIM128 HDIM192 HDIM256 SM8x"
rm -rf "$H/mla_dispatch_peer" && mkdir -p "$H/mla_dispatch_peer"

# The five kernel files, by their suffixes (hopper/setup.py's names: flash_fwd_hdim64_512_bf16{paged}{split}{packgqa}).
MLA="_sm90 _packgqa_sm90 _split_sm90 _paged_sm90 _paged_split_sm90"
for suffix in $MLA; do
  [ -f "$H/instantiations/flash_fwd_hdim64_512_bf16$suffix.cu" ] || { echo "build_fa3_peer: no instantiations/flash_fwd_hdim64_512_bf16$suffix.cu"; exit 1; }
done
{
  echo '// FA3 hdim 64 kernels that are not MLA decode, not built (mla_dispatch ci/build_fa3_peer.sh): each raises if reached.'
  echo '#include <stdexcept>'
  echo '#include "flash.h"'
  echo '#include <cutlass/numeric_types.h>'
  for dv in 64 256; do
    for combo in "false false false" "false false true" "true false true" "false true true" "true true true"; do
      set -- $combo
      echo "template <> void run_mha_fwd_<90, cutlass::bfloat16_t, 64, $dv, $1, $2, false, $3>(Flash_fwd_params &, cudaStream_t) {"
      echo "    throw std::runtime_error(\"this FA3 build (mla_dispatch ci/build_fa3_peer.sh) has no hdim 64 / hdim_v $dv kernels\");"
      echo "}"
    done
  done
} > "$H/mla_dispatch_peer/not_built.cu"

# What flash_attn_interface and the fa3 adapter read back (hopper/setup.py writes the same file).
python3 - "$H/flash_attn_config.py" "$OFF" <<'PY'
import sys
off = set(sys.argv[2].split())
names = ["BACKWARD", "SPLIT", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "PACKGQA", "FP16", "FP8", "VARLEN", "CLUSTER",
         "HDIM64", "HDIM96", "HDIM128", "HDIM192", "HDIM256", "SM8x"]
flags = {f"FLASHATTENTION_DISABLE_{n}": n in off for n in names}
flags |= {"FLASHATTENTION_ENABLE_VCOLMAJOR": False, "FLASH_ATTENTION_DISABLE_HDIMDIFF64": False,
          "FLASH_ATTENTION_DISABLE_HDIMDIFF192": True}
with open(sys.argv[1], "w") as f:
    f.write("# Written by mla_dispatch ci/build_fa3_peer.sh (as hopper/setup.py writes it)\n")
    f.write(f"CONFIG = {{'build_flags': {flags!r}}}\n\n\ndef show():\n    from pprint import pprint\n    pprint(CONFIG)\n")
PY

cat > "$H/setup_mla_dispatch_peer.py" <<PY
import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension, CUDA_HOME
feat = [f"-DFLASHATTENTION_DISABLE_{n}" for n in "$OFF".split()] + ["-DFLASHATTENTION_DISABLE_HDIMDIFF192"]
# hopper/setup.py: the stable-ABI binding from torch 2.9 on; absolute include paths (ninja builds elsewhere); CUDA 13
# keeps cuda/std under include/cccl
stable = torch.__version__ >= (2, 9)
api = "flash_api_stable.cpp" if stable else "flash_api.cpp"
cxx = ["-O3", "-std=c++17", "-DPy_LIMITED_API=0x03090000"] + (["-DTORCH_TARGET_VERSION=0x0209000000000000"] if stable else [])
nvcc = ["-O3", "-std=c++17", "--ftemplate-backtrace-limit=0", "--use_fast_math", "-lineinfo",
        "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DCUTLASS_ENABLE_GDC_FOR_SM90", "-DCUTLASS_DEBUG_TRACE_LEVEL=0",
        "-DNDEBUG", "-gencode", "arch=compute_90a,code=sm_90a"]
setup(name="flash_attn_3", ext_modules=[CUDAExtension(
    "flash_attn_3._C",
    sources=[api, "flash_fwd_combine.cu", "flash_prepare_scheduler.cu", "mla_dispatch_peer/not_built.cu"]
            + [f"instantiations/flash_fwd_hdim64_512_bf16{suffix}.cu" for suffix in "$MLA".split()],
    include_dirs=["$H", "$CUT/include", f"{CUDA_HOME}/include/cccl"],
    extra_compile_args={"cxx": cxx + feat, "nvcc": nvcc + feat}, py_limited_api=True)],
    cmdclass={"build_ext": BuildExtension})
PY
cd "$H" && MAX_JOBS=${MAX_JOBS:-16} python3 setup_mla_dispatch_peer.py -q build_ext --inplace > /tmp/fa3_build.log 2>&1 \
  || { grep -m20 -B2 -A6 -i 'error' /tmp/fa3_build.log; exit 1; }
ls "$H"/flash_attn_3/_C*.so
