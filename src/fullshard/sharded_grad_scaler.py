"""``torch.distributed.fsdp.sharded_grad_scaler``'s name, at the path torch FSDP users import it
from: ``from fullshard.sharded_grad_scaler import ShardedGradScaler``.

The class lives in :mod:`fullshard.frontend.grad_scaler` (torch's, with the found-inf flag shared
for fused optimizers too); this module only re-exports it.
"""

from fullshard.frontend.grad_scaler import ShardedGradScaler

__all__ = ["ShardedGradScaler"]
