"""``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` against torch's own
``fully_shard``, in the same process group (torch's custom-comm path runs on CPU and gloo).

One seeded TinyLM is sharded twice (blocks, then the root), torch's way and fullshard's, and
each unit gets recording comms in torch's ``AllGather`` / ``ReduceScatter`` protocol that wrap
``torch.distributed``'s collectives: their calls (per unit: output and input sizes, the reduce
op) must be torch's, call for call, and after three AdamW steps (the second accumulating a
micro-batch with gradient sync off first) losses and parameters equal torch's bit for bit, at
2 and 3 ranks (the custom comms run torch's own collectives with torch's op). Also:

- a comm set on one block only serves that block (the others and the root use their own);
- a reduce-scatter that halves its input changes the training (it is really used), as torch's;
- ``set_force_sum_reduction_for_comms(True)`` gives the comm SUM (torch's parity), and
  ``set_gradient_divide_factor(3)`` on gloo gives SUM and fullshard divides (torch's own sends
  PREMUL_SUM, which gloo refuses): equal to fullshard without a custom comm;
- bf16 parameters (``MixedPrecisionPolicy``): the all-gather in bf16, the reduction in bf16;
- at 4 ranks, ``reshard_after_forward=2`` (backward's all-gather within 2 ranks goes through the
  comm, as torch's) and hybrid sharding on a 2 x 2 mesh, calls and results torch's;
- the probes count a custom collective's payload like fullshard's own;
- misuse: objects without ``allocate``, ``comm_quantization`` beside a custom comm, a wrong
  ``allocate``, a comm returning neither None nor a Work, process-group allocation after a
  custom comm; ``None`` goes back to fullshard's collectives.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from models import TinyLM, accumulating_steps, tokens

# torch 2.13's names (2.11 has only the older ones)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Gather:
    """A recording all-gather in torch's protocol (``all_gather_single``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.allocs: list[tuple[int, ...]] = []
        self.asyncs: list[bool] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocs.append(tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        n, me = group.size(), group.rank()
        own = output_tensor.view(n, -1)[me]
        assert input_tensor.data_ptr() == own.data_ptr() and input_tensor.numel() == own.numel()  # in place
        self.calls.append(("all_gather", output_tensor.numel(), input_tensor.numel(), output_tensor.dtype))
        self.asyncs.append(async_op)
        return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


class Scatter:
    """A recording reduce-scatter in torch's protocol (``reduce_scatter_single``); ``scale``
    multiplies its input first (a comm that changes the result)."""

    def __init__(self, scale: float = 1.0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.allocs: list[tuple[int, ...]] = []
        self.scale = scale

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocs.append(tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op=False):
        self.calls.append(("reduce_scatter", output_tensor.numel(), input_tensor.numel(), input_tensor.dtype, str(op)))
        if self.scale != 1.0:
            input_tensor.mul_(self.scale)
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _fully_shards() -> dict[str, Any]:
    import fullshard
    from fullshard.frontend.torch_names import torch_fully_shard

    return {"torch": torch_fully_shard(), "fullshard": fullshard.fully_shard}


def _train(
    fully_shard: Any,
    base: torch.nn.Module,
    rank: int,
    which: tuple[int, ...] | None = None,
    scale: float = 1.0,
    setup: Any = None,
    custom: bool = True,
    **kw: Any,
) -> dict[str, Any]:
    """Shard a copy of ``base`` (blocks, root), give the modules numbered in ``which`` (blocks in
    order, then the root; None: all) recording comms, train three AdamW steps."""
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    modules = [*model.layers, model]
    comms: dict[int, tuple[Gather, Scatter]] = {}
    for i, module in enumerate(modules):
        if setup is not None:
            setup(module)
        if custom and (which is None or i in which):
            comms[i] = (Gather(), Scatter(scale))
            module.set_custom_all_gather(comms[i][0])
            module.set_custom_reduce_scatter(comms[i][1])
    losses, params = accumulating_steps(model, rank)
    return {
        "losses": losses,
        "params": params,
        "calls": {i: (g.calls, s.calls) for i, (g, s) in comms.items()},
        "allocs": {i: (g.allocs, s.allocs) for i, (g, s) in comms.items()},
        "asyncs": {i: g.asyncs for i, (g, _) in comms.items()},
    }


def _same(a: dict[str, Any], b: dict[str, Any], what: str, exact: bool = True) -> None:
    if exact:
        assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    else:
        assert torch.allclose(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5), what
    for name, value in a["params"].items():
        same = torch.equal if exact else lambda x, y: torch.allclose(x, y, rtol=1e-4, atol=1e-6)
        assert same(b["params"][name], value), (what, name)


def _like_torch(
    base: torch.nn.Module, rank: int, what: str, exact: bool = True, units: Any = None, **kw: Any
) -> dict[str, Any]:
    """Train torch's way and fullshard's; results equal, and the comms' calls and allocations of
    the modules numbered in ``units`` (None: all) too. Returns fullshard's run."""
    impls = _fully_shards()
    theirs = _train(impls["torch"], base, rank, **kw)
    ours = _train(impls["fullshard"], base, rank, **kw)
    _same(theirs, ours, what, exact)
    for key in ("calls", "allocs"):
        mine, torchs = ({i: v for i, v in run[key].items() if units is None or i in units} for run in (ours, theirs))
        assert mine == torchs, (what, key, mine, torchs)
    return ours, theirs


def parity_body(rank: int, world: int) -> list[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ours, _ = _like_torch(base, rank, "all units")
    gathers, scatters = ours["calls"][0]
    # A block: gathered for forward and for backward in each of the 4 forwards, reduced at the
    # 3 synced backwards; its input is this rank's padded shards, 1/N of the output.
    assert len(gathers) == 8 and len(scatters) == 3, (len(gathers), len(scatters))
    assert all(c[1] == world * c[2] for c in gathers) and all(c[2] == world * c[1] for c in scatters)
    assert {c[4] for c in scatters} == {str(dist.ReduceOp.AVG)}, scatters
    # Where fullshard and torch differ: fullshard's prefetches pass async_op=True.
    assert any(ours["asyncs"][0]), ours["asyncs"]

    # One block's comm serves that block only, as torch's. (The other units use fullshard's own
    # reduce-scatter, bitwise torch's at 2 ranks only: at 3 gloo's sums in another order.)
    ours, _ = _like_torch(base, rank, "block 1 only", exact=world == 2, which=(1,))
    assert set(ours["calls"]) == {1}

    # Parameters sharded along dim 1 (shard_placement_fn): the comm's output is rearranged into
    # the full parameters as fullshard's own all-gather's is (every dim of 12 divides 2 and 3).
    from torch.distributed.tensor import Shard

    _like_torch(base, rank, "Shard(1)", exact=world == 2, shard_placement_fn=lambda p: Shard(p.ndim - 1))

    # A comm that changes the result is used (as by torch): halving before the AVG.
    halved, _ = _like_torch(base, rank, "halved", scale=0.5)
    plain = _train(_fully_shards()["fullshard"], base, rank, custom=False)
    assert halved["losses"][-1] != plain["losses"][-1]

    # force-sum: the comm sums, the division is the engine's (torch's too).
    ours, _ = _like_torch(base, rank, "force sum", setup=lambda m: m.set_force_sum_reduction_for_comms(True))
    assert {c[4] for c in ours["calls"][0][1]} == {str(dist.ReduceOp.SUM)}

    # bf16 parameters and reduction: the comms move bf16.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    ours, _ = _like_torch(base, rank, "bf16", mp_policy=mp)
    assert {c[3] for c in ours["calls"][0][0] + ours["calls"][0][1]} == {torch.bfloat16}
    return ["parity"]


def divide_factor_body(rank: int, world: int) -> list[str]:
    """set_gradient_divide_factor(3) with a custom reduce-scatter on gloo: torch's own sends
    PREMUL_SUM (gloo refuses it); fullshard sends SUM and divides, as without a custom comm."""
    import fullshard
    from fullshard import probes

    torch.manual_seed(0)
    base = TinyLM(layers=2)
    factor = lambda m: m.set_gradient_divide_factor(3.0)  # noqa: E731
    custom = _train(fullshard.fully_shard, base, rank, setup=factor)
    plain = _train(fullshard.fully_shard, base, rank, setup=factor, custom=False)
    _same(plain, custom, "divide factor 3")
    assert {c[4] for c in custom["calls"][0][1]} == {str(dist.ReduceOp.SUM)}

    # The probes count the custom collectives' payload as fullshard's own.
    model = fullshard.fully_shard(TinyLM(layers=1))
    gather, scatter = Gather(), Scatter()
    model.set_custom_all_gather(gather)
    model.set_custom_reduce_scatter(scatter)
    with probes.enabled() as p:
        model(tokens(0, 4)).float().pow(2).mean().backward()
    sent = p.collectives.bytes_sent
    assert p.collectives.calls["all_gather"] == len(gather.calls) and gather.calls
    assert sent["all_gather"] == sum(c[2] * 4 * (world - 1) for c in gather.calls), (sent, gather.calls)
    assert sent["reduce_scatter"] == sum(c[1] * 4 * (world - 1) for c in scatter.calls), (sent, scatter.calls)
    return ["factor"]


class _BadAlloc(Gather):
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size[0] + 1, dtype=dtype, device=device)


class _BadReturn(Scatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[override]
        _reduce_scatter(output_tensor, input_tensor, op=op, group=group)
        return "done"


def misuse_body(rank: int, world: int) -> list[str]:
    import fullshard

    def fresh(**kw: Any) -> Any:
        torch.manual_seed(0)
        return fullshard.fully_shard(TinyLM(layers=1), **kw)

    model = fresh()
    with pytest.raises(TypeError, match="set_custom_all_gather.*allocate"):
        model.set_custom_all_gather(lambda **kw: None)
    with pytest.raises(TypeError, match="set_custom_reduce_scatter.*allocate"):
        model.set_custom_reduce_scatter(object())
    quantized = fresh(comm_quantization=fullshard.CommQuantization(params="int8", grads=None))
    with pytest.raises(ValueError, match="set_custom_all_gather.*comm_quantization.*params"):
        quantized.set_custom_all_gather(Gather())
    quantized.set_custom_reduce_scatter(Scatter())  # gradients are reduced exactly: allowed
    quantized = fresh(comm_quantization=fullshard.CommQuantization(params=None, grads="bf16"))
    with pytest.raises(ValueError, match="set_custom_reduce_scatter.*comm_quantization.*grads"):
        quantized.set_custom_reduce_scatter(Scatter())

    model = fresh()
    model.set_custom_all_gather(_BadAlloc())
    with pytest.raises(TypeError, match=r"_BadAlloc.allocate.*returned shape"):
        model(tokens(0, 2))
    model = fresh()
    model.set_custom_reduce_scatter(_BadReturn())
    with pytest.raises(TypeError, match="set_custom_reduce_scatter.*returned a str"):
        model(tokens(0, 2)).float().mean().backward()

    model = fresh()
    model.set_custom_reduce_scatter(Scatter())
    with pytest.raises(ValueError, match="set_allocate_memory_from_process_group_for_comm.*set_custom_reduce_scatter"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    with pytest.raises(ValueError, match="set_symm_mem_for_comm.*set_custom_reduce_scatter"):
        model.set_symm_mem_for_comm()

    # None goes back to fullshard's own collectives.
    gather, scatter = Gather(), Scatter()
    model = fresh()
    model.set_custom_all_gather(gather)
    model.set_custom_reduce_scatter(scatter)
    model.set_custom_all_gather(None)
    model.set_custom_reduce_scatter(None)
    model(tokens(0, 2)).float().mean().backward()
    assert not gather.calls and not scatter.calls
    return ["misuse"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
def test_custom_comms_like_torch(world: int) -> None:
    assert run_ranks(parity_body, world, timeout=380) == [["parity"]] * world


@pytest.mark.timeout(200)
def test_custom_reduce_scatter_divide_factor_and_bytes() -> None:
    assert run_ranks(divide_factor_body, 2, timeout=180) == [["factor"]] * 2


@pytest.mark.timeout(200)
def test_custom_comm_misuse() -> None:
    assert run_ranks(misuse_body, 2, timeout=180) == [["misuse"]] * 2


def post_forward_body(rank: int, world: int) -> list[str]:
    """reshard_after_forward=2 at 4 ranks: backward's all-gather goes through the comm too,
    within the 2-rank group, as torch's; then hybrid sharding on a 2 x 2 mesh."""
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ours, theirs = _like_torch(base, rank, "reshard_after_forward=2", units=(0, 1), reshard_after_forward=2)
    gathers = ours["calls"][0][0]
    assert {c[1] // c[2] for c in gathers} == {4, 2}, gathers  # forward over 4 ranks, backward over 2
    # The root reshards too when reshard_after_forward is given explicitly (torch >= 2.8), and
    # gathers again for backward, within 2 ranks: as many calls as torch's.
    assert len(theirs["calls"][2][0]) == 8 and len(ours["calls"][2][0]) == 8
    assert [c[1] // c[2] for c in ours["calls"][2][0]] == [c[1] // c[2] for c in theirs["calls"][2][0]]

    # Hybrid sharding (2 replicas x 2 shards): the comms work within the shard group, the
    # replica all-reduce stays the engine's (averaging over the replicas after the comm's AVG).
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours, _ = _like_torch(base, rank, "hybrid", mesh=mesh)
    assert {c[1] // c[2] for c in ours["calls"][0][0]} == {2}
    return ["post-forward"]


@pytest.mark.timeout(300)
def test_custom_comms_post_forward_reshard_and_hybrid() -> None:
    assert run_ranks(post_forward_body, 4, timeout=280) == [["post-forward"]] * 4
