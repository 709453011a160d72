"""The ``fullshard estimate`` and ``fullshard plan`` commands and the estimate/plan benchmarks,
built on :mod:`fullshard.plan`."""
