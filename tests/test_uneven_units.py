"""Units whose members run unevenly, activation checkpointing in either order, and what happens
when full parameters are used after a reshard: fullshard's ``fully_shard`` against torch's in the
same process group.

The chunked-loss pattern is torchtitan's default loss (``ChunkedLossWrapper``): ``[norm, output]``
is one unit, the model's forward stops at the norm, and the loss runs the head once per chunk of
the sequence with a backward per chunk (gradient sync off until the last chunk, the head kept
gathered by an explicit ``unshard()``), then back-propagates the hidden state through the model.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist import run_ranks
from models import TinyLM, tokens
from torch import nn

STEPS = 3


class HeadlessLM(TinyLM):
    """TinyLM whose forward can stop at the final norm (the chunked loss runs the head itself)."""

    def forward(self, ids: torch.Tensor, skip_head: bool = False) -> torch.Tensor:  # type: ignore[override]
        h = self.tok_embeddings(ids) + self.pos_embeddings(torch.arange(ids.shape[1]))
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return h if skip_head else self.output(h)


class _HiddenGrad(torch.autograd.Function):
    """Returns the loss; its backward sends the gradient the chunks gathered into the hidden state."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * grad_out, None, None


def _chunked_loss(model: HeadlessLM, hidden: torch.Tensor, labels: torch.Tensor, chunks: int, explicit: bool):
    """Cross-entropy over ``chunks`` slices of the sequence, one head forward and backward each."""
    head = model.output
    pieces = [c.detach().requires_grad_(True) for c in hidden.split(hidden.shape[1] // chunks, dim=1)]
    label_pieces = labels.split(labels.shape[1] // chunks, dim=1)
    if explicit:
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    total = hidden.new_zeros(())
    grads = []
    for i, (piece, label) in enumerate(zip(pieces, label_pieces)):
        if explicit and i == chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(piece)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), label.flatten(), reduction="sum") / labels.numel()
        loss.backward()
        grads.append(piece.grad)
        total = total + loss.detach()
    if explicit:
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(True, recurse=False)
        head.reshard()
    return _HiddenGrad.apply(hidden, torch.cat(grads, dim=1), total)


def _fully_shard(lib: str):
    if lib == "torch":
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    from fullshard import fully_shard

    return fully_shard


def _train_chunked(
    rank: int, world: int, lib: str, explicit: bool, bf16: bool = False
) -> tuple[list[float], list[torch.Tensor]]:
    fully_shard = _fully_shard(lib)
    torch.manual_seed(0)
    model = HeadlessLM(layers=2)
    mp = {}
    if bf16:  # torchtitan's default: gather and compute in bf16, reduce in fp32
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for layer in model.layers:
        fully_shard(layer, **mp)
    fully_shard([model.norm, model.output], **mp)
    fully_shard(model, **mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        ids = tokens(step, 2 * world)[2 * rank : 2 * rank + 2]
        hidden = model(ids, skip_head=True)
        loss = _chunked_loss(model, hidden.float() if bf16 else hidden, ids.roll(-1, 1), 4, explicit)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if lib == "fullshard":
        from fullshard.engine.hooks import fsdp_state
        from fullshard.engine.unit import ShardState, TrainingState

        units = {id(s.unit): s.unit for m in model.modules() if (s := fsdp_state(m)) is not None}
        for unit in units.values():
            assert unit.training_state is TrainingState.IDLE, (unit.name, unit.training_state)
            assert unit.shard_state is ShardState.SHARDED or unit.name == "<root>", unit.name
    return losses, [p.full_tensor() for p in model.parameters()]


def _in_turn(rank: int, world: int, runs: list[tuple]) -> list:
    """Each ``(fn, *args)`` of ``runs`` on these ranks, one after another: torch's run and
    fullshard's share one call (each seeds its own model)."""
    return [fn(rank, world, *args) for fn, *args in runs]


@pytest.mark.parametrize("world", [1, 2])
def test_chunked_loss_over_a_norm_and_head_unit_matches_torch(world: int) -> None:
    modes = (True, False)
    runs = [(_train_chunked, lib, explicit) for explicit in modes for lib in ("torch", "fullshard")]
    results = run_ranks(_in_turn, world, runs)
    for r in range(world):
        for i, explicit in enumerate(modes):
            ref, got = results[r][2 * i], results[r][2 * i + 1]
            assert got[0] == ref[0], (explicit, r)
            for a, b in zip(got[1], ref[1]):
                assert torch.equal(a, b), explicit


def test_chunked_loss_in_bf16_sums_unsynced_head_gradients_in_fp32_as_torch() -> None:
    """With sync off for all chunks but the last, torch's FSDP2 keeps the head's gradient sum in
    the reduce dtype (fp32); summed in bf16, the result differs from the first step."""
    results = run_ranks(_in_turn, 2, [(_train_chunked, lib, True, True) for lib in ("torch", "fullshard")])
    for r in range(2):
        ref, got = results[r]
        assert got[0] == ref[0], r
        for a, b in zip(got[1], ref[1]):
            assert torch.equal(a, b)


class _Leaky(nn.Module):
    """Keeps an intermediate computed from its parameters outside its outputs.

    ``mode``: "linear" saves a transposed view of the weight (autograd names its ``t()``),
    "mm" saves the full weight itself, "frozen" saves a weight that does not require grad.
    """

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(4, 4)
        self.lin.weight.requires_grad_(mode != "frozen")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner = x @ self.lin.weight if self.mode == "mm" else self.lin(x)
        return x * 2


class _Older(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.old = nn.Sequential(_Leaky(mode), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.old(x)


def _use_after_reshard(rank: int, world: int, mode: str) -> str:
    from fullshard import fully_shard

    # An older model whose forward graph stays alive (as one kept by a reference cycle from an
    # earlier run would): its freed unit 'old.0' is not in the failing backward's graph.
    older = _Older(mode)
    fully_shard(older.old[0])
    fully_shard(older)
    older(torch.randn(3, 4, requires_grad=True))
    model = nn.Sequential(_Leaky(mode), _Leaky(mode), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    model(torch.randn(3, 4, requires_grad=True))
    try:  # backward reaches the unit's saved weight without passing its outputs: the unit is freed
        model[1].inner.sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("mode", "named"),
    [("linear", "FSDP unit '1': "), ("mm", "FSDP unit '1': "), ("frozen", "FSDP unit '1': ")],
)
def test_backward_through_a_resharded_unit_raises_naming_the_unit(mode: str, named: str) -> None:
    # Autograd names the exact unit when the saved tensor is a full parameter itself, or a frozen
    # one (version error); for a view of it (the transposed weight of a Linear), every freed unit
    # whose full parameters the failing backward's graph still reads: '1' only, not '0' (its
    # weight does not reach model[1].inner) nor the older model's 'old.0' (before, both were named,
    # and any freed unit of an earlier test's model still alive in the process).
    for message in run_ranks(functools.partial(_use_after_reshard, mode=mode), 2):
        assert message.startswith(named + "backward needs a tensor saved from the unit's full"), message
        assert "Autograd's error: " in message, message
    # One rank: the full parameters are the shards themselves, never freed; backward just works.
    assert run_ranks(functools.partial(_use_after_reshard, mode=mode), 1) == ["no error"]


def _plain_inplace_error(rank: int, world: int) -> str:
    from fullshard import fully_shard

    fully_shard(nn.Linear(2, 2))  # installs the engine handle that explains uses of freed units
    x = torch.ones(3, requires_grad=True)
    z = (x * 1).exp()  # exp saves its result
    z.add_(1)
    try:
        z.sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_other_inplace_errors_pass_through_unchanged_once_units_exist() -> None:
    for message in run_ranks(_plain_inplace_error, 2):
        assert message.startswith("one of the variables needed for gradient computation has been modified"), message


def _selective_policy():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _wrap(block: nn.Module, wrapper: str, mode: str) -> nn.Module:
    if wrapper == "torch":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    else:
        from fullshard import checkpoint_wrapper
    # early_stop=False as torchtitan: the recomputation runs whole and must save as many tensors
    if mode == "selective":
        return checkpoint_wrapper(block, context_fn=_selective_policy(), early_stop=False)
    return checkpoint_wrapper(block, early_stop=False)


def _torchtitan_like_lm() -> TinyLM:
    """TinyLM with RMSNorm and bias-free MLP layers, as torchtitan's llama blocks: a weight that
    did not require grad in a recomputation changes what it saves (LayerNorm with biases hid it)."""
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    for block in model.layers:
        block.attention_norm, block.ffn_norm = nn.RMSNorm(12), nn.RMSNorm(12)
        block.w1, block.w2 = nn.Linear(12, 48, bias=False), nn.Linear(48, 12, bias=False)
    return model


def _train_ac(rank: int, world: int, lib: str, order: str, wrapper: str, mode: str) -> list[torch.Tensor]:
    fully_shard = _fully_shard(lib)
    model = _torchtitan_like_lm()
    for i, block in enumerate(model.layers):
        if order == "before":  # torchtitan's order: checkpoint_wrapper(block), then fully_shard of it
            model.layers[i] = fully_shard(_wrap(block, wrapper, mode))
        else:
            model.layers[i] = _wrap(fully_shard(block), wrapper, mode)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        ids = tokens(step, 2 * world)[2 * rank : 2 * rank + 2]
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("order", ["before", "after"])
def test_activation_checkpointing_in_either_order_matches_torch(order: str) -> None:
    grid = [(mode, wrapper) for mode in ("full", "selective") for wrapper in (None, "torch", "fullshard")]
    # per mode, one reference run (torch's fully_shard and checkpoint_wrapper), then fullshard's
    # fully_shard with either wrapper
    runs = [(_train_ac, "torch" if w is None else "fullshard", order, w or "torch", mode) for mode, w in grid]
    results = run_ranks(_in_turn, 2, runs)[0]
    for (mode, wrapper), got in zip(grid, results):
        if wrapper is None:
            ref = got
            continue
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (order, wrapper, mode)


def _train_with_eval(rank: int, world: int, lib: str) -> list[torch.Tensor]:
    fully_shard = _fully_shard(lib)
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(STEPS):
        ids = tokens(step, 2 * world)[2 * rank : 2 * rank + 2]
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation between steps, as the training jobs run one
            out.append(model(ids))
    model.reshard()  # torch's root stays gathered after a no-grad forward
    return out + [p.full_tensor() for p in model.parameters()]


def test_evaluation_between_steps_leaves_the_root_ready_for_training() -> None:
    """A no-grad forward of the root must end its pass: the next training forward gathers
    parameters that require grad again (found by the GPT job's resume test)."""
    ref, got = run_ranks(_in_turn, 2, [(_train_with_eval, "torch"), (_train_with_eval, "fullshard")])[0]
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
