#!/usr/bin/env bash
# Source this at the start of every device-tool command:
#   source ci/gpu_setup.sh
# Installs carried wheels (.whl/: built where there is network, shipped with the checkout) into /tmp/site and this
# checkout in editable mode, without network access. Safe to source twice.
if [ "${MLA_GPU_SETUP_DONE:-}" = 1 ]; then return 0 2>/dev/null || exit 0; fi  # done in this shell or a parent
set -e
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "gpu_setup: wheel install failed"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
  # (e.g. an image whose setuptools predates 77, which reads no SPDX license string): the package from the tree
  echo "gpu_setup: editable install failed, importing mla_dispatch from $PWD instead:"
  python3 -m pip install --no-deps --no-build-isolation -e . 2>&1 | tail -n 3 || true
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch, mla_dispatch; print('gpu_setup:', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
export MLA_GPU_SETUP_DONE=1
set +e
