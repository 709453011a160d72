"""Checkpoints that reshard to another world size, on the sweep's drawn configurations.

A configuration (:class:`~fullshard.jobs.planning.sweep.Config`) gets a :class:`Case` drawn for
it (:func:`draw_case`, from a generator seeded by the configuration's seed and index alone): the
world size that saves, the one that loads, the optimizer (AdamW, SGD with momentum, Adagrad)
and the checkpoint path:

- ``fullshard``: ``fullshard.checkpoint.save`` / ``load``;
- ``dcp``: torch's ``get_state_dict`` + ``dcp.save``, then ``dcp.load`` + ``set_state_dict``;
- ``sharded`` (the FSDP1 wrapper): ``FSDP.state_dict_type(SHARDED_STATE_DICT)`` with
  ``FSDP.optim_state_dict`` through ``dcp.save`` / ``dcp.load``, loaded with
  ``load_state_dict`` and ``FSDP.optim_state_dict_to_load``;
- ``full`` (the FSDP1 wrapper): the same under ``FULL_STATE_DICT`` (rank 0 only, offloaded),
  ``torch.save`` by rank 0, ``torch.load`` by every rank of the loading world.

:func:`save_worker` trains two steps at the saving world size with fullshard and saves;
:func:`load_worker` builds the model afresh at the loading world size (initialized from another
seed), loads, and gathers the full parameters and optimizer state; :func:`compare` says whether
they are the saved ones bit for bit. Both then take one more step, and so does a reference
loaded from the same checkpoint: torch's own FSDP (``fully_shard``, or FSDP1 with
``device_id=torch.device("cpu")``, :func:`~fullshard.jobs.planning.parity.torch_wrap`) through
the same path, or where torch's load fails, an unsharded fp32 model given the saved full state.
"""

from __future__ import annotations

import math
import os
import random
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from fullshard.jobs import launch
from fullshard.jobs.planning import families, parity, sweep_bench
from fullshard.jobs.planning.sweep import Config

OPTIMIZERS = ("adamw", "sgd", "adagrad")
PATHS = ("fullshard", "dcp", "sharded", "full")  # the last two: the FSDP1 wrapper's state dicts
WORLDS, WEIGHTS = (1, 2, 3, 4), (3, 3, 3, 1)  # 4 ranks rarer: this machine has 2 cores
SAVED_STEP = 2

State = tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]  # (parameters, optimizer state) by name


class Case(NamedTuple):
    """What is drawn for one configuration beside it: the world sizes that save and load, the
    optimizer, the checkpoint path (one of :data:`PATHS`)."""

    saved: int
    loaded: int
    optim: str
    path: str

    def describe(self) -> str:
        """E.g. ``2->3 | adagrad | dcp``."""
        return f"{self.saved}->{self.loaded} | {self.optim} | {self.path}"


def draw_case(c: Config) -> Case:
    """``c``'s case, from ``random.Random`` seeded by ``c.seed`` and ``c.index`` alone: the saving
    world size in 1..4 (4 a third as often as each other), the loading one another of them 9
    times in 10, else the same; the optimizer; the path (``sharded`` and ``full`` only for the
    FSDP1 wrapper)."""
    rng = random.Random(f"reshard:{c.seed}:{c.index}")
    saved = rng.choices(WORLDS, WEIGHTS)[0]
    others = [(w, p) for w, p in zip(WORLDS, WEIGHTS) if w != saved]
    loaded = rng.choices([w for w, _ in others], [p for _, p in others])[0] if rng.random() < 0.9 else saved
    optim = rng.choice(OPTIMIZERS)
    path = rng.choice(PATHS if c.api == "fsdp1" else PATHS[:2])
    return Case(saved, loaded, optim, path)


def optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    """The sweep's optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``params``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-3)


class Run(NamedTuple):
    """A built model and what trains it."""

    model: nn.Module
    opt: torch.optim.Optimizer
    example: Any
    loss_fn: Any


def build(c: Config, which: str, optim: str, seed: int) -> Run:
    """``c``'s model initialized from ``seed``, sharded by ``which`` ("fullshard" or "torch"),
    or unsharded ("plain"), with its optimizer."""
    make, example, loss_fn, is_unit = families.parts(c.family, c.shape, c.batch, c.seq)
    torch.manual_seed(seed)
    model = make()
    if which == "fullshard":
        model = sweep_bench.wrap(c, model, is_unit)
    elif which == "torch":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = parity.torch_wrap(c, model, is_unit)
    return Run(model, optimizer(model.parameters(), optim), example, loss_fn)


def batch(c: Config, example: Any, step: int, rank: int) -> Any:
    """Rank ``rank``'s batch of step ``step``, the same for every run."""
    torch.manual_seed(1000 * step + rank)
    return families.random_batch(c.family, example, c.shape.vocab, c.shape.classes)


def train_step(c: Config, run: Run, step: int, rank: int) -> float:
    """One step on rank ``rank``'s batch; its loss."""
    loss = run.loss_fn(run.model, batch(c, run.example, step, rank))
    loss.backward()
    run.opt.step()
    run.opt.zero_grad()
    return float(loss.item())


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return (tree.full_tensor() if hasattr(tree, "full_tensor") else tree).detach().clone()
    return tree


def full_state(run: Run) -> State:
    """The full parameters and optimizer state, by the parameters' names (collective), through
    torch's ``get_state_dict(..., full_state_dict=True)``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(run.model, run.opt, options=StateDictOptions(full_state_dict=True))
    return _copy(msd), _copy(osd["state"])


def _fsdp1(which: str) -> Any:
    if which == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from fullshard import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
    return FSDP


def _where(directory: str, path: str) -> str:
    if path == "fullshard":
        return os.path.join(directory, f"step_{SAVED_STEP:08d}")
    return os.path.join(directory, "full.pt" if path == "full" else path)


def save(c: Config, case: Case, run: Run, directory: str, rank: int) -> None:
    """Save ``run`` into ``directory`` through ``case.path`` (collective)."""
    import torch.distributed.checkpoint as dcp

    from fullshard import checkpoint

    if case.path == "fullshard":
        checkpoint.save(directory, SAVED_STEP, run.model, run.opt)
        return
    if case.path == "dcp":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(run.model, run.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=_where(directory, "dcp"))
        return
    from fullshard import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

    FSDP = _fsdp1("fullshard")
    if case.path == "sharded":
        with FSDP.state_dict_type(run.model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": run.model.state_dict(), "optim": FSDP.optim_state_dict(run.model, run.opt)}
        dcp.save(state, checkpoint_id=_where(directory, "sharded"))
        return
    full = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_full = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(run.model, StateDictType.FULL_STATE_DICT, full, optim_full):
        state = {"model": run.model.state_dict(), "optim": FSDP.optim_state_dict(run.model, run.opt)}
    if rank == 0:
        torch.save(state, _where(directory, "full"))


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` state to load into: one step of zero gradients at learning rate 0."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def load(c: Config, case: Case, run: Run, directory: str, which: str) -> None:
    """Load ``directory``'s checkpoint into ``run`` (sharded by ``which``) through ``case.path``
    (collective). torch's own FSDP reads a ``fullshard`` checkpoint as the ``dcp`` path does."""
    import torch.distributed.checkpoint as dcp

    # torch's FSDP1 state holds ShardedTensors, which the default planner's flattening loses
    torch_fsdp1 = which == "torch" and c.api == "fsdp1"
    planner = dcp.DefaultLoadPlanner(flatten_sharded_tensors=False) if torch_fsdp1 else None
    where = _where(directory, case.path)
    if case.path == "fullshard" and which == "fullshard":
        from fullshard import checkpoint

        checkpoint.load(where, run.model, run.opt)
    elif case.path in ("fullshard", "dcp"):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(run.model, run.opt)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=where, planner=planner)
        set_state_dict(run.model, run.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    elif case.path == "sharded":
        from torch.distributed.fsdp import StateDictType

        FSDP = _fsdp1(which)
        _init_optimizer_state(run.opt)
        with FSDP.state_dict_type(run.model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": run.model.state_dict(), "optim": FSDP.optim_state_dict(run.model, run.opt)}
            dcp.load(state, checkpoint_id=where, planner=planner)
            run.model.load_state_dict(state["model"])
            run.opt.load_state_dict(FSDP.optim_state_dict_to_load(run.model, run.opt, state["optim"]))
    else:
        from torch.distributed.fsdp import StateDictType

        FSDP = _fsdp1(which)
        saved = torch.load(where, weights_only=False)
        with FSDP.state_dict_type(run.model, StateDictType.FULL_STATE_DICT):
            run.model.load_state_dict(saved["model"])
            run.opt.load_state_dict(FSDP.optim_state_dict_to_load(run.model, run.opt, saved["optim"]))


def _trained(c: Config, case: Case, which: str, rank: int) -> Run:
    run = build(c, which, case.optim, seed=0)
    for step in range(SAVED_STEP):
        train_step(c, run, step, rank)
    return run


def save_rank(c: Config, case: Case, directory: str, rank: int) -> State:
    """On one rank of a started process group of ``case.saved`` ranks: fullshard trains ``c``
    two steps and saves into ``directory``; the full state saved (every rank).

    Raises:
        RuntimeError: fullshard's training failed, and torch's too (said so; else fullshard's error).
    """
    try:
        run = _trained(c, case, "fullshard", rank)
    except Exception as err:  # the model itself may fail (a kernel's limits): torch's run decides
        try:
            _trained(c, case, "torch", rank)
        except Exception as theirs_too:
            raise RuntimeError(f"fails on torch's FSDP too: {type(theirs_too).__name__}: {theirs_too}") from err
        raise
    state = full_state(run)
    save(c, case, run, directory, rank)
    return state


class Loaded(NamedTuple):
    """What one implementation did at the loading world size: the full state right after the
    load, the full parameters after one more step, and that step's loss on this rank."""

    state: State
    after: dict[str, torch.Tensor]
    loss: float


def _load_and_step(c: Config, case: Case, directory: str, which: str, rank: int) -> Loaded:
    run = build(c, which, case.optim, seed=7)  # initialized otherwise: the load must replace it all
    load(c, case, run, directory, which)
    state = full_state(run)
    loss = train_step(c, run, SAVED_STEP, rank)
    return Loaded(state, full_state(run)[0], loss)


def load_rank(c: Config, case: Case, directory: str, rank: int, torch_too: bool = True) -> tuple[Loaded, Loaded | str]:
    """On one rank of a started process group of ``case.loaded`` ranks: fullshard loads the
    checkpoint in ``directory`` and steps, then (``torch_too``) torch's FSDP does the same, or
    where its load fails, the line saying why (``"not run"`` without ``torch_too``).

    Raises:
        RuntimeError: fullshard's load or step failed and torch's too (said so; else fullshard's error).
    """
    try:
        ours = _load_and_step(c, case, directory, "fullshard", rank)
    except Exception as err:  # does torch's FSDP read this checkpoint through the same path?
        if not torch_too:
            raise
        try:
            _load_and_step(c, case, directory, "torch", rank)
        except Exception as theirs_too:
            raise RuntimeError(f"fails on torch's FSDP too: {type(theirs_too).__name__}: {theirs_too}") from err
        raise
    if not torch_too:
        return ours, "not run"
    try:
        theirs: Loaded | str = _load_and_step(c, case, directory, "torch", rank)
    except Exception as err:
        theirs = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    return ours, theirs


def save_worker(c: Config, case: Case, directory: str) -> State:
    """:func:`save_rank` in a process started by :func:`fullshard.jobs.launch.launch`."""
    launch.init_process_group()
    warnings.simplefilter("ignore")  # torch's deprecation warnings, once per rank and call
    try:
        return save_rank(c, case, directory, launch.rank())
    finally:
        launch.destroy_process_group()


def load_worker(c: Config, case: Case, directory: str) -> tuple[Loaded, Loaded | str]:
    """:func:`load_rank` in a process started by :func:`fullshard.jobs.launch.launch`."""
    launch.init_process_group()
    warnings.simplefilter("ignore")
    try:
        return load_rank(c, case, directory, launch.rank())
    finally:
        launch.destroy_process_group()


def reference_step(c: Config, case: Case, saved: State) -> Loaded:
    """One process, fp32, unsharded: the saved full state loaded, one step on the mean of the
    loading world's ranks' losses (what data parallelism's averaged gradient descends)."""
    run = build(c, "plain", case.optim, seed=7)
    run.model.load_state_dict(saved[0], strict=False)
    names = [n for n, _ in run.model.named_parameters()]
    template = run.opt.state_dict()
    run.opt.load_state_dict(
        {
            "state": {i: saved[1][n] for i, n in enumerate(names) if n in saved[1]},
            "param_groups": template["param_groups"],
        }
    )
    example, loss_fn = run.example, run.loss_fn
    losses = [loss_fn(run.model, batch(c, example, SAVED_STEP, r)) for r in range(case.loaded)]
    (sum(losses) / case.loaded).backward()
    run.opt.step()
    after = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    return Loaded(saved, after, float(losses[0].item()))


class Result(NamedTuple):
    """One row: the largest absolute difference between the saved full state and the loaded
    one, for the parameters and for each kind of optimizer state (NaN: a name or kind missing),
    the reference the next step is compared with ("torch" or "unsharded: why"), and that step's
    update error ``|d_ours - d_ref| / |d_ref|`` (all parameters as one vector) and relative loss
    error; whether torch's FSDP loaded the saved state bit for bit too."""

    params: float
    optim: dict[str, float]
    reference: str
    update_error: float
    loss_error: float
    torch_load: bool | None = None  # torch's FSDP loaded the same state bit for bit (None: it failed)

    @property
    def bitwise(self) -> bool:
        """The parameters and every kind of optimizer state loaded bit for bit."""
        return self.params == 0.0 and all(v == 0.0 for v in self.optim.values())


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.nan
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def state_differences(saved: State, loaded: State) -> tuple[float, dict[str, float]]:
    """The largest absolute difference of the parameters, and of each optimizer-state kind
    (``exp_avg``, ``step``, ``momentum_buffer``, ``sum``, ...), between two full states; NaN
    where a name or kind is missing on one side, or a shape or dtype differs."""
    params = max([_max_diff(v, loaded[0][k]) if k in loaded[0] else math.nan for k, v in saved[0].items()] or [0.0])
    if set(saved[0]) != set(loaded[0]):
        params = math.nan
    kinds: dict[str, float] = {}
    for name in set(saved[1]) | set(loaded[1]):
        mine, theirs = saved[1].get(name, {}), loaded[1].get(name, {})
        for kind in set(mine) | set(theirs):
            d = _max_diff(mine[kind], theirs[kind]) if kind in mine and kind in theirs else math.nan
            kinds[kind] = d if math.isnan(d) or math.isnan(kinds.get(kind, 0.0)) else max(d, kinds.get(kind, 0.0))
    return params, kinds


def compare(c: Config, case: Case, saved: State, ours: Loaded, theirs: Loaded | str) -> Result:
    """The :class:`Result` of a row from the saved full state and the loads."""
    params, kinds = state_differences(saved, ours.state)
    torch_load = None
    if isinstance(theirs, str):
        ref, label = reference_step(c, case, saved), f"unsharded (torch's load: {theirs})"
    else:
        ref, label = theirs, "torch"
        theirs_params, theirs_kinds = state_differences(saved, theirs.state)
        torch_load = theirs_params == 0.0 and all(v == 0.0 for v in theirs_kinds.values())
    start = ours.state[0]
    names = [n for n in ref.after if n in ours.after and n in start]

    def norm(pairs: Any) -> float:
        return math.sqrt(sum(float((a.double() - b.double()).pow(2).sum()) for a, b in pairs))

    moved = norm((ref.after[n], start[n]) for n in names)
    error = norm((ours.after[n], ref.after[n]) for n in names) / max(moved, 1e-30)
    if not names or set(ref.after) - set(ours.after):  # (ours may hold tied weights under both names)
        error = math.nan
    return Result(params, kinds, label, error, abs(ours.loss - ref.loss) / max(abs(ref.loss), 1e-12), torch_load)


def summary(results: list[Result], failures: list[str]) -> list[str]:
    """How many rows loaded bit for bit, the next step's error distribution against torch and
    against the unsharded reference, and the failures with their first line."""
    lines = [
        f"Loaded bit for bit (parameters and every optimizer state): {sum(r.bitwise for r in results)} of "
        f"{len(results)}; by torch's FSDP from the same checkpoint: {sum(r.torch_load is True for r in results)} "
        f"of {sum(r.torch_load is not None for r in results)} it read."
    ]
    for label in ("torch", "unsharded"):
        errs = sorted(r.update_error for r in results if r.reference.startswith(label))
        if errs:
            zero = sum(e == 0.0 for e in errs)
            lines.append(
                f"Next step against {label}'s: {len(errs)} rows, update error bitwise in {zero}, "
                f"median {errs[len(errs) // 2]:.1e}, max {errs[-1]:.1e}; "
                f"loss error max {max(r.loss_error for r in results if r.reference.startswith(label)):.1e}."
            )
    lines.append(f"Failures: {len(failures)}" + (": " + "; ".join(failures) if failures else "."))
    return lines
