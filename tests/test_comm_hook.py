"""FSDP1 communication hooks (``FullyShardedDataParallel.register_comm_hook``) against torch's
own FSDP1 on CPU (``device_id=torch.device("cpu")``), in the same process group at 2 ranks.

torch's default hooks (``allreduce_hook`` under NO_SHARD, ``reduce_scatter_hook`` under
FULL_SHARD and SHARD_GRAD_OP, with ``DefaultState``) and a stateful hook of our own (it counts
its calls, reduces with an all-reduce, and in two cases compresses to bfloat16 / float16 on the
wire) train a ``Stack`` per ``Block`` unit for three SGD-with-momentum steps, the second
accumulating a ``no_sync`` micro-batch first: losses and full parameters are torch's bit for
bit, and the hooks are called as often. torch's own ``bf16_compress_hook`` /
``fp16_compress_hook`` need CUDA (their ``record_stream`` fails on CPU), in torch's FSDP1 as in
fullshard's. Also: ``check_is_root``, ``get_state_dict_type`` and the misuse both refuse.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import Block, batch, local, make_stack


class CountingState:
    """A hook state of our own: the process group, the dtype on the wire (None: the gradient's)
    and the number of calls."""

    def __init__(self, group: Any, wire: torch.dtype | None = None) -> None:
        self.group = group
        self.wire = wire
        self.calls = 0


def counting_hook(state: CountingState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """All-reduce the whole gradient (in ``state.wire``), average, and keep this rank's chunk
    (or all of it)."""
    import torch.distributed as dist

    state.calls += 1
    sent = grad if state.wire is None else grad.to(state.wire)
    dist.all_reduce(sent, group=state.group)
    world = dist.get_world_size(state.group)
    sent.div_(world)
    if output is not None:
        output.copy_(sent.chunk(world)[dist.get_rank(state.group)])
    elif sent is not grad:
        grad.copy_(sent)


def _cases() -> list[tuple[str, str, Any, Any]]:
    """(name, sharding strategy, hook, state factory)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as dh

    return [
        ("allreduce_hook NO_SHARD", "NO_SHARD", dh.allreduce_hook, dh.DefaultState),
        ("reduce_scatter_hook FULL_SHARD", "FULL_SHARD", dh.reduce_scatter_hook, dh.DefaultState),
        ("reduce_scatter_hook SHARD_GRAD_OP", "SHARD_GRAD_OP", dh.reduce_scatter_hook, dh.DefaultState),
        ("counting hook FULL_SHARD", "FULL_SHARD", counting_hook, CountingState),
        ("counting hook NO_SHARD", "NO_SHARD", counting_hook, CountingState),
        ("bf16 counting hook FULL_SHARD", "FULL_SHARD", counting_hook, lambda g: CountingState(g, torch.bfloat16)),
        ("fp16 counting hook NO_SHARD", "NO_SHARD", counting_hook, lambda g: CountingState(g, torch.float16)),
    ]


def _train(kind: str, strategy: str, hook: Any, make_state: Any, rank: int, world: int) -> tuple[list, dict, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fullshard import FSDP

    cls = TorchFSDP if kind == "torch" else FSDP
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(
            make_stack(scale_shape=(1,)),
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    state = make_state(dist.group.WORLD)
    assert model.check_is_root()  # the outermost becomes the root (before it, a nested one would)
    with pytest.raises((AssertionError, RuntimeError), match="root"):
        next(m for m in cls.fsdp_modules(model) if m is not model).register_comm_hook(state, hook)
    model.register_comm_hook(state, hook)
    with pytest.raises((AssertionError, RuntimeError), match="already registered|registered already"):
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(3):
        opt.zero_grad()
        if step == 1:
            with model.no_sync():
                x, y = batch(50, 12)
                torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()
        x, y = batch(step, 12)
        loss = torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with cls.summon_full_params(model, writeback=False):
        full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return losses, full, state


def hooks_body(rank: int, world: int) -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType

    from fullshard import FSDP

    done = []
    for name, strategy, hook, make_state in _cases():
        theirs, ours = (_train(kind, strategy, hook, make_state, rank, world) for kind in ("torch", "fullshard"))
        assert ours[0] == theirs[0], (name, ours[0], theirs[0])
        assert ours[1].keys() == theirs[1].keys(), name
        for k, v in theirs[1].items():
            assert torch.equal(ours[1][k], v), (name, k, (ours[1][k] - v).abs().max().item())
        if isinstance(theirs[2], CountingState):
            assert ours[2].calls == theirs[2].calls > 0, (name, ours[2].calls, theirs[2].calls)
        done.append(name)

    # check_is_root and get_state_dict_type, as torch's
    for cls in (TorchFSDP, FSDP):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            model = cls(
                make_stack(scale_shape=(1,)), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
            )
        assert model.check_is_root() and not cls.fsdp_modules(model)[1].check_is_root(), cls
        assert cls.get_state_dict_type(model).state_dict_type.name == "FULL_STATE_DICT", cls
        with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            assert cls.get_state_dict_type(model).state_dict_type.name == "SHARDED_STATE_DICT", cls
        cls.set_state_dict_type(cls.fsdp_modules(model)[1], StateDictType.LOCAL_STATE_DICT)
        with pytest.raises((AssertionError, RuntimeError), match="same state dict settings|different state-dict"):
            cls.get_state_dict_type(model)
    done.append("check_is_root, get_state_dict_type")
    return done


@pytest.mark.timeout(200)
def test_comm_hooks_match_torch_fsdp1() -> None:
    done = run_ranks(hooks_body, 2, timeout=180)[0]
    assert len(done) == len(_cases()) + 1, done
