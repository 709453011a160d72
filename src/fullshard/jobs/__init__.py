"""Layer 6, jobs: the launcher, models, data, the ``fullshard train`` jobs, ``fullshard estimate``/``plan`` and
``fullshard bench``. Imports any lower layer, never the facade. See ARCHITECTURE.md."""
