"""Bad input found by an audit (2026-11-28): each ends in a clear error naming the argument (or
the rank) and the fix, on every rank, without a hang, and without losing a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from torch import nn

FRONTS = ("fsdp1", "fsdp2")


def _wrapped(front: str, width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear(8, width), ReLU, Linear(width, 8), each Linear a unit, with Adam (no step yet)."""
    from fullshard import FSDP, fully_shard

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 8))
    if front == "fsdp1":
        model: nn.Module = FSDP(net, auto_wrap_policy={nn.Linear})
    else:
        fully_shard(net[0])
        fully_shard(net[2])
        model = fully_shard(net)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _trained(front: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _wrapped(front)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def load_into_other_model_body(rank: int, world: int, root: str) -> list[str]:
    """A resume before the first forward whose model differs on rank 1 only (a rank-dependent
    width): rank 1's check of the checkpoint's shapes fails, rank 0's passes. Rank 0 went on
    into DCP's read (its collectives) while rank 1 waited in the error exchange: both hung."""
    from fullshard import checkpoint

    lines = []
    for front in FRONTS:
        model, opt = _trained(front)
        saved = checkpoint.save(os.path.join(root, front), 1, model, opt)
        other, other_opt = _wrapped(front, width=8 if rank == 0 else 6)
        with pytest.raises(checkpoint.CheckpointError) as failed:
            checkpoint.load(saved, other, other_opt)
        assert not other_opt.state  # the state created to load into is gone again
        lines.append(str(failed.value))
    return lines


@pytest.mark.timeout(90)
def test_a_load_that_fails_its_checks_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    lines = run_ranks(load_into_other_model_body, 2, str(tmp_path), timeout=60)
    assert lines[0] == lines[1], lines
    for front, line in zip(FRONTS, lines[0]):
        want = f"checkpoint load from {tmp_path / front / 'step_00000001'} failed on rank 1: shape mismatch for "
        assert line.startswith(want) and "checkpoint (8, 8), model (6, 8)" in line, line


def save_arguments_body(rank: int, world: int, root: str) -> list[str]:
    """``checkpoint.save``'s step and keep, checked on every rank's values together before
    anything is written: a step of another type, a negative step (``step_-0000001``, which no
    resume ever looked at), a keep of another type, and ranks that save different steps (each
    published a checkpoint missing the other's shards and reported success; with keep=1 each
    pruned the last good checkpoint too). The good checkpoint stays loadable."""
    from fullshard import checkpoint

    model, opt = _trained("fsdp2")
    good = checkpoint.save(root, 1, model, opt)
    seen = []
    for kwargs, exc in (
        (dict(step="2"), TypeError),
        (dict(step=2.0), TypeError),
        (dict(step=True), TypeError),
        (dict(step=-1), ValueError),
        (dict(step=2, keep="1"), TypeError),
        (dict(step=2 + rank, keep=1), ValueError),
    ):
        with pytest.raises(exc) as failed:
            checkpoint.save(root, model=model, optimizer=opt, **kwargs)
        seen.append(str(failed.value))
    assert sorted(p.name for p in Path(root).iterdir() if not p.name.endswith(".tmp")) == [good.name]
    checkpoint.load(root, model, opt)
    return seen


@pytest.mark.timeout(90)
def test_save_checks_step_and_keep_on_every_rank(tmp_path: Path) -> None:
    lines = run_ranks(save_arguments_body, 2, str(tmp_path), timeout=60)
    assert lines[0] == lines[1], lines
    assert lines[0] == [
        "checkpoint.save: step must be an int (the training step, which names the checkpoint's directory "
        "step_00000120), got str '2'",
        "checkpoint.save: step must be an int (the training step, which names the checkpoint's directory "
        "step_00000120), got float 2.0",
        "checkpoint.save: step must be an int (the training step, which names the checkpoint's directory "
        "step_00000120), got bool True",
        "checkpoint.save: step must be at least 0, got -1",
        "checkpoint.save: keep must be an int of at least 1 or None (None keeps every checkpoint), got str '1'",
        "checkpoint.save: every rank must save the same step, got step 2 on rank 0, step 3 on rank 1 "
        "(a step counted on each rank?)",
    ], lines[0]


def stray_optimizer_body(rank: int, world: int, root: str) -> list[str]:
    """An optimizer over parameters that are not the model's (one built before wrapping, or for
    another model): save and load named it for the FSDP1 wrapper; for fully_shard both said
    ``KeyError: 0``."""
    from fullshard import checkpoint

    seen = []
    for front in FRONTS:
        model, opt = _trained(front)
        saved = checkpoint.save(os.path.join(root, front), 1, model, opt)
        _, other_opt = _trained(front)
        for action in (
            lambda: checkpoint.save(os.path.join(root, front), 2, model, other_opt),
            lambda: checkpoint.load(saved, model, other_opt),
        ):
            with pytest.raises(checkpoint.CheckpointError) as failed:
                action()
            seen.append(str(failed.value).split(" failed on ")[1])
    return seen


@pytest.mark.timeout(90)
def test_an_optimizer_over_other_parameters_is_named(tmp_path: Path) -> None:
    lines = run_ranks(stray_optimizer_body, 2, str(tmp_path), timeout=60)
    want = (
        "ranks 0 and 1: ValueError: the optimizer holds 4 parameter(s) that are not the model's, so its state "
        "dict cannot name them; build the optimizer on model.parameters() after wrapping (give other parameters "
        "an optimizer of their own)"
    )
    assert lines == [[want] * 4] * 2, lines


def _raised(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def arguments_body(rank: int, world: int) -> list[str]:
    """Arguments of the wrong kind that were accepted (a module in ignored_params was silently
    sharded; cast_forward_inputs='no' cast), failed inside Python (``Boolean value of Tensor ...
    is ambiguous``), only at the first forward (``Invalid device string: 'fp16'``) or named
    FSDP1's MixedPrecision for fully_shard's policy: each refused at once, naming the argument
    and the fix."""
    from fullshard import FSDP, MixedPrecisionPolicy, fully_shard

    def net() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    n = net()
    cases = [
        lambda: fully_shard(n, ignored_params=n[0].weight),
        lambda: fully_shard(n, ignored_params={n[0]}),
        lambda: FSDP(n, ignored_states=n[0].weight),
        lambda: MixedPrecisionPolicy(output_dtype="fp16"),  # type: ignore[arg-type]
        lambda: MixedPrecisionPolicy(param_dtype=torch.int8),
        lambda: fully_shard(net(), mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(reduce_dtype=torch.int32)),
        lambda: MixedPrecisionPolicy(cast_forward_inputs="no"),  # type: ignore[arg-type]
    ]
    return [_raised(fn) for fn in cases]


@pytest.mark.timeout(90)
def test_arguments_of_the_wrong_kind_are_refused_at_once() -> None:
    lines = run_ranks(arguments_body, 2, timeout=60)
    assert lines[0] == lines[1], lines
    floats = "use torch.bfloat16, torch.float16 or torch.float32 (or None to keep the original)"
    assert lines[0] == [
        "TypeError: fully_shard: ignored_params must be an iterable of parameters, got one Parameter; pass "
        "ignored_params={param}",
        "TypeError: fully_shard: ignored_params must hold parameters, got Linear; pass its parameters: "
        "set(module.parameters())",
        "TypeError: FullyShardedDataParallel: ignored_states must be an iterable of modules or parameters, got one "
        "Parameter; pass ignored_states=[...]",
        f"ValueError: MixedPrecisionPolicy.output_dtype='fp16' is not a floating-point torch.dtype; {floats}",
        f"ValueError: MixedPrecisionPolicy.param_dtype=torch.int8 is not a floating-point torch.dtype; {floats}",
        f"ValueError: MixedPrecisionPolicy.reduce_dtype=torch.int32 is not a floating-point torch.dtype; {floats}",
        "TypeError: MixedPrecisionPolicy.cast_forward_inputs must be True or False, got 'no'",
    ], lines[0]
