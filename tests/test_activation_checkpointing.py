"""Activation checkpointing inside and outside FSDP units: same results, less memory."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import Block, batch, local, make_stack, step_both
from torch import nn


def parity_body(rank: int, world: int) -> list[str]:
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_ac

    from fullshard import (
        FSDP,
        CheckpointWrapper,
        StateDictType,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from fullshard.frontend.wrap import ModuleWrapPolicy

    done = []
    for placement in ("inside", "outside", "offload", "torch's inside", "torch's before wrapping"):
        ref = make_stack()
        model = copy.deepcopy(ref)
        if placement == "torch's inside":  # pytorch/examples' T5: wrap, then torch's checkpointing
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
            torch_ac.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        elif placement == "torch's before wrapping":  # torch's checkpointing, then FSDP over its wrappers
            torch_ac.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({torch_ac.CheckpointWrapper}))
        elif placement == "inside":  # FSDP(CheckpointWrapper(Block)): applied after wrapping
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
            assert isinstance(model.blocks[0].module, CheckpointWrapper)
        elif placement == "outside":  # CheckpointWrapper(FSDP(Block))
            blocks = model.blocks
            for i in range(len(blocks)):
                blocks[i] = checkpoint_wrapper(FSDP(blocks[i]))
            model = FSDP(model)
        else:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block), offload_to_cpu=True)
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({CheckpointWrapper}))
        assert [k for k, _ in model.named_parameters()] == [k for k, _ in ref.named_parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            step_both(model, opt, ref, ref_opt, step, rank, world)
        full = model.state_dict()
        assert list(full) == list(ref.state_dict())
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{placement} {k}: {m}")
        for kind in (StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
            with FSDP.state_dict_type(model, kind):
                assert list(model.state_dict()) == list(ref.state_dict()), (placement, kind)
        model.load_state_dict(ref.state_dict())  # the plain model's names load back
        done.append(placement)
    return done


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_checkpointing_parity(world: int) -> None:
    assert run_ranks(parity_body, world, timeout=180)[0] == [
        "inside",
        "outside",
        "offload",
        "torch's inside",
        "torch's before wrapping",
    ]


def test_seed_example_runs_on_one_rank_without_fsdp() -> None:
    from fullshard import checkpoint_wrapper

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    model = nn.Sequential(checkpoint_wrapper(Layer(), offload_to_cpu=True), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    assert list(model.state_dict()) == ["0.lin.weight", "0.lin.bias", "1.weight", "1.bias"]
    assert model[0].lin.weight.grad is not None


class Wide(nn.Module):
    """Blocks whose intermediate activations are 9x their input: recomputation pays off."""

    def __init__(self, d: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(depth)
        )

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def peak_body(rank: int, world: int, checkpointed: bool) -> dict:
    """Peak RSS of two training steps of a 12-block ``Wide``, with or without activation checkpointing."""
    from fullshard import FSDP, apply_activation_checkpointing, peak_rss_bytes
    from fullshard.frontend.wrap import ModuleWrapPolicy

    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = FSDP(Wide(depth=12), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    if checkpointed:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Sequential))
    for _ in range(2):
        model(x).sum().backward()
    return {"peak": peak_rss_bytes(), "grads": [p.grad for p in model.parameters()]}


@pytest.mark.timeout(200)
def test_checkpointing_lowers_activation_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each variant in its own process, with freed blocks handed back to the OS at once, so
    # peak RSS follows the live tensors (glibc would otherwise keep and reuse freed activations
    # depending on its allocation history: one process running both varied by 60-170 MiB).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    checkpointed = run_ranks(peak_body, 1, True, timeout=180, fresh=True)[0]
    plain = run_ranks(peak_body, 1, False, timeout=180, fresh=True)[0]
    # Without checkpointing each of 12 blocks keeps ~9 x 4 MiB of activations (~430 MiB); with
    # it, only each block's 4 MiB input and one block's recomputation at a time. The plain run
    # must need well over 100 MiB more (measured here: 278 MiB, the same in every run).
    extra = plain["peak"] - checkpointed["peak"]
    assert extra > 100 * 2**20, extra
    for a, b in zip(checkpointed["grads"], plain["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def recompute_prefetch_body(rank: int, world: int) -> list[int]:
    """Recomputation under activation checkpointing prefetches nothing extra: as many
    all-gathers with forward_prefetch as without, in each strategy."""

    from fullshard import FSDP, ShardingStrategy, checkpoint_wrapper, probes

    counts = []
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for prefetch in (False, True):
            m = make_stack()
            for i in range(len(m.blocks)):
                m.blocks[i] = checkpoint_wrapper(
                    FSDP(m.blocks[i], forward_prefetch=prefetch, sharding_strategy=ShardingStrategy[strategy])
                )
            m = FSDP(m, forward_prefetch=prefetch, sharding_strategy=ShardingStrategy[strategy])
            for _ in range(2):  # the second step has a recorded forward order to prefetch from
                with probes.enabled(events=True) as p:
                    m(local(batch(0, 8)[0], rank, world)).sum().backward()
            counts.append(sum(e == "unshard" for e, _ in p.events or []))
    return counts


@pytest.mark.timeout(200)
def test_recomputation_prefetches_nothing_extra() -> None:
    counts = run_ranks(recompute_prefetch_body, 2, timeout=180)[0]
    assert counts[0] == counts[1] and counts[2] == counts[3], counts


def selective_fully_shard_body(rank: int, world: int, grouped: bool = False) -> list[float]:
    """fully_shard on every GPT block (``grouped``: on pairs of blocks, one unit each), every
    other block checkpointed, against the unwrapped model on the same batch (every rank trains
    on it, so the averaged gradient is its own)."""
    from fullshard import apply_activation_checkpointing, fully_shard
    from fullshard.jobs.models.gpt import GPT, PRESETS

    torch.manual_seed(0)
    ref = GPT(PRESETS["tiny"])
    model = copy.deepcopy(ref)
    blocks = list(model.blocks)
    chosen = blocks[1::2] if grouped else blocks[::2]  # grouped: the unit's second member
    apply_activation_checkpointing(model, check_fn=lambda m: any(m is b for b in chosen))
    for unit in [blocks[i : i + 2] for i in range(0, len(blocks), 2)] if grouped else blocks:
        fully_shard(unit)
    fully_shard(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):  # the second forward is where a stopped recomputation used to bite
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
    for (k, v), (_, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(v.full_tensor() if hasattr(v, "full_tensor") else v, r, msg=k)
    return losses


@pytest.mark.timeout(200)
@pytest.mark.parametrize("grouped", [False, True])
def test_selective_checkpointing_under_fully_shard_matches_the_unwrapped_model(grouped: bool) -> None:
    """A recomputation stopped early (torch's non-reentrant checkpoint) must not leave the
    unit's next forward ungathered, also when the checkpointed block is one of a unit's list."""
    losses = run_ranks(selective_fully_shard_body, 2, grouped, timeout=180)[0]
    assert losses[0::2] == pytest.approx(losses[1::2], rel=1e-5)


class _CheckpointedLM(nn.Module):
    """TinyLM whose blocks run through ``torch.utils.checkpoint`` inside the model's forward, as
    HF transformers' gradient checkpointing calls them (``use_reentrant`` chosen per model)."""

    def __init__(self, reentrant: bool) -> None:
        from models import TinyLM

        super().__init__()
        torch.manual_seed(0)
        self.lm, self.reentrant = TinyLM(layers=4), reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        h = lm.tok_embeddings(tokens) + lm.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in lm.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.reentrant)
        return lm.output(lm.norm(h)).float()


def reentrant_body(rank: int, world: int) -> dict[str, list]:
    """Per checkpoint kind: fullshard's gathers per step (probes), its losses and its last
    step's gathers, reductions and pre-backwards in order, with torch's ``fully_shard`` losses
    alongside."""
    import torch.distributed.fsdp as torch_fsdp
    from models import tokens

    import fullshard
    from fullshard import probes

    out: dict[str, list] = {}
    for reentrant in (True, False):
        for name, fully_shard in (("fullshard", fullshard.fully_shard), ("torch", torch_fsdp.fully_shard)):
            model = _CheckpointedLM(reentrant)
            for layer in model.lm.layers:
                fully_shard(layer)
            fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses, gathers = [], []
            for step in range(3):
                with probes.enabled(events=True) as p:
                    loss = model(local(tokens(step, 4), rank, world)).pow(2).mean()
                    loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                gathers.append(sum(e == "unshard" for e, _ in p.events or []))
            order = [f"{e} {n}" for e, n in p.events or [] if e in ("unshard", "reduce", "backward")]
            out[f"{name} reentrant={reentrant}"] = [losses, gathers, order]
    return out


@pytest.mark.timeout(200)
def test_reentrant_checkpointing_gathers_each_unit_once_in_backward() -> None:
    """A reentrant recomputation runs forward inside backward with its own backward right after:
    the unit stays gathered for it (it used to reshard and gather again, and the next unit's
    backward prefetched one already done), so each step gathers as often as non-reentrant."""
    got = run_ranks(reentrant_body, 2, timeout=180)[0]
    ours, plain = got["fullshard reentrant=True"], got["fullshard reentrant=False"]
    assert ours[1] == plain[1] == [9, 9, 9]  # the root and 4 blocks in forward, 4 blocks in backward
    # Backward prefetches as without reentrancy (forward order as recorded: their forward ran
    # without grad), from the second step on: block i-1's all-gather starts as block i's
    # backward does, before block i's reduce-scatter. It used to start at block i-1's
    # recomputation, waited on at once.
    for i in (1, 2, 3):
        gather, reduce = f"unshard lm.layers.{i - 1}", f"reduce lm.layers.{i}"
        for order in (ours[2], plain[2]):
            assert order.index(gather, 5) < order.index(reduce), order
    # The root's backward, first, prefetches the last block (torch's post-forward order).
    for order in (ours[2], plain[2]):
        assert order.index("unshard lm.layers.3", 5) < order.index("backward lm.layers.3"), order
    assert ours[0] == got["torch reentrant=True"][0]
    assert plain[0] == got["torch reentrant=False"][0]
