"""``set_reduce_scatter_unused_params(True)`` under rank-dependent control flow: units that
backward reaches on some ranks only (MoE experts) reduce in the same order on every rank.

Each rank chains a rank-dependent choice of experts (every expert runs forward everywhere, only
the chosen ones reach the loss), so backward reaches different units, in different orders, on
different ranks. The gradients must be the unsharded model's, all-reduced and averaged. The
experts keep their parameters from forward (``reshard_after_forward=False``) and no unit
prefetches in backward, so backward gathers nothing: only the reductions' order is under test.
(Backward's all-gathers follow each rank's backward order, which such control flow makes
rank-dependent: the root's prefetch of the last unit of forward, released when another unit's
backward comes first, reshards an expert kept from forward on some ranks only.)
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from dist import run_ranks
from torch import nn

# Per rank, per micro-batch: the experts chained, in order (backward runs them reversed).
ROUTES = {
    2: [[[0, 1, 2], [2, 0]], [[1], [0, 2, 1]]],
    3: [[[0, 1, 2], [2, 0], [1]], [[2], [], [0, 2, 1]]],
}


class Experts(nn.Module):
    def __init__(self, sizes: str) -> None:
        super().__init__()
        self.route: list[int] = []
        self.inp = nn.Linear(4, 4)
        wide = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.experts = nn.ModuleList([nn.Linear(4, 4), wide if sizes == "mixed" else nn.Linear(4, 4), nn.Linear(4, 4)])
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for e in self.experts:  # every expert runs forward on every rank
            e(h)
        for i in self.route:
            h = h + torch.tanh(self.experts[i](h))
        return self.out(h)


def assert_averaged(ref: nn.Module, mod: nn.Module, world: int, tag: str, none_ok=lambda name: False) -> None:
    """``mod``'s gradients (DTensors) are the unsharded ``ref``'s on each rank, all-reduced and
    averaged (a parameter without a gradient counting zeros), to 1e-6; ``none_ok(name)``: the
    parameters allowed to have none."""
    import torch.distributed as dist

    got = {n: p.grad for n, p in mod.named_parameters()}
    for n, p in ref.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(want)
        want /= world
        if got[n] is None:
            assert none_ok(n), (tag, n)
            continue
        torch.testing.assert_close(got[n].full_tensor(), want, rtol=0, atol=1e-6, msg=f"{tag} {n}")


def hsdp_mesh(on: bool) -> Any:
    """A 2x2 (replicate, shard) device mesh over 4 ranks when ``on``, else None."""
    if not on:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def body(rank: int, world: int) -> list[str]:

    import fullshard
    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import TrainingState

    results = []
    for sizes in ("equal", "mixed"):
        for flagged in ("all", "experts"):
            for accumulate in (False, True):
                torch.manual_seed(0)
                ref = Experts(sizes)
                mod = copy.deepcopy(ref)
                for e in mod.experts:
                    fullshard.fully_shard(e, reshard_after_forward=False)
                fullshard.fully_shard(mod)
                for unit in (mod, *mod.experts):
                    unit.set_modules_to_backward_prefetch([])
                if flagged == "all":
                    mod.set_reduce_scatter_unused_params(True)
                else:
                    for e in mod.experts:
                        e.set_reduce_scatter_unused_params(True, recurse=False)
                micro = [0, 1] if accumulate else [0]
                for step, m in enumerate(micro):
                    mod.set_requires_gradient_sync(step == len(micro) - 1)
                    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * m + rank))
                    for model in (ref, mod):
                        model.route = ROUTES[world][m][rank]
                        (model(x) ** 2).mean().backward()
                assert_averaged(ref, mod, world, f"{sizes} {flagged} {accumulate}")
                units = [s.unit for m in mod.modules() if (s := fsdp_state(m)) is not None]
                assert all(u.training_state is TrainingState.IDLE for u in units)
                results.append(f"{sizes} {flagged} {accumulate}")
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_units_reached_on_some_ranks_reduce_in_one_order(world: int) -> None:
    assert len(run_ranks(body, world, timeout=100)[0]) == 8


class Twice(nn.Module):
    """``shared`` runs twice: with grad, and inside a reentrant checkpoint segment, whose
    recomputation runs its own backward (its own autograd graph task). So the unit's
    gradient-ready hook fires twice in one backward. ``late``: the segment first, so backward
    reaches the call outside it first and the segment's gradient comes after the unit's
    post-backward (it runs twice). Else the segment last: its backward comes first, while the
    other call's backward has yet to run, and the unit waits for it (one post-backward).
    ``expert`` runs between them, and reaches the loss where ``routed``."""

    def __init__(self) -> None:
        super().__init__()
        self.routed, self.late = True, False
        self.inp = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def _shared(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        h = checkpoint(self._shared, h, use_reentrant=True) if self.late else self._shared(h)
        e = self.expert(h)  # on every rank: its all-gather
        if self.routed:
            h = h + torch.tanh(e)
        return self.out(self._shared(h) if self.late else checkpoint(self._shared, h, use_reentrant=True))


# (units flagged, ranks whose backward reaches the expert, None for every rank): unflagged, a
# unit must be reached on every rank or none. Flagged and reached on rank 0 only, the expert's turn (before shared's)
# comes between shared's two post-backwards there: shared reduces, then gets a late gradient;
# on rank 1 it holds both gradients until backward's end.
TWICE = [
    ("none", None),
    ("none", ()),
    ("expert", (0,)),
    ("expert", (1,)),
    ("expert", (0, 1)),
    ("expert", ()),
    ("all", (0,)),
    ("all", (1,)),
]


def twice_body(
    rank: int,
    world: int,
    configs: list = TWICE,
    graph: bool = False,
    keep: bool = True,
    late: bool = False,
    resharded: bool = False,
) -> list[str]:
    """The gradients of :class:`Twice`, sharded (``shared`` and ``expert`` kept gathered from
    forward to the end of backward, so backward gathers nothing in a rank-dependent order; at 4
    ranks HSDP on a 2x2 mesh), are the unsharded model's averaged; ``shared``'s post-backward
    runs once (twice with ``late``: see :class:`Twice`); one MAX all-reduce per group for the
    late round where some unit is flagged, none without. A parameter of ``shared`` that forward
    never uses keeps ``.grad`` None on every rank (zeros where ``shared`` is flagged), so torch's
    ``clip_grad_norm_`` issues the same collectives on every rank. With ``graph``, backwards
    with ``create_graph=True``. Without ``keep``, ``shared`` reshards after backward as by
    default (flagged, at backward's end); with ``resharded``, after forward too."""
    from dist import patched

    import fullshard
    from fullshard.comm import collectives
    from fullshard.engine import hooks
    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import ShardState, TrainingState

    mesh = hsdp_mesh(world == 4)
    results = []
    for flagged, routed in configs:
        torch.manual_seed(0)
        ref = Twice()
        ref.late = late
        ref.shared.spare = nn.Parameter(torch.randn(4))  # never used by forward
        mod = copy.deepcopy(ref)
        fullshard.fully_shard(mod.shared, reshard_after_forward=resharded, mesh=mesh)
        fullshard.fully_shard(mod.expert, reshard_after_forward=False, mesh=mesh)
        fullshard.fully_shard(mod, mesh=mesh)
        for unit in (mod, mod.shared, mod.expert):
            unit.set_modules_to_backward_prefetch([])
        mod.shared.set_reshard_after_backward(not keep, recurse=False)
        if flagged == "all":
            mod.set_reduce_scatter_unused_params(True)
        elif flagged == "expert":
            mod.expert.set_reduce_scatter_unused_params(True, recurse=False)
        reached: list[str] = []
        maxes: list[int] = []
        post_backward, all_reduce_max = hooks.post_backward, collectives.all_reduce_max

        def counted(unit: Any, root: Any) -> None:
            reached.append(unit.name)
            post_backward(unit, root)

        def counted_max(tensor: torch.Tensor, group: Any) -> None:
            maxes.append(tensor.numel())
            all_reduce_max(tensor, group)

        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        with patched(hooks, post_backward=counted), patched(collectives, all_reduce_max=counted_max):
            for model in (ref, mod):
                model.routed = routed is None or rank in routed
                (model(x) ** 2).mean().backward(create_graph=graph)
        what = f"{flagged} {routed} {graph}"
        assert reached.count("shared") == (2 if late else 1), (what, reached)
        # One per group for the late round (flagged units); settle_unused sums its flags instead.
        assert len(maxes) == (0 if flagged == "none" else 1 if mesh is None else 2), (what, maxes)

        def unreached(name: str) -> bool:  # an unflagged unit no rank reached: its .grad stays None
            return flagged == "none" and routed == () and name.startswith("expert.") or name == "shared.spare"

        assert_averaged(ref, mod, world, what, none_ok=unreached)
        spare = dict(mod.named_parameters())["shared.spare"].grad
        assert (spare is None) == (flagged != "all"), (what, spare)
        torch.nn.utils.clip_grad_norm_(list(mod.parameters()), 1e9)  # collectives on DTensor .grads
        units = [s.unit for m in mod.modules() if (s := fsdp_state(m)) is not None]
        assert all(u.training_state is TrainingState.IDLE for u in units), what
        assert (fsdp_state(mod.shared).unit.shard_state is ShardState.SHARDED) != keep, what  # type: ignore[union-attr]
        results.append(what)
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_a_unit_reached_twice_in_one_backward_reduces_both_gradients(world: int) -> None:
    assert len(run_ranks(twice_body, world, timeout=100)[0]) == len(TWICE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_a_flagged_unit_reached_twice_reshards_at_backwards_end(world: int) -> None:
    # Its post-backward after the segment's backward fires where its parameters got a gradient
    # and resharded it there: the second call's backward then failed ("backward needs a tensor
    # saved from the unit's full parameters"). It now reshards at backward's end, on every rank.
    configs = [("all", (0,)), ("all", (1,)), ("all", (0, 1))]
    assert len(run_ranks(twice_body, world, configs, False, False, timeout=100)[0]) == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_a_unit_reached_in_a_segment_first_waits_for_its_other_call(world: int) -> None:
    # The segment's backward (its own graph task) comes while the call outside it has yet to run
    # its backward: the unit's post-backward waits for that one, so it reshards after forward and
    # after backward as by default. It used to run there and reshard, and the other call's
    # backward failed ("backward needs a tensor saved from the unit's full parameters") unless
    # reshard_after_forward=False and set_reshard_after_backward(False) kept it gathered.
    assert len(run_ranks(twice_body, world, TWICE, False, False, False, True, timeout=100)[0]) == len(TWICE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_a_unit_in_a_segment_recomputed_after_its_post_backward_runs_again(world: int) -> None:
    # The segment first in forward (``late``), the unit resharded after forward and backward: its
    # post-backward for the call outside the segment comes first, then the segment recomputes it
    # ("cannot run forward in training state POST_BACKWARD" before 2026-11-29); it is gathered
    # again and reduces the segment's gradient as a second one (engine.nested_grad.reopen).
    configs = [c for c in TWICE if c[0] == "none"]
    assert len(run_ranks(twice_body, world, configs, False, False, True, True, timeout=100)[0]) == len(configs)


def late_flagged_body(rank: int, world: int) -> str:
    """:func:`twice_body` with ``late`` in a tree with a flagged unit: the error each rank raises."""
    try:
        twice_body(rank, world, [("expert", (0,))], False, False, True, True)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_a_flagged_tree_refuses_a_recomputation_after_the_units_post_backward() -> None:
    # Its turns and late round assume one post-backward per graph task: letting the segment run
    # again paired collectives crosswise beside an expert reached on one rank (a gloo abort). The
    # state check's error stands, on every rank.
    for error in run_ranks(late_flagged_body, 2, timeout=100):
        assert "'shared': cannot run forward in training state POST_BACKWARD" in error, error


@pytest.mark.timeout(120)
def test_a_unit_reached_twice_in_a_backward_that_creates_a_graph() -> None:
    # The shards' .grad are views: adding the second reduction refused grad mode's in-place add.
    configs = [("none", None), ("expert", (0,))]
    assert len(run_ranks(twice_body, 2, configs, True, timeout=100)[0]) == 2


class TwoWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(h), self.b(h)


class ExtensionExpert(nn.Module):
    """An expert whose only parameters are two all-gather extension weights (made by the
    test): both reach the loss where ``routed``, or (``partial``) ``a`` on every rank and ``b``
    where ``routed``."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = True
        self.partial = False
        self.inp = nn.Linear(4, 4)
        self.expert = TwoWeights()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        a, b = self.expert(h)  # on every rank: its all-gather
        if self.partial or self.routed:
            h = h + torch.tanh(a)
        if self.routed:
            h = h + torch.tanh(b)
        return self.out(h)


def _extension_pair(partial: bool) -> tuple[ExtensionExpert, ExtensionExpert]:
    """An unsharded :class:`ExtensionExpert` (values made bfloat16's, so the bfloat16 gather is
    exact) and its copy with the expert's weights made all-gather extension ones, the expert
    kept gathered after forward and the root wrapped."""
    from agext_tensors import wrap_weights

    import fullshard

    torch.manual_seed(0)
    ref = ExtensionExpert()
    ref.partial = partial
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    mod = copy.deepcopy(ref)
    wrap_weights(mod.expert)
    fullshard.fully_shard(mod.expert, reshard_after_forward=False)
    fullshard.fully_shard(mod)
    return ref, mod


def extension_body(rank: int, world: int) -> list[str]:
    """A flagged unit whose only trainable parameters are all-gather extension ones
    (:class:`agext_tensors.Bf16CommWeight`, gathered in bfloat16: the values are made bfloat16's
    so the gather is exact) reduces on every rank, zeros where backward did not reach it, or
    did not reach one of its weights (``partial``: every rank packs the same parameters): the
    gradients are the unsharded model's averaged."""

    from fullshard.engine.all_gather_extension import ExtensionUnit
    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import TrainingState

    results = []
    for partial, routed in [(p, r) for p in (False, True) for r in [(0,), (1,), (0, 1), ()]]:
        ref, mod = _extension_pair(partial)
        expert = fsdp_state(mod.expert)
        assert expert is not None and isinstance(expert.unit, ExtensionUnit) and not expert.unit.trainable
        for unit in (mod, mod.expert):
            unit.set_modules_to_backward_prefetch([])
        mod.expert.set_reduce_scatter_unused_params(True, recurse=False)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        for model in (ref, mod):
            model.routed = rank in routed
            (model(x) ** 2).mean().backward()
        assert_averaged(ref, mod, world, f"{partial} {routed}")
        units = [s.unit for m in mod.modules() if (s := fsdp_state(m)) is not None]
        assert all(u.training_state is TrainingState.IDLE and not u.has_pending_reduce for u in units), routed
        results.append(f"{partial} {routed}")
    return results


@pytest.mark.timeout(120)
def test_an_extension_only_unit_reached_on_some_ranks_reduces_on_all() -> None:
    assert len(run_ranks(extension_body, 2, timeout=100)[0]) == 8


# Per world size: the ranks whose backward reaches ``b``, per step (``a`` reaches it on every rank).
UNFLAGGED_ROUTES = {2: [(0,), (), (1,), (0, 1)], 3: [(1,), (), (0, 2)]}


def extension_unused_body(rank: int, world: int) -> list[str]:
    """Unflagged (an unused parameter keeps ``.grad`` None), an extension-only unit reached on
    every rank whose weight ``b`` reaches the loss on some ranks only: every rank packs both
    weights (the reduce-scatter's sizes used to differ per rank: gloo failed), and ``b``'s
    ``.grad`` is set on every rank where some rank used it (the averaged gradient), None on
    every rank where none did, its post-accumulate-grad hooks run on every rank alike, and
    torch's ``clip_grad_norm_`` gives the unsharded model's norm on every rank."""

    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import TrainingState

    ref, mod = _extension_pair(True)
    for unit in (mod, mod.expert):
        unit.set_modules_to_backward_prefetch([])
    calls: list[str] = []
    for name in ("a", "b"):
        getattr(mod.expert, name).weight.register_post_accumulate_grad_hook(lambda p, n=name: calls.append(n))
    results = []
    for step, routed in enumerate(UNFLAGGED_ROUTES[world]):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank + 10 * step))
        for model in (ref, mod):
            model.zero_grad(set_to_none=True)
            model.routed = rank in routed
            (model(x) ** 2).mean().backward()
        assert_averaged(ref, mod, world, f"{routed}", none_ok=lambda n: n == "expert.b.weight" and not routed)
        has = {n: p.grad is not None for n, p in mod.named_parameters()}
        assert has["expert.b.weight"] == bool(routed) and all(v for n, v in has.items() if n != "expert.b.weight")
        want = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in mod.parameters() if p.grad is not None])
        got = torch.nn.utils.clip_grad_norm_(list(mod.parameters()), 1e9)
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=f"{routed}")
        units = [s.unit for m in mod.modules() if (s := fsdp_state(m)) is not None]
        assert all(u.training_state is TrainingState.IDLE and not u.has_pending_reduce for u in units), routed
        every: list[Any] = [None] * world
        torch.distributed.all_gather_object(every, (sorted(has.items()), list(calls)))
        assert all(e == every[0] for e in every), (routed, every)
        results.append(f"{routed} {''.join(calls)}")
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_an_extension_weight_used_on_some_ranks_gets_a_grad_on_every_rank(world: int) -> None:
    # a's hooks run at every step, b's where some rank used it, on every rank (the hooks seen so far).
    want = {2: ["(0,) ab", "() aba", "(1,) abaab", "(0, 1) abaabab"], 3: ["(1,) ab", "() aba", "(0, 2) abaab"]}
    assert run_ranks(extension_unused_body, world, timeout=100) == [want[world]] * world


class Lookup(nn.Module):
    """``emb`` runs on the last rank only, for tokens in the rows of the last rank's shard, so
    the averaged gradient is zero in every other rank's rows; ``spare`` no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4)
        self.spare = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        if tokens is not None:
            x = x + self.emb(tokens).sum(0)
        return self.head(x)


def lookup_body(rank: int, world: int) -> list[int]:
    """Unflagged ``fully_shard`` (an unused parameter keeps ``.grad`` None): ``emb.weight``,
    used on one rank only, gets a ``.grad`` on every rank (zeros where its reduced shard is
    zero) and runs its post-accumulate-grad hooks once there; ``spare`` keeps None on every
    rank; torch's ``clip_grad_norm_`` then matches the unsharded model's norm (it used to run
    different collectives per rank: a hang). Returns the hooks' calls per step."""
    import fullshard

    torch.manual_seed(0)
    ref = Lookup()
    mod = copy.deepcopy(ref)
    fullshard.fully_shard(mod.spare)  # a unit no rank's forward runs
    fullshard.fully_shard(mod)  # emb is the root's: a unit run on some ranks only would hang in forward
    calls: list[int] = []
    mod.emb.weight.register_post_accumulate_grad_hook(lambda p: calls.append(rank))
    tokens = torch.tensor([10, 11]) if rank == world - 1 else None
    counts = []
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank + 10 * step))
        for model in (ref, mod):
            model.zero_grad()
            model(x, tokens).sum().backward()
        assert_averaged(ref, mod, world, f"step {step}", none_ok=lambda name: name.startswith("spare."))
        assert mod.emb.weight.grad is not None, (rank, step)
        assert all(p.grad is None for p in mod.spare.parameters()), (rank, step)
        want = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in mod.parameters() if p.grad is not None])
        got = torch.nn.utils.clip_grad_norm_(list(mod.parameters()), 1e9)
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6)
        counts.append(len(calls))
    return counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_a_parameter_used_on_one_rank_gets_a_grad_on_every_rank(world: int) -> None:
    assert run_ranks(lookup_body, world, timeout=100) == [[1, 2]] * world


class Raises(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: after the units behind it launched."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if Raises.armed:
            raise RuntimeError("raised in backward")
        return g


class RaisesModule(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Raises.apply(x)


class Rows(nn.Module):
    """``emb`` (row 0, the first rank's rows) where ``use_emb``; ``weight`` an all-gather
    extension weight (made by the test) that forward never reads, so the unit's extension part
    never reports and its finish launches the held plain gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.use_emb = False
        self.emb = nn.Embedding(4, 4)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.bias
        return y + self.emb(torch.tensor([0])) if self.use_emb else y


def settle_edges_body(rank: int, world: int) -> list[str]:
    """What settle_unused agrees on is this backward's: (1) after a backward that raised once a
    unit had launched (rank 0 used ``emb`` there), a step no rank uses ``emb`` in keeps its
    ``.grad`` None on every rank; (2) a unit whose reduction launches while the reductions are
    landed (an extension part that never reported, in a backward with ``create_graph=True``)
    gives ``emb`` a ``.grad`` on every rank when rank 0 used it, and None the step after."""
    from agext_tensors import Bf16CommWeight

    import fullshard

    torch.manual_seed(0)
    done = []
    seq = nn.Sequential(nn.Linear(4, 4), RaisesModule(), Rows())
    fullshard.fully_shard(seq[2])
    fullshard.fully_shard(seq)

    def step(use: bool) -> None:
        seq.zero_grad(set_to_none=True)
        seq[2].use_emb = use
        seq(torch.ones(2, 4)).square().sum().backward()

    Raises.armed = True
    with pytest.raises(RuntimeError, match="raised in backward"):
        step(rank == 0)
    Raises.armed = False
    step(False)
    assert seq[2].emb.weight.grad is None, "after a backward that raised"
    done.append("raised")

    torch.manual_seed(0)
    rows = Rows()
    rows.weight = nn.Parameter(Bf16CommWeight(torch.randn(4, 4)))  # never read by forward
    fullshard.fully_shard(rows)
    for i, use in enumerate((rank == 0, False)):
        rows.zero_grad(set_to_none=True)
        rows.use_emb = use
        rows(torch.ones(2, 4)).square().sum().backward(create_graph=i == 0)
        # (after create_graph=True the unit stays gathered: rows.emb.weight is the full tensor)
        has = [dict(rows.named_parameters())["emb.weight"].grad is not None]
        every = [None] * world
        torch.distributed.all_gather_object(every, has)
        assert every == [[i == 0]] * world, (i, every)
    done.append("graph")
    return done


@pytest.mark.timeout(120)
def test_settle_agrees_on_this_backward_only() -> None:
    assert run_ranks(settle_edges_body, 2, timeout=100)[0] == ["raised", "graph"]


class GatheredInBackward(nn.Module):
    """``e0`` reaches the loss on every rank and is resharded after forward (it all-gathers in
    backward); the experts after it, flagged and kept gathered, on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.e0 = nn.Linear(4, 4)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)
        self.use_experts = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.e0(x))
        for e in self.experts:  # every expert runs forward on every rank
            out = e(h)
            if self.use_experts:
                h = h + torch.tanh(out)
        return self.head(h)


def gathered_in_backward_body(rank: int, world: int, hybrid: bool, micro: int) -> list[bool]:
    """Two steps of ``micro`` micro-batches (sync off for all but the last); per step the ranks
    that use the experts change. A rank that uses them reaches both experts' post-backward (their
    turns come first) before ``e0``'s backward all-gather; one that does not all-gathers ``e0``
    first and reduces the experts' zeros at the end. Launched at those points the reductions and
    the all-gather would pair crosswise over the shard group. Returns, per step, whether every
    reduction of the last backward came after its last all-gather."""
    import fullshard
    from fullshard.comm import flight_recorder

    torch.manual_seed(0)
    ref = GatheredInBackward()
    mod = copy.deepcopy(ref)
    mesh = hsdp_mesh(hybrid)
    fullshard.fully_shard(mod.e0, mesh=mesh)
    for e in mod.experts:
        fullshard.fully_shard(e, mesh=mesh, reshard_after_forward=False)
        e.set_reduce_scatter_unused_params(True, recurse=False)
    fullshard.fully_shard(mod, mesh=mesh)
    for unit in (mod, mod.e0, *mod.experts):
        unit.set_modules_to_backward_prefetch([])
    after = []
    for step, users in enumerate(([1], [0, world - 1])):
        for model in (ref, mod):
            model.use_experts = rank in users
            model.zero_grad(set_to_none=True)
        for m in range(micro):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + 10 * m + rank))
            ref(x).square().mean().backward()
            mod.set_requires_gradient_sync(m == micro - 1)
            flight_recorder.RECORDER.entries.clear()
            mod(x).square().mean().backward()
        ops = [e.op for e in flight_recorder.RECORDER.entries]
        gathers = [i for i, op in enumerate(ops) if op == "all_gather"]
        reductions = [i for i, op in enumerate(ops) if op == "reduce_scatter"]
        after.append(bool(gathers) and bool(reductions) and max(gathers) < min(reductions))
        assert_averaged(ref, mod, world, f"step {step}")
    return after


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "hybrid", "micro"), [(2, False, 1), (3, False, 2), (4, True, 1)])
def test_a_unit_gathered_in_backward_next_to_ones_reached_on_some_ranks(world: int, hybrid: bool, micro: int) -> None:
    """docs/api.md: units reached on some ranks only kept gathered; another, reached on every
    rank, may reshard after forward and all-gather in backward: the tree then reduces at
    backward's end, after every all-gather, in turn order on every rank."""
    assert run_ranks(gathered_in_backward_body, world, hybrid, micro, timeout=100) == [[True, True]] * world


class Gate(nn.Module):
    """``h + tanh(lin(h))`` where ``use``, else ``h`` itself (a layer some ranks skip): its
    output requires grad on every rank, its parameters get a gradient on some only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.use = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h)) if self.use else h * 1.0


class Gated(nn.Module):
    """Units ``y``, ``x`` (a :class:`Gate`, flagged), ``head``, all resharded after forward, of
    one size (crosswise pairs would not fail), then the root's ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.y, self.x, self.head, self.out = nn.Linear(4, 4), Gate(), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.x(torch.tanh(self.y(inp)))))


def gated_body(rank: int, world: int) -> list[str]:
    import fullshard
    from fullshard.comm import flight_recorder

    mesh = hsdp_mesh(world == 4)
    torch.manual_seed(0)
    ref = Gated()
    mod = copy.deepcopy(ref)
    for m in (mod.y, mod.x, mod.head):
        fullshard.fully_shard(m, mesh=mesh)
    fullshard.fully_shard(mod, mesh=mesh)
    mod.x.set_reduce_scatter_unused_params(True, recurse=False)
    for unit in (mod, mod.y, mod.x, mod.head):
        unit.set_modules_to_backward_prefetch([])
    for step, users in enumerate(([0], [world - 1])):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        for model in (ref, mod):
            model.x.use = rank in users
            model.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()
        flight_recorder.RECORDER.entries.clear()
        mod(x).square().mean().backward()
        assert_averaged(ref, mod, world, f"step {step}")
    return [f"{e.op} {e.unit}" for e in flight_recorder.RECORDER.entries if e.op in ("all_gather", "reduce_scatter")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_a_flagged_unit_whose_parameters_some_ranks_skip_reduces_after_the_all_gathers(world: int) -> None:
    """``x`` reshards and every rank's backward reaches it (all-gathers it), but its post-backward
    fires only where its parameters got a gradient; the others reduce its zeros at the end. Its
    turn, launched during backward before ``y``'s all-gather on one rank and after it on another,
    paired crosswise (equal sizes: wrong gradients, no error; found by review). Now the turns from
    the first flagged unit's on wait for the end; ``head``'s, before it, still launches during
    backward. At 4 ranks, HSDP 2x2."""
    ops = run_ranks(gated_body, world, timeout=100)
    assert all(o == ops[0] for o in ops), ops
    backward = ops[0][ops[0].index("all_gather head", ops[0].index("all_gather head") + 1) :]
    assert backward == [
        "all_gather head",
        "reduce_scatter head",
        "all_gather x",
        "all_gather y",
        "reduce_scatter x",
        "reduce_scatter y",
        "reduce_scatter <root>",
    ], backward


class RootExtra(nn.Module):
    """A frozen unit ``f`` resharded after forward (its input requires grad: backward all-gathers
    it), ``t`` and ``head``; the root's own ``extra`` runs in a reentrant checkpoint on some
    ranks only, so the root's post-backward comes early there (inside the nested backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.t, self.extra, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.f.requires_grad_(False)
        self.use = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.utils.checkpoint

        h = self.t(torch.tanh(self.f(x)))
        if self.use:
            h = h + torch.utils.checkpoint.checkpoint(self.extra, h, use_reentrant=True)
        return self.head(h)


def root_reached_early_body(rank: int, world: int) -> list[str]:
    import fullshard
    from fullshard.comm import flight_recorder

    torch.manual_seed(0)
    ref = RootExtra()
    mod = copy.deepcopy(ref)
    for m in (mod.f, mod.t, mod.head, mod):
        fullshard.fully_shard(m)
    mod.set_reduce_scatter_unused_params(True, recurse=False)
    for unit in (mod, mod.f, mod.t, mod.head):
        unit.set_modules_to_backward_prefetch([])
    for model in (ref, mod):
        model.use = rank == 0
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    ref(x.clone().requires_grad_(True)).square().mean().backward()
    flight_recorder.RECORDER.entries.clear()
    mod(x.clone().requires_grad_(True)).square().mean().backward()
    assert_averaged(ref, mod, world, "root reached early", none_ok=lambda n: n.startswith("f."))
    return [e.op for e in flight_recorder.RECORDER.entries if e.op in ("all_gather", "reduce_scatter")]


@pytest.mark.timeout(120)
def test_a_flagged_root_reached_early_on_some_ranks_reduces_at_the_end() -> None:
    """The root's turn is the last, but on a rank whose backward reaches it inside a reentrant
    checkpoint it came before the frozen unit's all-gather (no turn), where the other rank
    reduced the root's zeros after it: the two paired crosswise, equal in size, and the
    gradients came out wrong with no error (found by review). The root's turn waits for the end."""
    ops = run_ranks(root_reached_early_body, 2, timeout=100)
    assert ops[0] == ops[1] and ops[0][-1] == "reduce_scatter", ops
