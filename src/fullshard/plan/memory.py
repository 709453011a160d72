"""Memory measurements: exact tensor bytes of model state per rank, and peak RSS."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn


def _storage_bytes(tensors: Iterable[torch.Tensor], counted_as: dict[int, int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once); a
    storage whose address is in ``counted_as`` counts the bytes given there."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor (torch FSDP2's, fully_shard's): this rank's local shard
            t = t.to_local()
        s = t.untyped_storage()
        seen[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
    if counted_as:
        seen = {ptr: counted_as.get(ptr, n) for ptr, n in seen.items()}
    return sum(seen.values())


def _gradient_shards_in_packed(model: nn.Module) -> dict[int, int]:
    """fullshard units whose gradient shards live in this rank's chunk of their packed gradient
    (a buffer of N x S_t elements that the pool would otherwise keep for the unit's next full
    parameters): the shards' bytes (S_t elements), by the buffer's address."""
    from fullshard.engine.hooks import fsdp_state

    out: dict[int, int] = {}
    for m in model.modules():
        state = fsdp_state(m)
        if state is None:
            continue
        packed = state.unit.grads.holding_packed
        if packed is not None:
            out[packed.untyped_storage().data_ptr()] = packed.nbytes // state.unit.shard_size
    return out


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's model-state bytes: parameters, gradients and optimizer state.

    Counts the storages behind the tensors (a shard that is a view of a unit's padded flat
    buffer counts the whole buffer once, padding included), in bytes; gradient shards kept in
    their unit's packed gradient count that buffer's own chunk (S_t elements), not the rest of
    it (the memory the unit's full parameters take next).

    Returns:
        dict with ``params``, ``grads``, ``optim`` and ``total`` (bytes, ints).
    """
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    optim: list[torch.Tensor] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            optim.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    out = {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(grads, _gradient_shards_in_packed(model)),
        "optim": _storage_bytes(optim),
    }
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes.

    On Linux this is VmHWM from /proc/self/status: the high-water mark of this process's own
    memory. (``getrusage``'s ru_maxrss is not: it carries a larger parent's peak over into a
    spawned child.) Elsewhere it falls back to ru_maxrss.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Restart the peak-RSS count from the current RSS (Linux: /proc/self/clear_refs); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
