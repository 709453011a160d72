"""Evaluation under ``torch.inference_mode()`` between training steps, on both front ends.

Lightning's validation loop (and its sanity check before training) runs under
``torch.inference_mode()`` by default on NCCL, and many evaluation loops do the same. A tensor
made there is an inference tensor for good, and fullshard keeps the memory it gathers into
(the buffer pool, the units' flat buffers, the mixed-precision copies) for the next step's
in-place all-gather: the first training step after such an evaluation failed ("Inplace update
to inference tensor outside InferenceMode"). Each case trains a TinyLM (per-block units and a
root, AdamW, 2 ranks) and evaluates it before the first step and after each one, once under
``torch.inference_mode()`` and once under ``torch.no_grad()``: evaluation outputs, losses and
final parameters must be equal bit for bit.

torch 2.13's own FSDP (CPU, 2 ranks) passes the evaluations after training but not one before
the first step (its ``fully_shard`` with or without bf16 and ``reshard_after_forward=False``,
and its FSDP1, each fail at the first training step), nor ``state_dict()`` of a ``fully_shard``
model under inference mode (a view of a DTensor there raises "Cannot set version_counter for
inference tensor").

The wrapper's ``summon_full_params``, its ``state_dict()`` and torch's ``get_model_state_dict``
on it, each under inference mode between steps, broke the next step the same way.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from models import TinyBlock, TinyLM, local, tokens


def _build(front: str, setting: str) -> torch.nn.Module:
    import fullshard
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TinyLM(layers=3)
    if front == "fsdp1":
        kwargs: dict = {
            "mixed": {"mixed_precision": fullshard.MixedPrecision(param_dtype=torch.bfloat16)},
            "kept": {"sharding_strategy": fullshard.ShardingStrategy.SHARD_GRAD_OP},
            "default": {"forward_prefetch": True},
        }[setting]
        return fullshard.FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TinyBlock}), use_orig_params=True, **kwargs)
    kwargs = {
        "mixed": {"mp_policy": fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        "kept": {"reshard_after_forward": False},
        "default": {},
    }[setting]
    for layer in model.layers:
        fullshard.fully_shard(layer, **kwargs)
    if setting == "mixed":  # the root's output cast back, in the caller's mode
        kwargs = {"mp_policy": fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)}
    return fullshard.fully_shard(model, **kwargs)


def _train(rank: int, world: int, front: str, setting: str, mode: str) -> tuple[list, list[float], dict]:
    from fullshard.frontend.summon import summon_full_params

    model = _build(front, setting)
    inner = model.module if front == "fsdp1" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    evaluations, losses = [], []
    evaluation = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    for step in range(4):
        x = local(tokens(step, 4), rank, world)
        model.eval()
        with evaluation():
            y = model(x)
            assert y.is_inference() == (mode == "inference_mode")
            evaluations.append(y.float())
        model.train()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with summon_full_params(model):
        full = {n: p.detach().clone() for n, p in inner.named_parameters()}
    return evaluations, losses, full


def _both_modes(rank: int, world: int, front: str, setting: str) -> list[bool]:
    evaluated, losses, full = _train(rank, world, front, setting, "inference_mode")
    ref_evaluated, ref_losses, ref_full = _train(rank, world, front, setting, "no_grad")
    return [
        len(evaluated) == 4 and all(torch.equal(a, b) for a, b in zip(evaluated, ref_evaluated)),
        losses == ref_losses,
        full.keys() == ref_full.keys() and all(torch.equal(full[n], ref_full[n]) for n in full),
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("front", ["fully_shard", "fsdp1"])
@pytest.mark.parametrize("setting", ["default", "mixed", "kept"])
def test_evaluation_under_inference_mode_changes_nothing(front: str, setting: str) -> None:
    for same in run_ranks(_both_modes, 2, front, setting, timeout=220):
        assert same == [True, True, True]


def _state_dict_round_trip(rank: int, world: int) -> list[bool]:
    """fully_shard: ``state_dict()`` and ``load_state_dict`` under inference mode give and take
    what they do outside it, and training goes on unchanged after both."""
    model = _build("fully_shard", "default")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(local(tokens(0, 4), rank, world)).pow(2).mean().backward()
    opt.step()
    outside = {k: v.full_tensor() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        inside = model.state_dict()
        model.load_state_dict(inside)
    inside = {k: v.full_tensor() for k, v in inside.items()}
    loss = model(local(tokens(1, 4), rank, world)).pow(2).mean()
    loss.backward()
    opt.step()
    return [
        inside.keys() == outside.keys() and all(torch.equal(inside[k], outside[k]) for k in inside),
        not any(v.is_inference() for v in inside.values()),
        loss.item() > 0,
    ]


@pytest.mark.timeout(120)
def test_fully_shard_state_dict_under_inference_mode() -> None:
    for same in run_ranks(_state_dict_round_trip, 2, timeout=100):
        assert same == [True, True, True]


def _wrapper_reads(rank: int, world: int, mode: str) -> tuple[list, list[float]]:
    """The wrapper: its full parameters and state dicts read between steps under ``mode``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fullshard.frontend.summon import summon_full_params

    model = _build("fsdp1", "default")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reads, losses = [], []
    for step in range(3):
        with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
            with summon_full_params(model, writeback=False):
                reads.append([p.clone() for p in model.parameters()])
            reads.append(list(model.state_dict().values()))
            reads.append(list(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).values()))
        loss = model(local(tokens(step, 4), rank, world)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return reads, losses


def _wrapper_reads_both(rank: int, world: int) -> list[bool]:
    reads, losses = _wrapper_reads(rank, world, "inference_mode")
    ref_reads, ref_losses = _wrapper_reads(rank, world, "no_grad")
    same = [len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(reads, ref_reads)]
    return [len(reads) == 9 and all(same), losses == ref_losses]


@pytest.mark.timeout(120)
def test_wrapper_full_parameters_and_state_dicts_under_inference_mode() -> None:
    for same in run_ranks(_wrapper_reads_both, 2, timeout=100):
        assert same == [True, True]


def _checkpointed(rank: int, world: int, tmp: str, front: str, mode: str) -> tuple[list[float], dict]:
    """``fullshard.checkpoint.save`` before the first step and between steps, and ``load`` of
    the last one, each under ``mode``; the losses of the steps around them and the final
    parameters."""
    import fullshard.checkpoint
    from fullshard.frontend.summon import summon_full_params

    model = _build(front, "default")
    inner = model.module if front == "fsdp1" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = f"{tmp}/{front}_{mode}"
    evaluation = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    losses = []
    for step in range(4):
        with evaluation():
            if step < 3:
                fullshard.checkpoint.save(root, step, model, opt)
            else:
                fullshard.checkpoint.load(root, model, opt)  # step 2's, taken before step 2
        loss = model(local(tokens(step, 4), rank, world)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with summon_full_params(model):
        return losses, {n: p.detach().clone() for n, p in inner.named_parameters()}


def _checkpointed_both(rank: int, world: int, tmp: str) -> list[bool]:
    same = []
    for front in ("fully_shard", "fsdp1"):
        losses, full = _checkpointed(rank, world, tmp, front, "inference_mode")
        ref_losses, ref_full = _checkpointed(rank, world, tmp, front, "no_grad")
        same.append(losses == ref_losses and all(torch.equal(full[n], ref_full[n]) for n in ref_full))
    return same


@pytest.mark.timeout(120)
def test_checkpoint_save_and_load_under_inference_mode(tmp_path) -> None:
    """Before the first step ``save`` creates the optimizer's state (as torch's
    ``get_optimizer_state_dict`` does): under inference mode it was made of inference tensors
    and the first ``optimizer.step()`` failed ("Inplace update to inference tensor outside
    InferenceMode")."""
    for same in run_ranks(_checkpointed_both, 2, str(tmp_path), timeout=100):
        assert same == [True, True]
