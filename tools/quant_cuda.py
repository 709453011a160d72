"""The block-int8 quantizer of quantized collectives on one CUDA device: cost and error.

Usage (on a machine with a GPU): ``python tools/quant_cuda.py [--sizes 1048576 16777216 134217728]``

For each size (elements of a float32 shard row, what one rank all-gathers or reduce-scatters) it
times :func:`fullshard.comm.quantize.quantize_into` (nearest and stochastic rounding) and
:func:`~fullshard.comm.quantize.dequantize_into` with CUDA events (median of 20 calls after 5
warm-up calls), reports the effective bandwidth over the float32 bytes read or written (GB/s), and
checks the round trip's worst error against half a block's scale (nearest rounding). One GPU means
world size 1, where fullshard sends nothing and so quantizes nothing: this measures the part of a
quantized collective that runs on the device, which is what multi-GPU runs would add to NCCL's time.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fullshard.comm.quantize import blocks, dequantize_into, packed_bytes, quantize_into


def _time_ms(fn, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(numel: int, block_size: int, device: torch.device) -> dict[str, float]:
    """Times (ms), bandwidths (GB/s of float32 data) and the round trip's worst error relative to
    half a scale, for one row of ``numel`` float32 elements."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(numel, generator=g, device=device) * 0.02
    row = torch.empty(packed_bytes(numel, block_size), dtype=torch.uint8, device=device)
    out = torch.empty_like(x)
    stochastic = torch.Generator(device=device).manual_seed(1)
    nearest_ms = _time_ms(lambda: quantize_into(x, row, block_size))
    stochastic_ms = _time_ms(lambda: quantize_into(x, row, block_size, generator=stochastic))
    quantize_into(x, row, block_size)
    dequant_ms = _time_ms(lambda: dequantize_into(row.view(1, -1), out.view(1, -1), block_size))
    nb = blocks(numel, block_size)
    scales = row[: 4 * nb].view(torch.float32)
    per_element_scale = scales.repeat_interleave(block_size)[:numel]
    worst = float(((out - x).abs() / (per_element_scale / 2).clamp_min(1e-30)).max())
    gb = numel * 4 / 1e9
    return {
        "quantize_ms": nearest_ms,
        "quantize_stochastic_ms": stochastic_ms,
        "dequantize_ms": dequant_ms,
        "quantize_GBps": gb / (nearest_ms / 1e3),
        "dequantize_GBps": gb / (dequant_ms / 1e3),
        "worst_error_over_half_scale": worst,
        "wire_bytes_ratio": row.numel() / (numel * 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24, 1 << 27])
    p.add_argument("--block-size", type=int, default=256)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quant_cuda: no CUDA device here")
    device = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, block size {a.block_size}")
    print(
        "| elements | quantize (ms) | stochastic (ms) | dequantize (ms) | quantize GB/s | dequantize GB/s "
        "| worst error / (scale/2) | bytes on the wire / fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in a.sizes:
        r = measure(n, a.block_size, device)
        print(
            f"| {n:,} | {r['quantize_ms']:.3f} | {r['quantize_stochastic_ms']:.3f} | {r['dequantize_ms']:.3f} "
            f"| {r['quantize_GBps']:.0f} | {r['dequantize_GBps']:.0f} | {r['worst_error_over_half_scale']:.4f} "
            f"| {r['wire_bytes_ratio']:.4f} |"
        )
        assert r["worst_error_over_half_scale"] <= 1.0 + 1e-3, r
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
