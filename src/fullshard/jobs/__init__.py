"""Layer 5, jobs: the launcher, memory measurement, models, data, the ``fullshard train`` jobs and
``fullshard bench``. Imports any lower layer, never the facade. See ARCHITECTURE.md."""
