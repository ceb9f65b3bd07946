import sys

from mla_dispatch.tools.cli import main

sys.exit(main())
