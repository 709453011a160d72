"""``torch.distributed.fsdp.fully_sharded_data_parallel``'s names, at the path torch FSDP users
import them from (the FSDP tutorial imports ``CPUOffload`` and ``BackwardPrefetch`` here).

The wrapper lives in :mod:`fullshard.frontend.fsdp1`; this module only re-exports it.
"""

from fullshard.api import *  # noqa: F403
from fullshard.api import __all__ as _api_all
from fullshard.frontend.fsdp1 import FSDP, FullyShardedDataParallel

__all__ = ["FSDP", "FullyShardedDataParallel", *_api_all]
