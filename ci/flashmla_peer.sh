#!/usr/bin/env bash
# Make DeepSeek FlashMLA importable as `flash_mla`, to be timed and tested beside our backends (docs/design.md §6).
# Source after ci/gpu_setup.sh. Needs a FlashMLA source tree in .peer/flashmla (never committed: .git/info/exclude)
# and the build script in .peer/build_flashmla.sh; carry ".peer" with the device command. A prebuilt
# .peer/flashmla/flash_mla/cuda*.so (same image, same torch) is used as it is; otherwise it is built (~2.5 min).
if [ ! -d .peer/flashmla ]; then echo "flashmla_peer: no .peer/flashmla, FlashMLA not available"; return 0 2>/dev/null || exit 0; fi
if ! ls .peer/flashmla/flash_mla/cuda*.so >/dev/null 2>&1; then
  bash .peer/build_flashmla.sh .peer/flashmla || echo "flashmla_peer: build failed (see /tmp/flashmla_build.log)"
fi
export PYTHONPATH=$PWD/.peer/flashmla${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import flash_mla; print('flashmla_peer: flash_mla', flash_mla.__version__, 'from', flash_mla.__file__)" || true
