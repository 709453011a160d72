"""The all-gather of parameters sharded along a dim > 0 (``shard_placement_fn``'s ``Shard(d)``)
writes each one's full tensor with one copy: straight out of the rank-major gathered buffer, with
no pooled copy of its region to rearrange from.

One unit at 2 and 3 gloo ranks holds a large uneven ``Shard(1)`` weight (gathered on its own:
its padded shard is over ``DIRECT_GATHER_BYTES``, in float32 and in bfloat16), small ``Shard(1)``
weights (even and uneven), a 3-D ``Shard(2)`` one and ``Shard(0)`` ones (two in a row). For each all-gather
variant (fullshard's own with and without ``OWN_ROWS_DIRECT``, under ``param_dtype=bfloat16``,
int8-quantized, a custom all-gather comm, ``gather_full``) the full parameters equal the
originals bitwise (int8: equal to the rank-major dequantized gather rearranged afterwards), and
the only buffers the unshard takes from ``buffers.POOL`` are the full flat buffer and the
all-gather's scratch of each piece (the old path took one more of each ``Shard(d)`` parameter's
region, to rearrange it in place), each of a size ``UnitLayout.pooled_sizes`` declares (the lone
``Shard(1)`` weight's scratch included).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from dist import run_ranks
from torch import nn


class _Mixed(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(4, 131072 * world + 1))  # Shard(1), uneven, gathered alone
        self.w0 = nn.Parameter(torch.randn(7, 4))  # Shard(0)
        self.b0 = nn.Parameter(torch.randn(9))  # Shard(0): two in a row, one copy between Shard(d) ones
        self.uneven = nn.Parameter(torch.randn(6, 13))  # Shard(1)
        self.even = nn.Parameter(torch.randn(5, 6 * world))  # Shard(1)
        self.experts = nn.Parameter(torch.randn(3, 5, 8))  # Shard(2)
        self.vec = nn.Parameter(torch.randn(10))  # Shard(0)


def _dims(p: nn.Parameter) -> Any:
    from torch.distributed.tensor import Shard

    return {2: Shard(1), 3: Shard(2)}.get(p.ndim) if p.shape != (7, 4) else None


class _Gather:
    """A custom all-gather comm (torch's AllGather protocol) over gloo's all_gather_into_tensor."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        import torch.distributed as dist

        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _unshard_counted(unit: Any) -> list[int]:
    """Unshard ``unit``; the numel of each buffer of its compute dtype taken from ``buffers.POOL``
    meanwhile (int8's wire buffers are of other dtypes)."""
    from fullshard.comm import buffers

    taken: list[int] = []
    acquire = buffers.POOL.acquire

    def counted(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if dtype == unit.compute_dtype:
            taken.append(numel)
        return acquire(numel, dtype, device)

    buffers.POOL.acquire = counted  # type: ignore[method-assign]
    try:
        unit.unshard()
        unit.wait_for_unshard()
    finally:
        del buffers.POOL.acquire
    return taken


def _int8_expected(unit: Any) -> list[torch.Tensor]:
    """The full parameters as the old path made them under int8: every rank's shards gathered
    rank-major and dequantized (each parameter its own segment, as the engine's pieces), then
    rearranged."""
    from fullshard.comm import quantized

    n, s = unit.shard_size, unit.shard_numel
    sizes = [sp.spec.padded_shard_numel for sp in unit.params]
    ranked = torch.empty(n * s, dtype=unit.compute_dtype)
    handle = quantized.all_gather_int8(
        ranked, unit.local_flat, unit.shard_group, unit.config.comm_quantization.block_size, True, sizes
    )
    handle.wait()
    out = []
    for sp, rows in zip(unit.params, ranked.view(n, s).split(sizes, dim=1)):
        full = torch.empty(sp.spec.orig_shape, dtype=unit.compute_dtype)
        if sp.spec.dim == 0:
            full.view(-1).copy_(rows.reshape(-1)[: sp.spec.numel])
        else:
            sp.spec.ranked_to_full(rows, full)
        out.append(full)
    return out


def _variant(rank: int, world: int, base: _Mixed, name: str) -> None:
    import fullshard as fs
    from fullshard.engine import hooks

    kw: dict[str, Any] = {}
    if name == "bf16":
        kw["mp_policy"] = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if name == "int8":
        kw["comm_quantization"] = fs.CommQuantization(params="int8", grads=None)
    model = fs.fully_shard(copy.deepcopy(base), shard_placement_fn=_dims, **kw)
    if name == "custom":
        model.set_custom_all_gather(_Gather())
    unit = hooks.fsdp_state(model).unit
    assert len(unit.dim_params) == 4, name
    n = unit.shard_size
    dtype = unit.compute_dtype
    direct = [group for group, _, _ in unit._pieces if len(group) == 1]
    assert [g[0].fqn for g in direct] == ["big"], (name, [[sp.fqn for sp in g] for g in direct])
    expected = _int8_expected(unit) if name == "int8" else [p.detach().to(dtype) for p in base.parameters()]
    taken = _unshard_counted(unit)
    # The full flat buffer, then one scratch per piece (a lone Shard(d) parameter's included);
    # a custom comm's output comes from its own allocate. No copy of a Shard(d) parameter's region.
    scratch = [] if name == "custom" else [n * length for _, _, length in unit._pieces]
    assert sorted(taken) == sorted([n * unit.shard_numel, *scratch]), (name, rank, taken)
    # ... and each is a size the unit declares (backward frees pooled buffers by these sizes; a
    # custom comm's output is its own).
    full_size, _packed, *declared = unit.pooled_sizes()
    assert full_size[0] == n * unit.shard_numel, (name, full_size)
    if name != "custom":
        assert scratch == [numel for numel, _ in declared], (name, declared)
    for sp, got, want in zip(unit.params, unit.full_params(tracked=False), expected):
        assert got.dtype == dtype and torch.equal(got, want), (name, rank, sp.fqn)
    model.reshard()
    if name == "plain":
        for sp, got, p in zip(unit.params, unit.gather_full(unit.local_flat), base.parameters()):
            assert torch.equal(got, p.detach()), ("gather_full", rank, sp.fqn)


def body(rank: int, world: int) -> list[str]:
    from fullshard.engine import unit as unit_module

    torch.manual_seed(0)
    base = _Mixed(world)
    for name in ("plain", "bf16", "int8", "custom"):
        _variant(rank, world, base, name)
    unit_module.OWN_ROWS_DIRECT = False
    try:
        _variant(rank, world, base, "plain")
        _variant(rank, world, base, "bf16")
    finally:
        unit_module.OWN_ROWS_DIRECT = True
    return ["done"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_shard_dim_gathered_with_one_copy(world: int) -> None:
    assert run_ranks(body, world, timeout=240) == [["done"]] * world
