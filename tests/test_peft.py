"""PEFT LoRA adapters under fullshard, the way Accelerate and PEFT's own FSDP recipe train them.

A LoRA model (``peft.get_peft_model`` on a tiny Llama: frozen base weights, trainable ``lora_A``
and ``lora_B``) is sharded by Accelerate's FSDP2 path (``fully_shard`` per decoder layer, via
``fullshard.use_in_torch``) and trained beside torch's FSDP2 in the same process group: the
losses, the adapter file that ``save_fsdp_model(..., adapter_only=True)`` writes (what the HF
Trainer saves for PEFT) and the adapter loaded back must be bitwise torch's. The FSDP1 wrapper
runs PEFT's own ``fsdp_auto_wrap_policy`` (each trainable LoRA leaf a unit of its own, inside
the decoder-layer units) beside torch's FSDP1 (on CPU with ``device_id``): losses and the adapter
``get_peft_model_state_dict`` gives under ``FULL_STATE_DICT`` must be bitwise torch's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import local
from test_frameworks import force_accelerate_fsdp

import fullshard

pytest.importorskip("peft")
pytest.importorskip("accelerate")

_LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def _lora_llama(seed: int = 0) -> Any:
    from peft import LoraConfig, get_peft_model

    from fullshard.jobs.train.hf import HF_CONFIGS

    torch.manual_seed(seed)
    return get_peft_model(HF_CONFIGS["llama-tiny"][0](), LoraConfig(**_LORA))


def _batches(rank: int, world: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [local(torch.randint(0, 256, (2 * world, 16), generator=g), rank, world) for _ in range(steps)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _accelerate_lora(rank: int, world: int, on_fullshard: bool, out: str, state_dict_type: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_model, save_fsdp_model

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type=state_dict_type,
    )
    binding = fullshard.use_in_torch() if on_fullshard else None
    try:
        acc = Accelerator(fsdp_plugin=plugin, cpu=True)
        force_accelerate_fsdp(plugin)
        peft_model = _lora_llama()
        base_before = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" not in k}
        opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = acc.prepare(peft_model, opt)
        losses = []
        for x in _batches(rank, world, 3):
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        trained = {n: _full(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
        base_after = {n: _full(p.detach()) for n, p in model.named_parameters() if not p.requires_grad}
        folder = os.path.join(out, state_dict_type, "fullshard" if on_fullshard else "torch")
        save_fsdp_model(plugin, acc, model, folder, adapter_only=True)
        acc.wait_for_everyone()
        saved = {}
        if state_dict_type == "FULL_STATE_DICT" and rank == 0:
            saved = torch.load(os.path.join(folder, "pytorch_model_fsdp.bin"), weights_only=True)
        # A fresh LoRA model (another seed: its lora_A differs, its lora_B is zero) gets the adapter back.
        other = _lora_llama(seed=5)
        fresh, _ = acc.prepare(other, torch.optim.SGD([p for p in other.parameters() if p.requires_grad]))
        load_fsdp_model(plugin, acc, fresh, folder, adapter_only=True)
        loaded = {n: _full(p.detach()) for n, p in fresh.named_parameters() if p.requires_grad}
        return {
            "losses": losses,
            "saved": saved,
            "trained": trained,
            "loaded_equal": all(torch.equal(loaded[n], v) for n, v in trained.items())
            and loaded.keys() == trained.keys(),
            "base_unchanged": all(torch.equal(base_after[n], base_before[n]) for n in base_after),
        }
    finally:
        if binding is not None:
            binding.undo()
        AcceleratorState._reset_state(reset_partial_state=True)


def _accelerate_lora_both(rank: int, world: int, out: str) -> list[dict[str, Any]]:
    return [
        _accelerate_lora(rank, world, on_fullshard, out, kind)
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
        for on_fullshard in (False, True)
    ]


@pytest.mark.timeout(300)
def test_accelerate_lora_on_fullshard_matches_torch(tmp_path: Any) -> None:
    """Losses, the saved adapter and the adapter loaded back are torch FSDP2's, bit for bit."""
    results = run_ranks(_accelerate_lora_both, 2, str(tmp_path), timeout=280)
    for rank, (full_ref, full_ours, sharded_ref, sharded_ours) in enumerate(results):
        for ref, ours in ((full_ref, full_ours), (sharded_ref, sharded_ours)):
            assert ours["losses"] == ref["losses"] and len(ref["losses"]) == 3, rank
            assert ours["trained"].keys() == ref["trained"].keys() and len(ref["trained"]) == 16
            for name, want in ref["trained"].items():
                assert torch.equal(ours["trained"][name], want), (rank, name)
            assert ours["loaded_equal"] and ref["loaded_equal"], rank
            assert ours["base_unchanged"] and ref["base_unchanged"], rank
        # The adapter trained: lora_B starts at zero.
        assert all(v.abs().max() > 0 for k, v in full_ours["trained"].items() if "lora_B" in k)
    full_ref, full_ours = results[0][0], results[0][1]
    assert list(full_ours["saved"]) == list(full_ref["saved"]) and len(full_ref["saved"]) == 16
    for key, want in full_ref["saved"].items():
        assert torch.equal(full_ours["saved"][key], want), key


def _fsdp1_lora(rank: int, world: int) -> list[str]:
    """PEFT's FSDP1 recipe on fullshard's wrapper and on torch's FSDP1 (on CPU with device_id)."""
    import torch.distributed.fsdp as tf
    from peft import get_peft_model_state_dict
    from peft.utils.other import fsdp_auto_wrap_policy

    from fullshard import FullyShardedDataParallel

    runs = []
    for fsdp, kwargs in (
        (tf.FullyShardedDataParallel, {"device_id": torch.device("cpu")}),
        (FullyShardedDataParallel, {}),
    ):
        peft_model = _lora_llama()
        base = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" not in k}
        model = fsdp(peft_model, auto_wrap_policy=fsdp_auto_wrap_policy(peft_model), use_orig_params=True, **kwargs)
        units = fsdp.fsdp_modules(model)
        assert len(units) == 1 + 4 + 16, len(units)  # root, decoder layers, each LoRA leaf
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for x in _batches(rank, world, 3):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        # The HF Trainer's FSDP1 save of a PEFT model (accelerate's save_fsdp_model, adapter_only).
        config = tf.FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with fsdp.state_dict_type(model, tf.StateDictType.FULL_STATE_DICT, config):
            adapter = get_peft_model_state_dict(model)
            full = model.state_dict()
        runs.append((losses, adapter, {k: v for k, v in full.items() if "lora_" not in k}, base))
    (theirs, their_adapter, _, _), (ours, adapter, frozen, base) = runs
    assert ours == theirs, (ours, theirs)
    assert list(adapter) == list(their_adapter) and len(adapter) == (16 if rank == 0 else 0), list(adapter)
    for key, want in their_adapter.items():
        assert torch.equal(adapter[key], want), key
    assert all(adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)  # trained from zero
    if rank == 0:  # the frozen base weights are untouched
        assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)
    return list(adapter)


@pytest.mark.timeout(240)
def test_fsdp1_wrapper_with_peft_policy_matches_torch_fsdp1() -> None:
    """PEFT's FSDP1 recipe (its wrap policy, ``use_orig_params=True``), as torch's FSDP1 trains
    it: the same losses and the same adapter from ``get_peft_model_state_dict``, bit for bit."""
    keys = run_ranks(_fsdp1_lora, 2, timeout=220)
    assert len(keys[0]) == 16 and keys[1] == []
