"""``torch.distributed.fsdp.api``'s names, at the path a torch FSDP user imports them from.

The types live in :mod:`fullshard.engine.config`, ``parse_sharding_strategy`` (a strategy from a
name, as the jobs' ``--sharding-strategy`` takes it) in :mod:`fullshard.frontend.options`; this
module only re-exports them.
"""

from fullshard.engine.config import (
    BackwardPrefetch,
    CommQuantization,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fullshard.frontend.options import parse_sharding_strategy

__all__ = [
    "BackwardPrefetch",
    "CommQuantization",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "parse_sharding_strategy",
]
