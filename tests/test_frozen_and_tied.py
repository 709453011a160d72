"""Frozen parameters inside a unit, and tied parameters across units."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import patched, run_ranks
from models import local
from torch import nn

from fullshard import probes


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank adapter, all in one unit."""

    def __init__(self, d: int, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class LoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(9) for _ in range(3))
        self.out = nn.Linear(9, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def reference_step(ref: nn.Module, ref_opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of the unwrapped reference on the whole batch, as the sharded model takes it."""
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()


def frozen_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP, model_state_bytes
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = LoRANet()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({LoRALinear}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(12, 9, generator=g), torch.randn(12, 2, generator=g)
        with probes.enabled(collective_log=True) as p:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()
            opt.step()
        log = p.collectives.log or []
        reference_step(ref, ref_opt, x, y)
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    for name, p in model.named_parameters():
        assert (p.grad is None) == (not p.requires_grad), name
    # The reduce-scatter of each LoRA unit carries the adapter's gradient only (the log records
    # its input: world x this rank's padded gradient shard).
    lora_units = [m.unit for m in model.fsdp_modules(model) if isinstance(m.module, LoRALinear)]
    reduce_sizes = sorted(n for op, _, n in log if op == "reduce_scatter")
    for u in lora_units:
        assert u.grad_numel < u.shard_numel and world * u.grad_numel in reduce_sizes, (u.grad_numel, reduce_sizes)
    trainable_shard_bytes = sum(u.grad_numel * 4 for u in (m.unit for m in model.fsdp_modules(model)))
    assert model_state_bytes(model)["grads"] == trainable_shard_bytes
    return ["frozen"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_parameters_get_no_gradient_memory_or_communication(world: int) -> None:
    assert run_ranks(frozen_body, world, timeout=180)[0] == ["frozen"]


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (as GPT-2's wte and lm_head)."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mid = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.mid(self.wte(idx)))


def tied_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = TiedLM()
    # The policy makes wte, the Linear and lm_head units: the tied weight goes to the root.
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({nn.Embedding, nn.Linear}))
    root = model.unit
    tied = [sp for sp in root.params if sp.fqn in ("wte.weight", "lm_head.weight")]
    assert len(tied) == 1 and len(tied[0].slots) == 2, [sp.fqn for sp in root.params]
    assert model.module.lm_head.weight is model.module.wte.weight  # still one parameter
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    for step in range(5):
        idx = torch.randint(0, 11, (12, 5), generator=g)
        tgt = torch.randint(0, 11, (12, 5), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(
            model(local(idx, rank, world)).flatten(0, 1), local(tgt, rank, world).flatten()
        ).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(idx).flatten(0, 1), tgt.flatten()).backward()
        ref_opt.step()
    full = model.state_dict()
    assert list(full) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    plain = TiedLM()
    plain.load_state_dict(full)
    # Wrapping by hand so that the tied weight would sit in two units: a clear error.
    manual = TiedLM()
    manual.wte = FSDP(manual.wte)
    with pytest.raises(ValueError, match="lm_head.weight is tied to weight, which a nested FSDP unit already sharded"):
        FSDP(manual)
    return ["tied"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_tied_parameters_across_units(world: int) -> None:
    assert run_ranks(tied_body, world, timeout=180)[0] == ["tied"]


class FrozenMiddle(nn.Module):
    """A trainable input layer, four blocks of which the first three are frozen (the lower
    layers of a fine-tuned model), a trainable head: the frozen blocks run backward for their
    inputs' gradients alone. The second block runs twice per forward (a shared layer, as
    ALBERT's)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(4))
        for b in self.blocks[:3]:
            b.requires_grad_(False)

    def forward(self, x):
        x = self.inp(x)
        if torch.is_grad_enabled() and x.requires_grad:
            x.register_hook(self.seen)  # runs once every block's backward is done
        for i in (0, 1, 1, 2, 3):
            x = self.blocks[i](x)
        return self.out(x)

    def seen(self, grad: torch.Tensor) -> None:
        self.states_at_input_grad = [str(fsdp_unit_state(b)) for b in self.blocks]


def fsdp_unit_state(block: nn.Module) -> object:
    from fullshard.engine.hooks import fsdp_state

    wrapped = getattr(block, "_fsdp_wrapped_module", None)  # the FSDP1 wrapper's inner module
    state = fsdp_state(block) or (fsdp_state(wrapped) if wrapped is not None else None)
    return state.unit.shard_state if state is not None else None


def frozen_middle_body(rank: int, world: int, api: str, strategy: str) -> list[str]:
    from fullshard import FSDP, ShardingStrategy, fully_shard
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = FrozenMiddle()
    model = copy.deepcopy(ref)
    if api == "fsdp1":
        wrapper = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), sharding_strategy=ShardingStrategy[strategy]
        )
        blocks: list[nn.Module] = list(wrapper.module.blocks)
    else:
        for b in model.blocks:
            fully_shard(b, reshard_after_forward=strategy == "FULL_SHARD")
        wrapper = fully_shard(model)
        blocks = list(model.blocks)
    inner = wrapper.module if api == "fsdp1" else model
    opt = torch.optim.AdamW([p for p in wrapper.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapper(local(x, rank, world)), local(y, rank, world)).backward()
        opt.step()
        reference_step(ref, ref_opt, x, y)
        # the frozen blocks resharded once their backward was done (before the input layer's
        # gradient), as torch's FSDP does; before, they stayed gathered to the end of backward
        sharded = str(fsdp_unit_state(blocks[3]))
        assert inner.states_at_input_grad == [sharded] * 4, (inner.states_at_input_grad, sharded)
    full = _full_state(wrapper, api)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    return ["frozen middle"]


def _full_state(model: nn.Module, api: str) -> dict[str, torch.Tensor]:
    if api == "fsdp1":
        return model.state_dict()
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("api", "strategy"), [("fsdp1", "FULL_SHARD"), ("fsdp1", "SHARD_GRAD_OP"), ("fsdp2", "FULL_SHARD")]
)
def test_frozen_units_reshard_after_their_backward(api: str, strategy: str) -> None:
    assert run_ranks(frozen_middle_body, 2, api, strategy, timeout=180)[0] == ["frozen middle"]


class FrozenBottom(nn.Module):
    """A frozen input layer and two frozen blocks under two trainable ones: the frozen blocks'
    outputs need no gradient, so they never run backward (a frozen vision tower, or lower
    layers under a frozen embedding)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(4))
        for m in (self.inp, self.blocks[0], self.blocks[1]):
            m.requires_grad_(False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def frozen_bottom_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = FrozenBottom()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    from fullshard.comm import buffers

    pool_type, dropped = type(buffers.POOL), []
    drop = pool_type.drop

    def recording_drop(pool: object, sizes: set) -> None:
        dropped.append(set(sizes))
        drop(pool, sizes)

    block_size = model.module.blocks[2].unit.pooled_sizes()[0]  # the wrapper auto-wrapped it
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        dropped.clear()
        with probes.enabled(events=True) as p, patched(pool_type, drop=recording_drop):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()
        # after blocks.2, the last unit backward reaches, the pool frees the blocks' buffers for
        # the root's backward (the frozen blocks below it gather nothing before the next forward)
        assert any(block_size in d for d in dropped), (block_size, dropped)
        opt.step()
        reference_step(ref, ref_opt, x, y)
        gathers = [name for event, name in p.events or [] if event == "unshard"]
        # the frozen blocks are gathered for forward only: backward never reaches them, so the
        # trainable block above them prefetches none (before, blocks.1 was gathered again and
        # held to the end of backward); blocks.2 gathers again for backward
        counts = {f"blocks.{i}": gathers.count(f"blocks.{i}") for i in range(3)}
        assert counts == {"blocks.0": 1, "blocks.1": 1, "blocks.2": 2}, (counts, gathers)
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    return ["frozen bottom"]


@pytest.mark.timeout(200)
def test_units_that_never_run_backward_are_not_prefetched_for_it() -> None:
    assert run_ranks(frozen_bottom_body, 2, timeout=180)[0] == ["frozen bottom"]
