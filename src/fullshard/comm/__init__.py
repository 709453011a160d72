"""Layer 1, communication: the collectives (the only code that calls torch.distributed) and the
buffers kept for reuse. Imports only :mod:`fullshard.probes`. See ARCHITECTURE.md."""
