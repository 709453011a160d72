"""``CustomPolicy`` and ``always_wrap_policy`` (``torch.distributed.fsdp.wrap``'s) on the FSDP1
wrapper against torch's own FSDP1 on CPU (``device_id=torch.device("cpu")``), at 2 ranks.

A ``CustomPolicy`` wraps each ``Block`` with the root's arguments or its own: one NO_SHARD,
one SHARD_GRAD_OP, one reducing its gradients in bf16; fullshard takes torch's policy object as well
as its own. ``always_wrap_policy`` makes every submodule a unit. Three SGD steps with momentum:
the number of units, the losses and the full parameters are torch's bit for bit (2 ranks: each
sum has two terms). A ``lambda_fn`` returning something else, or an argument a unit cannot have
on its own, is refused.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import Block, batch, local, make_stack


def _overrides(module: torch.nn.Module, blocks: list[torch.nn.Module]) -> bool | dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    if module is blocks[0]:
        return {"sharding_strategy": ShardingStrategy.NO_SHARD}
    if module is blocks[1]:
        return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
    if module is blocks[2]:
        return {"mixed_precision": MixedPrecision(reduce_dtype=torch.bfloat16)}  # gradients reduced in bf16
    return isinstance(module, Block)


def _train(cls: Any, policy: Any, module: torch.nn.Module, rank: int, world: int) -> tuple[int, list, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(module, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = batch(step, 12)
        loss = torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with cls.summon_full_params(model, writeback=False):
        full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    if cls.__module__.startswith("fullshard") and isinstance(policy, (fullshard_policy(), torch_policy())):
        units = {id(m): m.unit for m in cls.fsdp_modules(model)}  # module.blocks now holds the wrappers
        blocks = list(module.blocks)
        assert units[id(blocks[0])].shard_size == 1 and units[id(blocks[1])].shard_size == world  # NO_SHARD, SGO
        assert not units[id(blocks[1])].reshard_after_forward and units[id(blocks[3])].reshard_after_forward
        assert units[id(blocks[2])].reduce_dtype == torch.bfloat16 != units[id(blocks[3])].reduce_dtype
    return len(cls.fsdp_modules(model)), losses, full


def fullshard_policy() -> type:
    from fullshard.wrap import CustomPolicy

    return CustomPolicy


def torch_policy() -> type:
    from torch.distributed.fsdp.wrap import CustomPolicy

    return CustomPolicy


def policy_body(rank: int, world: int) -> list[str]:
    import torch.distributed.fsdp.wrap as torch_wrap
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    import fullshard.wrap
    from fullshard import FSDP

    done = []
    cases = [
        ("CustomPolicy", lambda cls, f: cls(f), torch_wrap.CustomPolicy, fullshard.wrap.CustomPolicy),
        ("torch's CustomPolicy given to fullshard", None, torch_wrap.CustomPolicy, torch_wrap.CustomPolicy),
        ("always_wrap_policy", None, torch_wrap.always_wrap_policy, fullshard.wrap.always_wrap_policy),
    ]
    for name, _, theirs_policy, ours_policy in cases:
        results = []
        for cls, policy in ((TorchFSDP, theirs_policy), (FSDP, ours_policy)):
            module = make_stack(scale_shape=(1,))
            if name != "always_wrap_policy":
                blocks = list(module.blocks)
                policy = policy(lambda m, blocks=blocks: _overrides(m, blocks))
            results.append(_train(cls, policy, module, rank, world))
        (n_t, l_t, p_t), (n_o, l_o, p_o) = results
        assert n_o == n_t and l_o == l_t, (name, n_o, n_t, l_o, l_t)
        assert p_o.keys() == p_t.keys() and all(torch.equal(p_o[k], v) for k, v in p_t.items()), name
        done.append(name)
    with pytest.raises(ValueError, match="bool or a dict"):
        FSDP(make_stack(scale_shape=(1,)), auto_wrap_policy=fullshard.wrap.CustomPolicy(lambda m: 1))
    with pytest.raises(ValueError, match="param_init_fn"):
        FSDP(
            make_stack(scale_shape=(1,)),
            auto_wrap_policy=fullshard.wrap.CustomPolicy(
                lambda m: {"param_init_fn": None} if isinstance(m, Block) else False
            ),
        )
    return done


@pytest.mark.timeout(200)
def test_custom_and_always_wrap_policies_match_torch_fsdp1() -> None:
    assert len(run_ranks(policy_body, 2, timeout=180)[0]) == 3
