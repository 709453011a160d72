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


def body(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

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
                got = {n: p.grad for n, p in mod.named_parameters()}
                for n, p in ref.named_parameters():
                    want = p.grad if p.grad is not None else torch.zeros_like(p)
                    dist.all_reduce(want)
                    want /= world
                    assert got[n] is not None, (sizes, flagged, accumulate, n)
                    torch.testing.assert_close(
                        got[n].full_tensor(), want, rtol=0, atol=1e-6, msg=f"{sizes} {flagged} {accumulate} {n}"
                    )
                units = [s.unit for m in mod.modules() if (s := fsdp_state(m)) is not None]
                assert all(u.training_state is TrainingState.IDLE for u in units)
                results.append(f"{sizes} {flagged} {accumulate}")
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_units_reached_on_some_ranks_reduce_in_one_order(world: int) -> None:
    assert len(run_ranks(body, world, timeout=100)[0]) == 8
