"""torch.distributed.pipelining schedules over stages sharded by ``fully_shard`` (torchtitan's pp x dp).

At 4 gloo ranks (a ("pp", "dp") mesh of 2 x 2), one seeded model of 8 residual blocks (width 7,
which does not divide the dp size) is split into stages, each block and each stage root sharded
on the dp submesh, once with torch's ``fully_shard`` and once with fullshard's (bound in torch's
pipeline stage by ``fullshard.use_in_torch()``), and trained 3 steps of 4 micro-batches with
ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B (2 stages per rank), Adam and SGD with
momentum: losses and parameters after every step are bitwise torch's, each step after the first
all-gathers as often as torch's (a unit gathered once per step with ``reshard_after_forward=False``,
not once per micro-batch; at most once more per unit in the first step), each unit reduce-scatters
once per step (at the schedule's REDUCE_GRAD, as torch's), and every unit ends SHARDED and IDLE.
The same for 2 steps with ``reshard_after_forward=True``. torch's own units train as before while
the binding is on.

At 1 rank: a split backward (ScheduleZBVZeroBubble's I / W actions), which would lose fullshard's
weight gradients, is refused; a schedule run without ``use_in_torch()`` names the fix before the
first backward instead of failing at REDUCE_GRAD.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from torch import nn

WIDTH = 7
BLOCKS = 8
MICROBATCHES = 4
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _stages(
    engine: str, schedule: str, mesh, blocks: list[nn.Module], reshard_after_forward: bool = False
) -> tuple[list[nn.Module], object]:
    """This rank's stage modules (sharded by ``engine``) and the schedule running them."""
    from torch.distributed.pipelining import PipelineStage, schedules

    import fullshard
    from fullshard.frontend.torch_names import torch_fully_shard

    shard = torch_fully_shard() if engine == "torch" else fullshard.fully_shard
    pp_rank, pp_size = mesh.get_local_rank("pp"), mesh.size(0)
    per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    n_stages = pp_size * per_rank
    if schedule in ("ZBV", "DualPipeV"):  # V schedules: rank r holds stages r and n - 1 - r
        ids = [pp_rank, n_stages - 1 - pp_rank]
    else:
        ids = [pp_rank + k * pp_size for k in range(per_rank)]
    per = len(blocks) // n_stages
    mods, stages = [], []
    for i in ids:
        mod = nn.Sequential(*copy.deepcopy(blocks[i * per : (i + 1) * per]))
        for block in mod:
            shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        shard(mod, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        mods.append(mod)
        stages.append(PipelineStage(mod, i, n_stages, torch.device("cpu"), group=mesh.get_group("pp")))
    cls = {
        "GPipe": schedules.ScheduleGPipe,
        "1F1B": schedules.Schedule1F1B,
        "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
        "ZBV": schedules.ScheduleZBVZeroBubble,
        "DualPipeV": schedules.ScheduleDualPipeV,
    }[schedule]
    return mods, cls(stages if per_rank > 1 else stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss)


def _train(
    engine: str, schedule: str, optim: str, mesh, reshard_after_forward: bool = False, steps: int = STEPS
) -> dict:
    """Losses, parameters (full tensors), all-gathers and reduce-scatters of each step; the units' states."""
    from dist import patched
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from fullshard import probes
    from fullshard.engine import hooks

    torch.manual_seed(0)
    mods, sched = _stages(engine, schedule, mesh, [Block() for _ in range(BLOCKS)], reshard_after_forward)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2) if optim == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    n_stages = sched._num_stages if hasattr(sched, "_num_stages") else mesh.size(0)
    first, last = mesh.get_local_rank("pp") == 0, mesh.get_local_rank("pp") == (n_stages - 1) % mesh.size(0)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(1)
    gen = torch.Generator().manual_seed(1)
    out: dict = {"losses": [], "params": [], "gathers": [], "reduces": [], "states": set()}
    out["ours"] = any(hooks.is_unit(m) for m in mods)
    torch_gathers = []  # torch's units' all-gathers (one foreach_all_gather per parameter group)
    real_gather = _fsdp_param_group.foreach_all_gather

    def counting(*args, **kwargs):
        torch_gathers.append(1)
        return real_gather(*args, **kwargs)

    for _ in range(steps):
        x, y = (torch.randn(dp_size * MICROBATCHES, WIDTH, generator=gen).chunk(dp_size)[dp_rank] for _ in "xy")
        losses: list[torch.Tensor] = []
        torch_gathers.clear()
        with probes.enabled() as p, patched(_fsdp_param_group, foreach_all_gather=counting):
            sched.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
        out["gathers"].append(len(torch_gathers) if engine == "torch" else p.collectives.calls["all_gather"])
        out["reduces"].append(p.collectives.calls["reduce_scatter"])
        opt.step()
        opt.zero_grad()
        out["losses"].append([loss.item() for loss in losses])
        out["params"].append([q.full_tensor().detach().clone() for q in params])  # dp 1: a view of the shard
        if engine == "fullshard":
            units = {id(s.unit): s.unit for m in mods for sub in m.modules() if (s := hooks.fsdp_state(sub))}
            out["states"] |= {(u.shard_state.name, u.training_state.name) for u in units.values()}
            out["units"] = len(units) - len(mods)  # the stage roots hold no parameters of their own
    return out


def _differences(tag: str, got: dict, ref: dict) -> list[str]:
    """Where fullshard's run ``got`` parts from torch's ``ref``: losses, parameters, all-gathers
    per step; one reduce-scatter per unit per step; every unit SHARDED and IDLE after each step."""
    failures = []
    steps = len(ref["losses"])
    if got["losses"] != ref["losses"]:
        failures.append(f"{tag}: losses {got['losses']} != torch's {ref['losses']}")
    for step, (a, b) in enumerate(zip(got["params"], ref["params"])):
        diff = max((x - y).abs().max().item() for x, y in zip(a, b))
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            failures.append(f"{tag}: parameters differ from torch's after step {step} (max {diff:.3g})")
    # From the second step on, as many all-gathers as torch's. In the first, a unit that runs a
    # second forward before its first backward gathers once more: only then does it start recording
    # its shards' version, which a reuse checks (an ordinary step never pays for reading it).
    extra = got["gathers"][0] - ref["gathers"][0]
    if got["gathers"][1:] != ref["gathers"][1:] or not 0 <= extra <= got["units"]:
        failures.append(f"{tag}: all-gathers per step {got['gathers']}, torch's {ref['gathers']}")
    if got["reduces"] != [got["units"]] * steps:
        failures.append(f"{tag}: reduce-scatters per step {got['reduces']}, not one per unit ({got['units']})")
    if got["states"] != {("SHARDED", "IDLE")}:
        failures.append(f"{tag}: units left in {got['states']}")
    return failures


def _compare_body(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    import fullshard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    failures = []
    for schedule, optim in (("GPipe", "adam"), ("1F1B", "sgd"), ("Interleaved1F1B", "adam")):
        ref = _train("torch", schedule, optim, mesh)
        with fullshard.use_in_torch():
            got = _train("fullshard", schedule, optim, mesh)
        tag = f"{schedule}/{optim} rank {rank}"
        if schedule == "GPipe":  # torch's units under the binding: fullshard's fully_shard.state hands them to torch's
            with fullshard.use_in_torch():
                again = _train("torch", schedule, optim, mesh)
            if again["losses"] != ref["losses"] or not all(map(torch.equal, again["params"][-1], ref["params"][-1])):
                failures.append(f"{tag}: torch's fully_shard under use_in_torch() changed its results")
            if again["ours"]:
                failures.append(f"{tag}: torch_fully_shard() made fullshard units")
        failures += _differences(tag, got, ref)
        dist.barrier()
    # reshard_after_forward=True: gathered for every forward, kept between micro-batches' backwards
    # (the stage's set_reshard_after_backward(False)); step 0 includes the stage's shape inference.
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
        ref = _train("torch", schedule, "sgd", mesh, reshard_after_forward=True, steps=2)
        with fullshard.use_in_torch():
            got = _train("fullshard", schedule, "sgd", mesh, reshard_after_forward=True, steps=2)
        failures += _differences(f"{schedule}/reshard_after_forward=True rank {rank}", got, ref)
        dist.barrier()
    return failures


@pytest.mark.timeout(180)
def test_schedules_with_fully_shard_match_torch_bitwise() -> None:
    failures = [f for rank in run_ranks(_compare_body, 4, timeout=150) for f in rank]
    assert not failures, "\n".join(failures)


def _refusal_body(rank: int, world: int, schedule: str, bind: bool) -> str:
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh

    import fullshard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    with fullshard.use_in_torch() if bind else contextlib.nullcontext():
        torch.manual_seed(0)
        _, sched = _stages("fullshard", schedule, mesh, [Block() for _ in range(BLOCKS)])
        x, y = torch.randn(MICROBATCHES, WIDTH), torch.randn(MICROBATCHES, WIDTH)
        pp_rank = mesh.get_local_rank("pp")
        last = pp_rank == 0 if schedule in ("ZBV", "DualPipeV") else pp_rank == 1  # V: rank 0 holds the last stage
        try:
            sched.step(*((x,) if pp_rank == 0 else ()), **({"target": y, "losses": []} if last else {}))
        except (NotImplementedError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "schedule, bind, expected",
    [
        # ZBV's and DualPipeV's I actions (backward_input) then W (backward_weight) would drop
        # fullshard's weight gradients.
        ("ZBV", True, "NotImplementedError: torch.distributed.pipelining's split backward"),
        ("DualPipeV", True, "NotImplementedError: torch.distributed.pipelining's split backward"),
        # Without use_in_torch() the stage's REDUCE_GRAD would fail ('NoneType' has no '_state_ctx').
        ("GPipe", False, "RuntimeError: a torch.distributed.pipelining stage"),
        ("Interleaved1F1B", False, "RuntimeError: a torch.distributed.pipelining stage"),
    ],
)
def test_split_backward_and_missing_binding_are_refused_on_every_rank(schedule: str, bind: bool, expected: str) -> None:
    # At 2 pipeline ranks: every rank raises, none waits for a peer that stopped (the timeout).
    messages = run_ranks(_refusal_body, 2, schedule, bind, timeout=60, fresh=True)
    assert all(m.startswith(expected) for m in messages), messages
    assert "use_in_torch()" in messages[0] or "split backward" in messages[0]


class _Schedule:
    """A stand-in for a loaded action-list schedule: its actions only in
    ``pipeline_order_with_comms`` (as ``_load_csv`` leaves them), one overlapped."""

    def __init__(self, weight_only: bool) -> None:
        from torch.distributed.pipelining.schedules import _Action, _ComputationType

        kind = _ComputationType.BACKWARD_WEIGHT if weight_only else _ComputationType.FULL_BACKWARD
        forward = _Action(0, _ComputationType.FORWARD, 1)
        overlapped = _Action(-1, _ComputationType.OVERLAP_F_B, None, (forward, _Action(1, kind, 0)))
        self.pipeline_order: dict = {}
        self.pipeline_order_with_comms = {0: [forward, overlapped, None]}


@pytest.mark.parametrize("weight_only", [True, False])
def test_split_backward_is_found_in_loaded_and_overlapped_actions(weight_only: bool, monkeypatch) -> None:
    import types

    from fullshard.frontend import pipelining

    monkeypatch.setattr(pipelining, "_bound", lambda: False)
    frame = types.SimpleNamespace(
        f_globals={"__name__": pipelining.SCHEDULES_MODULE}, f_locals={"self": _Schedule(weight_only)}, f_back=None
    )
    # The split backward is refused first; a full backward reaches the binding check.
    with pytest.raises(NotImplementedError if weight_only else RuntimeError, match="split backward|use_in_torch"):
        pipelining.check_schedule(frame)
