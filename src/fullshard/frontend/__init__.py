"""Layer 4, the front ends: the FSDP1 wrapper and ``fully_shard``, their options, wrap policies,
activation checkpointing and gradient clipping. Imports only lower layers. See ARCHITECTURE.md."""
