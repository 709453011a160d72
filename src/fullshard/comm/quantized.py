"""Quantized collectives: the all-gather of int8 blocks and the reduce-scatter in int8 or bf16.

Both are built on :mod:`fullshard.comm.collectives` (:func:`~.collectives.all_gather` and
:func:`~.collectives.all_to_all` of uint8 or bf16 buffers), so they are recorded, watched and
counted like every other collective; the bytes counted are the bytes sent, scales included. The
vocabulary (row, block, scale, packed row) is :mod:`fullshard.comm.quantize`'s.

- :func:`all_gather_int8`: each rank quantizes its row (nearest rounding) into a packed row, the
  packed rows are all-gathered, and every rank dequantizes all N of them, its own too, so every
  rank computes with the same full values. The caller's float row is not changed: it stays the
  master copy, so the error does not accumulate from step to step.
- :func:`reduce_scatter_quantized`: a sum of int8 values on the wire would overflow, so each rank
  quantizes the N-1 chunks meant for the other ranks, exchanges them in one all-to-all (its own
  chunk stays home, not quantized), and sums what it received in float32 (ZeRO++'s qgZ does the
  same). ``wire="bf16"`` sends bfloat16 chunks (rounded to nearest) the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fullshard.comm import collectives
from fullshard.comm.buffers import POOL
from fullshard.comm.collectives import Handle, ProcessGroup
from fullshard.comm.quantize import dequantize_into, dequantize_sum_into, packed_bytes, quantize_into, sum_into

WIRES = ("bf16", "int8")
_SEED = 0x51A7E  # the stochastic rounding's base seed; each rank adds its global rank
_GENERATORS: dict[str, torch.Generator] = {}


def all_gather_int8(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup,
    block_size: int,
    async_op: bool = False,
    segments: Sequence[int] | None = None,
) -> Handle | None:
    """All-gather ``input`` as int8 blocks and dequantize every rank's row into ``output``.

    Args:
        output: shape (N*L,), floating point (the compute dtype): rank r's dequantized row lands
            in ``output[r*L:(r+1)*L]``.
        input: shape (L,), floating point, contiguous, on output's device; read, not changed.
        group: the process group (N ranks).
        block_size: elements per block (one float32 scale each).
        async_op: return a Handle whose ``wait()`` also dequantizes, instead of waiting.
        segments: lengths of the parts of the row that blocks do not cross (one per parameter;
            see :func:`~fullshard.comm.quantize.quantize_into`), None for one.

    Returns:
        A Handle when ``async_op``, else None after completion.

    Raises:
        ValueError: ``output`` is not N times ``input``.
    """
    n = collectives.group_size(group)
    numel = input.numel()
    if output.numel() != n * numel:
        raise ValueError(f"all_gather_int8: output has {output.numel()} elements, expected {n} x {numel}")
    row = packed_bytes(numel, block_size, segments)
    send = POOL.acquire(row, torch.uint8, input.device)
    quantize_into(input, send, block_size, segments=segments)
    received = POOL.acquire(n * row, torch.uint8, input.device)
    work = collectives.all_gather(received, send, group, async_op=True)

    def epilogue() -> None:
        dequantize_into(received.view(n, row), output.view(n, numel), block_size, segments)
        POOL.release(send)
        POOL.release(received)

    return _finish(Handle([work], epilogue), async_op)


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup,
    wire: str,
    block_size: int,
    divide_by: float = 1.0,
    generator: torch.Generator | None = None,
    async_op: bool = False,
    segments: Sequence[int] | None = None,
) -> Handle | None:
    """Reduce ``input`` over ranks, sending int8 blocks or bf16, and keep chunk r on rank r.

    Args:
        output: shape (C,), floating point: ``(sum over ranks of chunk r) / divide_by``, summed
            in float32 (may have another dtype than ``input``).
        input: shape (N*C,), floating point, contiguous: chunk j goes to rank j. Read, not
            changed; it must stay alive until the Handle is waited.
        group: the process group (N ranks).
        wire: "int8" (block-quantized, ``block_size`` elements per float32 scale) or "bf16".
        block_size: elements per block for "int8".
        divide_by: the divisor (N for a mean).
        generator: for "int8", round stochastically with it (None: to nearest).
        async_op: return a Handle whose ``wait()`` also sums, instead of waiting.
        segments: for "int8", the lengths of the parts of a chunk that blocks do not cross (one
            per parameter), None for one.

    Returns:
        A Handle when ``async_op``, else None after completion.

    Raises:
        ValueError: an unknown ``wire``; ``input`` not N times ``output``.
    """
    if wire not in WIRES:
        raise ValueError(f"reduce_scatter_quantized: wire={wire!r}; use one of {WIRES}")
    n = collectives.group_size(group)
    chunk = output.numel()
    if input.numel() != n * chunk:
        raise ValueError(f"reduce_scatter_quantized: input has {input.numel()} elements, expected {n} x {chunk}")
    me = collectives.group_rank(group)
    chunks = input.view(n, chunk)
    others = [r for r in range(n) if r != me]
    if wire == "int8":
        row = packed_bytes(chunk, block_size, segments)
        send = POOL.acquire((n - 1) * row, torch.uint8, input.device)
        for j, r in enumerate(others):
            quantize_into(chunks[r], send[j * row : (j + 1) * row], block_size, generator, segments)
    else:
        row = chunk
        send = POOL.acquire((n - 1) * row, torch.bfloat16, input.device)
        send.view(n - 1, chunk)[:me].copy_(chunks[:me])
        send.view(n - 1, chunk)[me:].copy_(chunks[me + 1 :])
    received = POOL.acquire(send.numel(), send.dtype, send.device)
    work = collectives.all_to_all(received, send, group, async_op=True)

    def epilogue() -> None:
        rows = received.view(n - 1, row)
        if wire == "int8":
            dequantize_sum_into(rows, chunks[me], output, block_size, divide_by, segments)
        else:
            sum_into(rows, chunks[me], output, divide_by)
        POOL.release(send)
        POOL.release(received)

    return _finish(Handle([work], epilogue), async_op)


def rounding_generator(device: torch.device) -> torch.Generator:
    """This process's random generator for stochastic rounding on ``device``, made at first use
    and seeded from the global rank: reproducible from run to run, different on each rank, one
    stream for all units, and never drawing from torch's default generator (dropout and data
    order stay as they are without quantization)."""
    key = str(device)
    generator = _GENERATORS.get(key)
    if generator is None:
        rank = collectives.group_rank(collectives.default_group())
        generator = _GENERATORS[key] = torch.Generator(device=device)
        generator.manual_seed(_SEED + rank)
    return generator


def rounding_state() -> dict[str, torch.Tensor]:
    """The state of this process's rounding generators, by device (``{}`` before any int8
    reduce-scatter): what a checkpoint keeps so that a resumed run rounds as an uninterrupted
    one would."""
    return {key: generator.get_state() for key, generator in _GENERATORS.items()}


def set_rounding_state(states: Mapping[str, torch.Tensor]) -> None:
    """Restore generators saved by :func:`rounding_state`, as a resumed run does (after the
    process group is up). A device without a saved state keeps its generator seeded from the
    global rank (a rank that did not exist at the save starts as in a new run); a state for a
    device this process cannot use (CUDA without a GPU) is ignored."""
    for key, state in states.items():
        device = torch.device(key)
        if device.type == "cuda" and not torch.cuda.is_available():
            continue
        rounding_generator(device).set_state(state)


def reset_generators() -> None:
    """Forget the rounding generators: the next use seeds them afresh (a new run in this process)."""
    _GENERATORS.clear()


def _finish(handle: Handle, async_op: bool) -> Handle | None:
    if async_op:
        return handle
    handle.wait()
    return None
