"""Layer 5, plan: memory and step-time prediction for FSDP configurations, and the planner.

The estimator predicts a configuration's per-rank bytes without allocating (model state exactly,
activations by a meta-device trace), the live-tensor tracker measures them, the step-time model
predicts a step from calibrated block and collective times, and the planner picks the fastest
wrapping that fits a memory budget. ``memory`` and ``memory_report`` measure a running job.
Imports the engine and front ends; the jobs (``fullshard estimate``, ``fullshard plan``,
``--plan auto``) import it. See ARCHITECTURE.md.
"""
