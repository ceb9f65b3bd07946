#!/usr/bin/env bash
# Make FlashAttention-3 importable (`flash_attn_interface`, its MLA decode kernels only), to be run through the fa3
# backend and timed beside our backends (docs/design.md §6). Source after ci/gpu_setup.sh. Needs FA3's hopper/ source
# in .peer/flash-attention (never committed: .git/info/exclude); carry ".peer" with the device command.
#
# Making .peer/flash-attention (about 1.2 MB), from the search tools' snapshot of Dao-AILab/flash-attention
# (`fetch github:Dao-AILab/flash-attention`; 0251105 was used first):
#   mkdir -p .peer/flash-attention && git -C <its git dir> archive <commit> hopper LICENSE | tar -x -C .peer/flash-attention
#   cd .peer/flash-attention/hopper && rm -f test_*.py benchmark_*.py generate_kernels.py padding.py setup.py \
#     && find instantiations -type f ! -name 'flash_fwd_hdim64_512_bf16_*sm90.cu' -delete && rm instantiations/*softcap*
# (the five MLA decode kernel files of instantiations/ stay). FA3's csrc/cutlass submodule is not needed: the
# nvidia-cutlass wheel's CUTLASS 4.2 headers (.whl) stand in (FA3's MLA kernel files compile against them with nvcc 13.0).
#
# A prebuilt .peer/flash-attention/hopper/flash_attn_3/_C*.so (same image, same torch) with the flash_attn_config.py
# its build wrote in hopper/ is used as it is; otherwise ci/build_fa3_peer.sh builds both (log in
# /tmp/fa3_build.log). Copy the two to $OUT once and put them back in place to skip the build in later calls.
if [ ! -d .peer/flash-attention/hopper ]; then echo "fa3_peer: no .peer/flash-attention/hopper, FA3 not available"; return 0 2>/dev/null || exit 0; fi
if ! ls .peer/flash-attention/hopper/flash_attn_3/_C*.so >/dev/null 2>&1 || [ ! -f .peer/flash-attention/hopper/flash_attn_config.py ]; then
  bash ci/build_fa3_peer.sh .peer/flash-attention || echo "fa3_peer: build failed (see /tmp/fa3_build.log)"
fi
export PYTHONPATH=$PWD/.peer/flash-attention/hopper${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import flash_attn_interface as f; print('fa3_peer: flash_attn_interface from', f.__file__)" || true
