import sys

from mla_dispatch.cli import main

sys.exit(main())
