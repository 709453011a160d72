"""``python -m fullshard.train JOB ...``: the entry point for torchrun."""

import sys

from fullshard.train import main

sys.exit(main())
