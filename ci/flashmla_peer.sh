#!/usr/bin/env bash
# Make DeepSeek FlashMLA importable as `flash_mla`, to be timed and tested beside our backends (docs/design.md §6).
# Source after ci/gpu_setup.sh. Needs a FlashMLA source tree in .peer/flashmla (never committed: .git/info/exclude);
# carry ".peer" with the device command. A prebuilt .peer/flashmla/flash_mla/cuda*.so (same image, same torch) that
# binds both SM90 decode entry points is used as it is; otherwise ci/build_flashmla_peer.sh builds one (~5 min).
if [ ! -d .peer/flashmla ]; then echo "flashmla_peer: no .peer/flashmla, FlashMLA not available"; return 0 2>/dev/null || exit 0; fi
if ! ls .peer/flashmla/flash_mla/cuda*.so >/dev/null 2>&1 || ! grep -q sparse_decode_fwd .peer/flashmla/flash_mla/cuda*.so; then
  rm -f .peer/flashmla/flash_mla/cuda*.so
  bash ci/build_flashmla_peer.sh .peer/flashmla || echo "flashmla_peer: build failed (see /tmp/flashmla_build.log)"
fi
export PYTHONPATH=$PWD/.peer/flashmla${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import flash_mla; print('flashmla_peer: flash_mla', flash_mla.__version__, 'from', flash_mla.__file__)" || true
