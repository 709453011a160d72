"""``torch.distributed.fsdp.wrap``'s names, at the path torch FSDP users import them from.

The policies live in :mod:`fullshard.frontend.wrap`; this module only re-exports them.
"""

from fullshard.frontend.wrap import (
    ModuleWrapPolicy,
    Policy,
    apply_policy,
    as_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "ModuleWrapPolicy",
    "Policy",
    "apply_policy",
    "as_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
