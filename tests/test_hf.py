"""Hugging Face transformers models under fullshard, wrapped by layer class name."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import local
from plan_jobs import check_plan_auto

from fullshard.engine.hooks import fsdp_state

pytest.importorskip("transformers")


def hf_parity_body(rank: int, world: int, config: str) -> str:
    from fullshard.jobs.train.hf import HF_CONFIGS, CausalLMLogits, wrap_hf

    build, layer = HF_CONFIGS[config]
    torch.manual_seed(0)
    ref = CausalLMLogits(build())
    initial = copy.deepcopy(ref.state_dict())
    model = wrap_hf(copy.deepcopy(ref), [layer])
    assert len(model.fsdp_modules(model)) == 5  # root + 4 decoder layers
    if config == "gpt2-tiny":  # the tied embedding/output weight stays tied, in the root unit
        assert model.module.model.lm_head.weight is model.module.model.transformer.wte.weight
    # SGD with momentum: exact about gradient scale. (AdamW turns the near-zero gradients of
    # rarely seen token embeddings into lr-sized steps, so summation-order noise shows at 1e-5.)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randint(0, 256, (4 * world, 16), generator=g)
        y = torch.randint(0, 256, (4 * world, 16), generator=g)
        loss = torch.nn.functional.cross_entropy(
            model(local(x, rank, world)).flatten(0, 1), local(y, rank, world).flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    full = model.state_dict()
    want = ref.state_dict()
    assert list(full) == list(want)
    for k, v in want.items():
        assert ((full[k] - v).norm() / v.norm()).item() <= 1e-5, k
    moved = sum(not torch.equal(v, initial[k]) for k, v in want.items())
    assert moved > len(want) // 2, (moved, len(want))  # the comparison is after real training
    with pytest.raises(ValueError, match="match no module of GPT2LMHeadModel|match no module of LlamaForCausalLM"):
        wrap_hf(build(), ["NotALayer"])
    return config


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", ["gpt2-tiny", "llama-tiny"])
def test_hf_model_parity(config: str) -> None:
    assert run_ranks(hf_parity_body, 2, config, timeout=280)[0] == config


@pytest.mark.timeout(300)
def test_train_hf_job(tmp_path: Path) -> None:
    import json

    metrics = tmp_path / "m.jsonl"
    cmd = [
        str(Path(sys.executable).parent / "fullshard"),
        "train",
        "hf",
        "--config",
        "gpt2-tiny",
        "--nproc",
        "2",
        "--steps",
        "30",
        "--seq-len",
        "64",
        "--batch-size",
        "8",
        "--log-interval",
        "15",
        "--metrics-file",
        str(metrics),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["val_loss"] < records[0]["val_loss"] < 5.6
    bad_cmd = [*cmd[:-2], "--wrap-cls", "NotALayer"]
    bad_cmd[bad_cmd.index("--nproc") + 1] = "1"  # the worker fails building the model: one is enough
    bad = subprocess.run(bad_cmd, capture_output=True, text=True, timeout=280)
    assert bad.returncode == 1 and "match no module" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.timeout(300)
def test_hf_job_plan_auto(tmp_path: Path) -> None:
    """``--plan auto`` plans the transformers model too (its meta trace answers the mask code's
    packed-sequence check), prints the plan and trains as planned (a budget nothing fits fails
    in the same code as the GPT job's, tested there)."""
    check_plan_auto(["hf", "--config", "llama-tiny"], tmp_path, nothing_fits=False)


def hf_checkpointing_body(rank: int, world: int) -> list[float]:
    from fullshard.frontend.activation_checkpointing import CheckpointWrapper
    from fullshard.jobs.train.hf import HFJobConfig, hf_model, shard_hf

    make, layers = hf_model("llama-tiny")
    losses = []
    for ac in (False, True):
        torch.manual_seed(0)
        model = shard_hf(make(), layers, HFJobConfig(activation_checkpointing=ac))
        assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == (4 if ac else 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, 256, (2 * world, 16), generator=g)
            loss = model(local(x, rank, world)).float().logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.timeout(200)
def test_hf_job_activation_checkpointing_recomputes_each_layer() -> None:
    """``train hf --activation-checkpointing`` checkpoints every decoder layer (the option was
    parsed and silently ignored before) and trains to the same losses as without it."""
    losses = run_ranks(hf_checkpointing_body, 2, timeout=180)[0]
    assert losses[2:] == pytest.approx(losses[:2], rel=1e-6, abs=0), losses


def _tiny_llama(tie: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=37,  # dim 0 of the embedding does not divide 2
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def _marked(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if getattr(m, "_is_fsdp_managed_module", False)]


def generate_body(rank: int, world: int) -> list[str]:
    import torch.distributed.fsdp as tf
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.distributed.fsdp import is_fsdp_managed_module

    import fullshard as fs

    out = []
    prompt = torch.randint(1, 37, (1, 4), generator=torch.Generator().manual_seed(0))
    for fully_shard in (tf.fully_shard, fs.fully_shard):
        model = _tiny_llama(tie=True)
        model.model.layers[1].requires_grad_(False)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model, ignored_params={model.model.norm.weight})
        assert is_fsdp_managed_module(model)
        out.append(_marked(model))
        # Ranks ask for different lengths: transformers keeps the rank that is done running
        # forwards (synced_gpus) until every rank is, because the model says it is FSDP's.
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=2 + 3 * rank, do_sample=False, eos_token_id=None)
        out.append(tokens.tolist())
    for fsdp in (tf.FullyShardedDataParallel, fs.FullyShardedDataParallel):
        model = _tiny_llama(tie=False)
        policy = ModuleWrapPolicy({type(model.model.layers[0])})
        fsdp(model, auto_wrap_policy=policy, ignored_modules=[model.lm_head], device_id=torch.device("cpu"))
        out.append(_marked(model))
    assert out[0] == out[2] and out[1] == out[3], out  # FSDP2: the same modules marked, the same tokens
    assert out[4] == out[5], out  # FSDP1: the wrapped modules, not the ignored lm_head
    assert (
        len(out[1][0]) == 6 + 3 * rank
        and "lm_head" not in out[4]
        and "model.layers.0._fsdp_wrapped_module.mlp" in out[4]
    )
    return out[0]


@pytest.mark.timeout(120)
def test_generate_keeps_ranks_in_step_like_torch() -> None:
    """transformers' ``generate`` turns on ``synced_gpus`` for modules torch's FSDP marks as its
    own (``_is_fsdp_managed_module``). fullshard's units did not carry the mark: a rank asking for
    fewer new tokens stopped, and the other waited in an all-gather until the timeout. Now
    both front ends mark the modules they manage as torch's do (the same modules), and
    ``generate`` gives torch's tokens on every rank."""
    marked = run_ranks(generate_body, 2, timeout=100)[0]
    assert "" in marked and "model.layers.0.mlp" in marked


def _accelerate_hf_run(rank: int, world: int, on_fullshard: bool, tie: bool, mixed: str, out_dir: str) -> list[Any]:
    """Accelerate's FSDP2 path on a tiny Llama: cpu_ram_efficient_loading (other ranks' weights
    differ and are replaced from rank 0's), the optimizer built before prepare and switched by
    name, mixed precision as Accelerate builds it, then get_state_dict and save_pretrained."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from test_frameworks import force_accelerate_fsdp

    import fullshard

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(reset_partial_state=True)
    binding = fullshard.use_in_torch() if on_fullshard else None
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", cpu_ram_efficient_loading=True
        )
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=True, mixed_precision=mixed)
        force_accelerate_fsdp(plugin)
        model = _tiny_llama(tie)
        if rank > 0:  # rank 0's weights must reach every rank
            torch.nn.init.normal_(model.model.embed_tokens.weight)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        assert (fsdp_state(model) is not None) == on_fullshard
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        losses = []
        for step in range(3):
            x = torch.randint(0, 37, (2 * world, 8), generator=torch.Generator().manual_seed(step))
            x = x[2 * rank : 2 * rank + 2]
            with accelerator.autocast():
                loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
        saved = os.path.join(out_dir, "fullshard" if on_fullshard else "torch")
        accelerator.unwrap_model(model).save_pretrained(
            saved, state_dict=dict(state), is_main_process=accelerator.is_main_process
        )
        accelerator.wait_for_everyone()
        return [losses, state]
    finally:
        if binding is not None:
            binding.undo()
        AcceleratorState._reset_state(reset_partial_state=True)


def accelerate_hf_body(rank: int, world: int, out_dir: str) -> list[str]:
    from transformers import LlamaForCausalLM

    done = []
    for tie, mixed in ((True, "bf16"), (False, "no")):
        where = os.path.join(out_dir, f"{tie}")
        ref, ours = (_accelerate_hf_run(rank, world, on, tie, mixed, where) for on in (False, True))
        assert ours[0] == ref[0], (tie, ref[0], ours[0])
        assert list(ours[1]) == list(ref[1]) and (len(ours[1]) > 0) == (rank == 0)  # full, on rank 0 only
        for k, v in ref[1].items():
            assert torch.equal(ours[1][k], v), (tie, k)
        if rank == 0:  # what save_pretrained wrote loads back into an unwrapped model, as torch's
            loaded = LlamaForCausalLM.from_pretrained(os.path.join(where, "fullshard")).state_dict()
            for k, v in ours[1].items():
                assert torch.equal(loaded[k], v), (tie, k)
        done.append(f"tie={tie} {mixed}")
    return done


@pytest.mark.timeout(240)
def test_accelerate_fsdp2_loads_ties_and_saves_a_transformers_model_like_torch(tmp_path: Path) -> None:
    """Accelerate's FSDP2 prepare of a transformers model with ``cpu_ram_efficient_loading``
    (moved to meta, sharded, rank 0's full state dict broadcast, ``distribute_tensor``'d and
    loaded with ``assign=True``, non-persistent rotary buffers put back, ``tie_weights()``
    again), its optimizer switched to the DTensor parameters, bf16 mixed precision
    (``MixedPrecisionPolicy`` with ``output_dtype``) and the tied embedding in the
    ``[norm, embed, lm_head]`` unit: the same losses and full state dict as torch's FSDP2, bit
    for bit, and ``save_pretrained(state_dict=get_state_dict(model))`` loads back."""
    pytest.importorskip("accelerate")
    assert run_ranks(accelerate_hf_body, 2, str(tmp_path), timeout=220)[0] == ["tie=True bf16", "tie=False no"]


def tie_after_sharding_body(rank: int, world: int) -> float:
    import fullshard as fs

    with torch.device("meta"):  # as accelerate's init_empty_weights builds it: not tied
        model = _tiny_llama(tie=False)
    model.config.tie_word_embeddings = True
    for layer in model.model.layers:
        fs.fully_shard(layer)
    fs.fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.init_weights()
    model.tie_weights()  # lm_head.weight = embed_tokens.weight, after sharding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    start = {k: v.full_tensor() for k, v in model.state_dict().items()}
    ref = _tiny_llama(tie=True)
    ref.load_state_dict(start)
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        for step in range(3):
            xs = [
                torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(2 * step + r))
                for r in range(world)
            ]
            if m is model:
                m(input_ids=xs[rank], labels=xs[rank]).loss.backward()
            else:
                (sum(m(input_ids=x, labels=x).loss for x in xs) / world).backward()
            opt.step()
            opt.zero_grad()
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    return max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.timeout(120)
def test_embedding_tied_after_sharding_trains_as_tied() -> None:
    """A transformers model built untied on meta, sharded, materialized, and only then tied by
    ``tie_weights()`` trains as the tied unwrapped model (the two uses' gradients add, one
    update). Torch 2.13's fully_shard does not here when the vocabulary does not divide the
    world size (37 rows at 2 ranks): its padded rank keeps separate copies and drifts 0.13
    from the reference in 3 SGD steps; at 38 rows it matches."""
    errors = run_ranks(tie_after_sharding_body, 2, timeout=100)
    assert max(errors) < 1e-6, errors


def two_views_body(rank: int, world: int) -> int:
    """A tiny Llama with transformers' reentrant gradient checkpointing, each decoder layer a
    ``fully_shard`` unit, trained on two forwards (two views of a batch) and one backward of
    their summed losses, as a contrastive or consistency loss does: two SGD steps, each sharded
    gradient the unsharded model's averaged over ranks. Returns the steps."""
    import torch.distributed as dist

    import fullshard

    ref = _tiny_llama(tie=False)
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ref.train()
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        fullshard.fully_shard(layer)
    fullshard.fully_shard(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        views = [torch.randint(1, 37, (2, 6), generator=g) for _ in range(2)]
        for m in (model, ref):
            sum(m(input_ids=v, labels=v).loss for v in views).backward()
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            want = p.grad.clone()
            dist.all_reduce(want)
            want /= world
            torch.testing.assert_close(q.grad.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            p.grad = want  # both models take the same step
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return 2


@pytest.mark.timeout(120)
def test_reentrant_gradient_checkpointing_with_two_forwards_before_backward() -> None:
    # Each layer's segment of the first view recomputes after that layer's post-backward for the
    # second view: "cannot run forward in training state POST_BACKWARD" before 2026-11-29. (torch
    # 2.13's fully_shard runs it, but leaves the layers unsharded after backward and reads their
    # stale full parameters at the next forward.)
    assert run_ranks(two_views_body, 2, timeout=100) == [2, 2]
