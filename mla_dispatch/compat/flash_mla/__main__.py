"""``python -m mla_dispatch.compat.flash_mla {run,install-pth,uninstall-pth}``."""

import sys

from mla_dispatch.compat.flash_mla.alias import main

sys.exit(main())
