"""Block-wise int8 quantization of flat buffers, and the packed rows quantized collectives send.

Vocabulary (used by :mod:`fullshard.comm.quantized` and the engine's quantized paths):

- **row**: one rank's part of a collective's buffer, a 1-D float tensor of L elements (a local
  shard in an all-gather, the chunk for one destination rank in a reduce-scatter).
- **segment**: a part of a row that blocks do not cross (one parameter's padded shard); a row is
  one segment unless the caller gives their lengths.
- **block**: ``block_size`` consecutive elements of a segment; a segment of n elements has
  ``ceil(n / block_size)`` blocks, the last one shorter when ``block_size`` does not divide n.
- **scale**: one float32 per block, the block's largest magnitude divided by 127 (0 for a block
  of zeros, and for one whose largest magnitude is under about 1e-43, too small for a nonzero
  float32 scale; one ulp less where 127 * scale would overflow, within an ulp of float32's
  largest value). The block's int8 values are its elements divided by the scale and rounded, in
  [-127, 127]; they dequantize as ``q * scale``. Rounding to nearest errs by at most
  ``scale / 2`` per element; stochastic rounding by less than ``scale``, and is unbiased.
- **packed row**: a row's quantized form as bytes (uint8): its nb scales (float32, 4 nb bytes),
  then its L int8 values, then zero bytes up to a multiple of 4, so that rows packed back to back
  keep every row's scales 4-byte aligned. Its length is :func:`packed_bytes`. A collective moves
  packed rows as plain uint8 buffers, so the bytes it counts are the real int8 and scale bytes.

The work goes chunk by chunk (:data:`CHUNK` elements), so each step's temporaries stay in the
CPU's cache: one pass over a 16M-element row took 2.7 ns per element this way against 11 ns for
the same operations over the whole row at once (one thread, this project's machine).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INT8_MAX = 127
CHUNK = 1 << 16  # elements quantized or dequantized per step (rounded to whole blocks)
# The largest float32 scale s with 127 * s finite in float32.
_TOP_SCALE = torch.nextafter(torch.tensor(torch.finfo(torch.float32).max / INT8_MAX), torch.tensor(0.0)).item()


def blocks(numel: int, block_size: int, segments: Sequence[int] | None = None) -> int:
    """The number of blocks (and scales) of a row of ``numel`` elements, or of ``segments``."""
    if segments is None:
        return -(-numel // block_size)
    return sum(-(-n // block_size) for n in segments)


def packed_bytes(numel: int, block_size: int, segments: Sequence[int] | None = None) -> int:
    """Bytes of the packed row of ``numel`` elements (in ``segments``, see :func:`quantize_into`):
    4 per block (its scale), 1 per element, rounded up to a multiple of 4."""
    return 4 * blocks(numel, block_size, segments) + -(-numel // 4) * 4


def _parts(row: torch.Tensor, numel: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales (float32, (..., nb)) and int8 values (..., L) of packed rows (..., packed_bytes)."""
    return row[..., : 4 * nb].view(torch.float32), row[..., 4 * nb : 4 * nb + numel].view(torch.int8)


def _chunk(device: torch.device) -> int:
    """Elements per step on ``device``: :data:`CHUNK` on the CPU (temporaries stay in cache); on
    an accelerator every kernel launch costs microseconds, so a whole segment is one step (an
    H200 quantized 2-3 GB/s chunk by chunk, launch-bound)."""
    return CHUNK if device.type == "cpu" else 1 << 62


def _spans(
    numel: int, block_size: int, segments: Sequence[int] | None, device: torch.device
) -> list[tuple[int, int, int, int]]:
    """(start, stop, first block, block length) of runs of equal blocks, about :func:`_chunk`
    elements each: whole blocks of each segment, then its shorter last block on its own."""
    spans = []
    step = max(1, min(_chunk(device), numel) // block_size) * block_size
    offset = first = 0
    for length in segments if segments is not None else (numel,):
        whole = length // block_size * block_size
        for s in range(0, whole, step):
            stop = min(s + step, whole)
            spans.append((offset + s, offset + stop, first + s // block_size, block_size))
        if whole < length:
            spans.append((offset + whole, offset + length, first + whole // block_size, length - whole))
        offset += length
        first += -(-length // block_size)
    assert offset == numel, f"segments {segments} do not add up to {numel}"
    return spans


def quantize_into(
    x: torch.Tensor,
    row: torch.Tensor,
    block_size: int,
    generator: torch.Generator | None = None,
    segments: Sequence[int] | None = None,
) -> None:
    """Quantize the row ``x`` into the packed row ``row``.

    Args:
        x: shape (L,), a floating-point dtype, contiguous.
        row: shape (packed_bytes(L, block_size, segments),), uint8, on x's device; overwritten.
        block_size: elements per block.
        generator: None rounds to nearest (error at most scale / 2); a generator rounds
            stochastically (up or down with the probabilities that make the expected value
            exact to 1/512 of a scale; error below one scale), drawing from it and nothing else.
        segments: lengths of consecutive parts of the row (summing to L) that no block may span:
            one per parameter, so a layer norm's weights near 1 never share a scale with a
            weight matrix's values near 0.02 (which would then round to a few levels). None:
            the row is one segment.

    A block holding NaN or infinity gets a NaN or infinite scale, so the whole block
    dequantizes as non-finite: an overflow stays visible (to a gradient scaler, a norm check).
    """
    numel = x.numel()
    nb = blocks(numel, block_size, segments)
    scales, values = _parts(row, numel, nb)
    row[4 * nb + numel :].zero_()
    spans = _spans(numel, block_size, segments, x.device)
    scratch = torch.empty(max((stop - start for start, stop, _, _ in spans), default=0), device=x.device)
    for start, stop, first, b in spans:
        count = (stop - start) // b
        _quantize_blocks(
            x[start:stop].view(-1, b),
            scales[first : first + count],
            values[start:stop].view(-1, b),
            scratch[: stop - start].view(-1, b),
            generator,
        )
    # A block within a few ulps of float32's largest value: its scale, rounded up, would make
    # 127 * scale overflow to infinity; one ulp less dequantizes it finite (a block holding an
    # infinity keeps its infinite scale).
    scales.masked_fill_((scales > _TOP_SCALE) & (scales < torch.inf), _TOP_SCALE)


def _quantize_blocks(
    x: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    scratch: torch.Tensor,
    generator: torch.Generator | None,
) -> None:
    """Quantize whole blocks ``x`` (k, b) into ``scales`` (k,) and ``values`` (k, b) int8, working
    in ``scratch`` (k, b) float32."""
    x = x.detach()
    if x.dtype != torch.float32:  # bf16 gradients under mixed precision: work in float32
        x = x.float()
    amax = torch.abs(x, out=scratch).amax(dim=1)
    torch.div(amax, INT8_MAX, out=scales)
    # A block of zeros has scale 0, and so does one whose largest magnitude is too small for a
    # nonzero float32 scale (under about 1e-43): their values are 0. Dividing by the scale (not
    # multiplying by 127 / amax, which overflows to infinity under amax = 3.7e-37) costs the same.
    divisor = torch.where(scales > 0, scales, 1.0)
    t = torch.div(x, divisor[:, None], out=scratch)  # |t| <= 127.0000x, more for a subnormal scale
    if generator is None:
        t.round_()
    else:
        t.add_(_dither(t.numel(), generator, t.device).view(t.shape), alpha=1 / 256).add_(1 / 512).floor_()
    t.clamp_(-INT8_MAX, INT8_MAX)  # a subnormal scale's rounding, or a dither, could reach 128
    values.copy_(t)


def _dither(numel: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``numel`` random bytes (uint8) from ``generator``: the stochastic rounding's dither, 8 random
    bits per element, (byte + 0.5) / 256 in (0, 1). Drawn as 32-bit integers, four bytes each (half
    the time of drawing floats: 5.3 against 10.6 ns per rounded element on this project's machine).
    Its 256 levels bias a rounding by at most 1/512 of a scale, far below the rounding's own noise.
    """
    words = torch.empty(-(-numel // 4), dtype=torch.int32, device=device)
    words.random_(-(2**31), 2**31, generator=generator)
    return words.view(torch.uint8)[:numel]


def dequantize_into(
    rows: torch.Tensor, out: torch.Tensor, block_size: int, segments: Sequence[int] | None = None
) -> None:
    """Dequantize packed rows into ``out``.

    Args:
        rows: shape (R, packed_bytes(L, block_size, segments)), uint8 (rows back to back).
        out: shape (R, L), a floating-point dtype, each row contiguous; overwritten with
            ``q * scale`` (computed in float32, then cast to ``out``'s dtype).
        block_size, segments: as the rows were quantized with.
    """
    numel = out.shape[1]
    scales, values = _parts(rows, numel, blocks(numel, block_size, segments))
    spans = _spans(numel, block_size, segments, out.device)
    for r in range(rows.shape[0]):
        for start, stop, first, b in spans:
            s = scales[r, first : first + (stop - start) // b]
            torch.mul(values[r, start:stop].view(-1, b), s[:, None], out=out[r, start:stop].view(-1, b))


def dequantize_sum_into(
    rows: torch.Tensor,
    own: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    divide_by: float = 1.0,
    segments: Sequence[int] | None = None,
) -> None:
    """``out = (own + sum of the dequantized rows) / divide_by``: a quantized reduce-scatter's
    local sum.

    Args:
        rows: shape (R, packed_bytes(L, block_size, segments)), uint8: the other ranks'
            contributions.
        own: shape (L,), floating point: this rank's contribution, not quantized.
        out: shape (L,), floating point (may be ``own`` itself); summed in float32, then cast.
        block_size, segments: as the rows were quantized with.
        divide_by: the divisor (the number of ranks for a mean).
    """
    numel = out.numel()
    scales, values = _parts(rows, numel, blocks(numel, block_size, segments))
    spans = _spans(numel, block_size, segments, out.device)
    longest = max((b - a for a, b, _, _ in spans), default=0)
    scratch = None if out.dtype == torch.float32 else torch.empty(longest, device=out.device)
    for start, stop, first, b in spans:
        # float32 output: summed in place, two passes over the chunk; else in a float32 scratch
        acc = out[start:stop].view(-1, b) if scratch is None else scratch[: stop - start].view(-1, b)
        mine = own[start:stop].view(-1, b)
        if rows.shape[0] == 0:
            acc.copy_(mine)
        for r in range(rows.shape[0]):
            s = scales[r, first : first + (stop - start) // b][:, None]
            q = values[r, start:stop].view(-1, b)
            if r == 0:
                torch.addcmul(mine, q, s, out=acc)
            else:
                acc.addcmul_(q, s)
        if divide_by != 1.0:
            acc.div_(divide_by)
        if scratch is not None:
            out[start:stop].view(-1, b).copy_(acc)


def sum_into(rows: torch.Tensor, own: torch.Tensor, out: torch.Tensor, divide_by: float = 1.0) -> None:
    """``out = (own + sum of rows) / divide_by``, summed in float32 chunk by chunk (a bf16
    reduce-scatter's local sum).

    Args:
        rows: shape (R, L), any floating-point dtype: the other ranks' contributions.
        own: shape (L,): this rank's contribution.
        out: shape (L,) (may be ``own`` itself).
        divide_by: the divisor.
    """
    numel = out.numel()
    chunk = min(_chunk(out.device), numel)
    scratch = None if out.dtype == torch.float32 else torch.empty(chunk, device=out.device)
    for start in range(0, numel, max(chunk, 1)):
        stop = min(start + chunk, numel)
        acc = out[start:stop] if scratch is None else scratch[: stop - start]
        mine = own[start:stop]
        fused = mine.dtype == torch.float32 and rows.shape[0] > 0  # a bf16 + bf16 sum would round in bf16
        if fused:
            torch.add(mine, rows[0, start:stop], out=acc)
        else:
            acc.copy_(mine)
        for r in range(1 if fused else 0, rows.shape[0]):
            acc.add_(rows[r, start:stop])
        if divide_by != 1.0:
            acc.div_(divide_by)
        if scratch is not None:
            out[start:stop].copy_(acc)
