"""``torch.distributed.fsdp.wrap``'s names, at the path torch FSDP users import them from.

The policies live in :mod:`fullshard.frontend.wrap`, ``is_unit`` (the "already wrapped" test
``apply_policy`` takes) and ``unit_count`` in :mod:`fullshard.engine.hooks`; this module only
re-exports them.
"""

from fullshard.engine.hooks import is_unit, unit_count
from fullshard.frontend.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    Policy,
    always_wrap_policy,
    apply_policy,
    as_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "Policy",
    "always_wrap_policy",
    "apply_policy",
    "as_policy",
    "enable_wrap",
    "is_unit",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "unit_count",
    "wrap",
]
