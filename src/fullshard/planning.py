"""The planner as a library: calibrate a model's step on this machine, then choose the fastest
wrapping that fits a memory budget (what ``fullshard plan`` and ``--plan auto`` run).

The functions live in :mod:`fullshard.plan.steptime` and :mod:`fullshard.plan.planner`; this
module only re-exports them.
"""

from fullshard.plan.planner import parse_size, plan
from fullshard.plan.steptime import calibrate

__all__ = ["calibrate", "parse_size", "plan"]
