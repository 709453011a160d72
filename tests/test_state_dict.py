"""Full state dicts: original names and shapes, loadable by the plain model, and back."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import Block, batch, make_stack


def state_dict_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    ref = make_stack()
    ref.register_buffer("counter", torch.arange(5.0))
    ref.register_buffer("scratch", torch.ones(2), persistent=False)
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({Block}))
    sd = model.state_dict()
    want = ref.state_dict()
    assert list(sd) == list(want), (list(sd), list(want))
    for k in want:
        assert sd[k].shape == want[k].shape and torch.equal(sd[k], want[k]), k
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], names

    # The plain model loads it with strict=True.
    plain = make_stack(seed=7)
    plain.register_buffer("counter", torch.zeros(5))
    plain.load_state_dict(sd, strict=True)

    # load_state_dict on the sharded model takes a full state dict and shards it.
    other = make_stack(seed=3)
    other.register_buffer("counter", torch.full((5,), 9.0))
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    back = model.state_dict()
    for k, v in other.state_dict().items():
        assert torch.equal(back[k], v), k

    # Errors name the key; nothing is loaded when anything is wrong.
    before = model.state_dict()
    bad = dict(other.state_dict())
    bad["head.weight"] = torch.zeros(4, 13)
    bad.pop("stem.bias")
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as e:
        model.load_state_dict(bad)
    msg = str(e.value)
    assert "size mismatch for head.weight" in msg and '"stem.bias"' in msg and '"extra.weight"' in msg, msg
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    result = model.load_state_dict({k: v for k, v in bad.items() if k != "head.weight"}, strict=False)
    assert result.missing_keys == ["stem.bias", "head.weight"] and result.unexpected_keys == ["extra.weight"], result

    # Training after a load continues from the loaded values.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0, 4 * world)
    torch.nn.functional.mse_loss(model(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4]).backward()
    opt.step()
    return list(sd)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 3])
def test_full_state_dict_round_trip(world: int) -> None:
    keys = run_ranks(state_dict_body, world, timeout=180)[0]
    assert "blocks.0.lin.weight" in keys and "counter" in keys and "scratch" not in keys
