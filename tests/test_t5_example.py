"""pytorch/examples' FSDP (T5) program on fullshard's FSDP1 wrapper and on torch's, same process group.

The example (distributed/FSDP/T5_training.py with its policies, train_utils and
checkpoint_handler) wraps ``T5ForConditionalGeneration`` with ``transformer_auto_wrap_policy``
over ``T5Block`` (the shared embedding stays in the root unit, used by the encoder, the decoder
and the tied output head), ``MixedPrecision`` with every dtype bfloat16 (its ``bfSixteen``),
``FULL_SHARD`` and ``limit_all_gathers=True``; trains with AdamW and
``StepLR`` with dropout on, validates under ``no_grad``, and saves in three ways: a full state
dict on rank 0 (``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``), the legacy
``FSDP.full_optim_state_dict``, and a sharded save of the model and ``FSDP.optim_state_dict``
with ``torch.distributed.checkpoint``'s ``save_state_dict``, read back by its
``load_model_sharded`` (``dist_cp.load_state_dict`` into a SHARDED state dict, then
``model.load_state_dict``). Its activation checkpointing option (off by default: "Enabling this
causes pytorch/examples#1210") fails the same way on both engines with transformers 5.24: T5's
blocks save 56 tensors in forward and 52 in recomputation (``CheckpointError``).

Here the same calls run on a tiny T5 (the example's model is t5-base on GPUs) with torch's FSDP1
given ``device_id=torch.device("cpu")`` (its CPU requirement) and ``offload_to_cpu=False`` for its
full state dict (torch's FSDP1 crashes the process with it on CPU; fullshard takes the example's
``True``). At 2 ranks the losses of each step (and of validation), the full state dict after
training and the full optimizer state are bitwise torch's; the sharded checkpoint loads into a fresh fullshard model
that then takes the same next step as the model that wrote it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from dist import run_ranks

pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _tiny_t5(seed: int) -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=48,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        dropout_rate=0.1,  # the example trains with T5's dropout on
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def _wrapped(kind: str, seed: int = 0) -> tuple[Any, Any, Any]:
    """The example's model, its FSDP wrapping (torch's FSDP1 or fullshard's), AdamW and StepLR."""
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.t5.modeling_t5 import T5Block

    import fullshard

    fsdp = tfsdp.FullyShardedDataParallel if kind == "torch" else fullshard.FullyShardedDataParallel
    bf_sixteen = tfsdp.MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, buffer_dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fsdp(
            _tiny_t5(seed),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
            mixed_precision=bf_sixteen,
            sharding_strategy=tfsdp.ShardingStrategy.FULL_SHARD,
            device_id=torch.device("cpu"),
            limit_all_gathers=True,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.85)


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    source = torch.randint(1, 48, (2, 7), generator=g)
    mask = torch.ones_like(source)
    mask[1, 5:] = 0  # padding at the end of one source
    return {"input_ids": source, "attention_mask": mask, "labels": torch.randint(1, 48, (2, 5), generator=g)}


def _train_and_validate(model: Any, optimizer: Any, scheduler: Any, rank: int, steps: range) -> list[float]:
    """The example's train() and validation() for one epoch each, then scheduler.step()."""
    losses = []
    model.train()
    torch.manual_seed(77 + rank)  # dropout: the same stream under both engines
    for step in steps:
        optimizer.zero_grad()
        loss = model(**_batch(step, rank))["loss"]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        losses.append(model(**_batch(99, rank))["loss"].item())
    scheduler.step()
    return losses


def _full_state(kind: str, model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    from fullshard import FSDP

    # the example's policy; torch's FSDP1 crashes the process with offload_to_cpu=True on CPU
    policy = FullStateDictConfig(offload_to_cpu=kind != "torch", rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
        return {k: v.clone() for k, v in model.state_dict().items()}


def t5_body(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType

    from fullshard import FSDP

    out: dict[str, Any] = {}
    models = {}
    for kind in ("torch", "fullshard"):
        model, optimizer, scheduler = _wrapped(kind)
        out[f"{kind} losses"] = _train_and_validate(model, optimizer, scheduler, rank, range(2))
        out[f"{kind} lr"] = scheduler.get_last_lr()
        out[f"{kind} state"] = _full_state(kind, model)
        cls = TorchFSDP if kind == "torch" else FSDP
        optim_state = cls.full_optim_state_dict(model, optimizer)  # rank 0 only
        out[f"{kind} optim"] = {
            name: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for name, s in optim_state.get("state", {}).items()
        }
        # the names in each group as a set: torch lists them in its FlatParameters' order (the root
        # unit's first), fullshard in the model's; each is loaded by name
        out[f"{kind} groups"] = [{**g, "params": set(g["params"])} for g in optim_state.get("param_groups", [])]
        models[kind] = (model, optimizer, scheduler)

    # save_model_and_optimizer_sharded, then load_model_sharded into a fresh model (and the optimizer)
    model, optimizer, scheduler = models["fullshard"]
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # save_state_dict is deprecated; the example calls it
            dist_cp.save_state_dict(
                state_dict=state, storage_writer=dist_cp.FileSystemWriter(tmp), planner=DefaultSavePlanner()
            )
    fresh, fresh_opt, fresh_sched = _wrapped("fullshard", seed=1)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        checkpoint = {"model": fresh.state_dict()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist_cp.load_state_dict(state_dict=checkpoint, storage_reader=dist_cp.FileSystemReader(tmp))
        fresh.load_state_dict(checkpoint["model"])
        # the optimizer, as torch documents for FSDP1 (the example itself reloads the model only)
        loaded = load_sharded_optimizer_state_dict(checkpoint["model"], "optim", dist_cp.FileSystemReader(tmp))
        fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, loaded["optim"]))
    fresh_sched.load_state_dict(scheduler.state_dict())
    out["writer next"] = _train_and_validate(model, optimizer, scheduler, rank, range(2, 3))
    out["reader next"] = _train_and_validate(fresh, fresh_opt, fresh_sched, rank, range(2, 3))
    out["writer state"] = _full_state("fullshard", model)
    out["reader state"] = _full_state("fullshard", fresh)
    return out


@pytest.mark.timeout(240)
def test_pytorch_examples_t5_program_matches_torch_fsdp1(tmp_path: Any) -> None:
    results = run_ranks(t5_body, 2, str(tmp_path), timeout=220)
    for rank, out in enumerate(results):
        assert out["torch losses"] == out["fullshard losses"], (rank, out["torch losses"], out["fullshard losses"])
        assert out["torch lr"] == out["fullshard lr"]
        assert out["writer next"] == out["reader next"], rank
    r0 = results[0]
    assert len(r0["fullshard losses"]) == 3 and all(3.0 < x < 5.0 for x in r0["fullshard losses"]), r0  # ln(48) = 3.9
    for name in ("fullshard state", "writer state", "reader state"):
        assert results[1][name] == {}, name  # rank0_only (torch's, without offload_to_cpu, fills every rank)
    assert r0["torch state"].keys() == r0["fullshard state"].keys()
    for key, value in r0["torch state"].items():
        assert torch.equal(value, r0["fullshard state"][key]), key
        assert r0["fullshard state"][key].device.type == "cpu"
    assert r0["writer state"].keys() == r0["reader state"].keys()
    assert all(torch.equal(v, r0["reader state"][k]) for k, v in r0["writer state"].items())
    assert not all(torch.equal(v, r0["fullshard state"][k]) for k, v in r0["writer state"].items())  # it trained
    torch_optim, ours = r0["torch optim"], r0["fullshard optim"]
    assert torch_optim.keys() == ours.keys() and len(ours) == 47 and results[1]["fullshard optim"] == {}
    for name, a in torch_optim.items():
        assert a.keys() == ours[name].keys(), name
        assert all(torch.equal(a[k], ours[name][k]) if torch.is_tensor(a[k]) else a[k] == ours[name][k] for k in a), (
            name
        )
    assert r0["torch groups"] == r0["fullshard groups"]
