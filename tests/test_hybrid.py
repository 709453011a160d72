"""Hybrid sharding: shard inside a group, replicate across groups (world size 4 as 2 x 2)."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import Block, make_stack, step_both

from fullshard import probes


def hybrid_body(rank: int, world: int) -> list[str]:
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import FSDP, ShardingStrategy
    from fullshard.comm import collectives
    from fullshard.frontend.wrap import ModuleWrapPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # the default hybrid groups: shard within a "node" of 2
    done = []
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        for how in ("mesh", "tuple", "default"):
            kwargs: dict = {"device_mesh": mesh} if how == "mesh" else {}
            if how == "tuple":
                kwargs["process_group"] = (mesh.get_group("shard"), mesh.get_group("replicate"))
            ref = make_stack()
            model = FSDP(
                copy.deepcopy(ref), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs
            )
            units = [m.unit for m in model.fsdp_modules(model)]
            assert all(u.shard_size == 2 and u.replicate_size == 2 for u in units)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            for step in range(4):
                with probes.enabled() as p:  # the last step's calls
                    step_both(model, opt, ref, ref_opt, step, rank, world)
                    total = model.clip_grad_norm_(1e9)  # a norm over shards and replicas, no clipping
            calls = dict(p.collectives.calls)
            assert calls["reduce_scatter"] == len(units) and calls["all_reduce"] >= len(units), calls
            full = model.state_dict()
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(
                    full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{strategy.name}/{how} {k}: {m}"
                )
            assert total > 0
            done.append(f"{strategy.name}/{how}")
    # Bad groups: clear errors.
    with pytest.raises(ValueError, match="needs 2"):
        FSDP(make_stack(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh("cpu", (4,)))
    with pytest.raises(ValueError, match="needs 1"):
        FSDP(make_stack(), device_mesh=mesh)
    with pytest.raises(ValueError, match="world size is 4"):
        FSDP(
            make_stack(),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            process_group=(mesh.get_group("shard"), collectives.default_group()),
        )
    with pytest.raises(ValueError, match="not FULL_SHARD"):
        FSDP(make_stack(), process_group=(mesh.get_group("shard"), mesh.get_group("replicate")))
    return done


@pytest.mark.timeout(300)
def test_hybrid_sharding_2x2() -> None:
    assert len(run_ranks(hybrid_body, 4, timeout=280)[0]) == 6
