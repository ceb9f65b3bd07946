#!/usr/bin/env bash
# Source this at the start of every device-tool command:
#   source ci/gpu_setup.sh
# Installs carried wheels (.whl/: built where there is network, shipped with the checkout) into /tmp/site and this
# checkout in editable mode, without network access. Safe to source twice.
set -e
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "gpu_setup: wheel install failed"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "gpu_setup: editable install failed"; python3 -m pip install --no-deps --no-build-isolation -e . ; }
python3 -c "import torch, mla_dispatch; print('gpu_setup:', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
set +e
