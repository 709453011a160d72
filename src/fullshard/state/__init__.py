"""Layer 3, state: state dicts, optimizer state and checkpoints, from units, for both front
ends. Imports only engine, comm and probes. See ARCHITECTURE.md."""
