"""fullshard: Fully Sharded Data Parallel training for PyTorch, on CPU (gloo) and CUDA (NCCL).

Speaks ``torch.distributed.fsdp``'s API: replace
``from torch.distributed.fsdp import FullyShardedDataParallel as FSDP`` with
``from fullshard import FullyShardedDataParallel as FSDP``.
"""

from fullshard.comm.flight_recorder import set_step
from fullshard.comm.watchdog import disable_watchdog, enable_watchdog, set_collective_timeout
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
from fullshard.frontend.activation_checkpointing import (
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from fullshard.frontend.clip_grad import clip_grad_norm_
from fullshard.frontend.forward_method import register_fsdp_forward_method
from fullshard.frontend.fsdp1 import FSDP, FullyShardedDataParallel
from fullshard.frontend.fsdp_module import FSDPModule, UnshardHandle
from fullshard.frontend.fully_shard import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    share_comm_ctx,
)
from fullshard.frontend.meshes import DataParallelMeshDims
from fullshard.frontend.optim_local import register_elementwise_optimizer
from fullshard.frontend.torch_names import use_in_torch
from fullshard.plan.memory import model_state_bytes, peak_rss_bytes
from fullshard.plan.memory_report import MemoryReport, UnitMemory, memory_report

__version__ = "0.1.0"

__all__ = [
    "MemoryReport",
    "UnitMemory",
    "memory_report",
    "set_collective_timeout",
    "enable_watchdog",
    "disable_watchdog",
    "set_step",
    "FSDP",
    "BackwardPrefetch",
    "CommQuantization",
    "CPUOffload",
    "CheckpointWrapper",
    "CPUOffloadPolicy",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "StateDictType",
    "StateDictConfig",
    "StateDictSettings",
    "OptimStateDictConfig",
    "DataParallelMeshDims",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateKeyType",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardingStrategy",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "clip_grad_norm_",
    "fully_shard",
    "register_fsdp_forward_method",
    "register_elementwise_optimizer",
    "use_in_torch",
    "UnshardHandle",
    "model_state_bytes",
    "peak_rss_bytes",
]
