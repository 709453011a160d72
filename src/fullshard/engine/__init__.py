"""Layer 2, the engine: configs, sharded parameters, units (layout, gather, reduction), hooks,
and building units from modules. Imports only comm and probes. See ARCHITECTURE.md."""
