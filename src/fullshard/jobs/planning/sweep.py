"""Configurations for the estimator's generated sweep, drawn at random from a seed.

:func:`draw` ``(seed, n)`` draws ``n`` configurations with ``random.Random(seed)`` alone, one
after another (so ``draw(seed, m)`` is the first ``m`` of ``draw(seed, n)`` for ``m <= n``, and
:func:`config_at` gives one by its index). Each is drawn, never picked:

- a family of ``families`` (default :data:`~fullshard.jobs.planning.families.DRAWN`:
  transformers causal LMs, one of them mixture-of-experts, the project's GPT, the MNIST Net),
  uniformly;
- its shape: 2-4 layers, 2-8 heads of a head size the family's rotary embedding takes (none a
  power of two), key/value heads a divisor of the heads where the family groups them, an MLP of
  2-4 x hidden (MoE: 4-8 experts of 1-2 x hidden, top-1 or top-2, transformers' ``grouped_mm``
  or ``eager`` experts), a vocabulary of 200-1000 tokens, the GPT's embedding tied or not;
  1-8 sequences of 32-128 tokens per rank;
- FULL_SHARD / SHARD_GRAD_OP / NO_SHARD, activation checkpointing none / full / selective
  (:func:`selective_context`), fp32 or bf16 mixed precision, 1, 2 or 4 ranks, and the front end
  (``fsdp1``: the FullyShardedDataParallel wrapper, ``fsdp2``: ``fully_shard``). ``fully_shard``
  takes no NO_SHARD: that pair is drawn again, from the same generator;
- where ``families`` holds a convolutional one (the ResNet, drawn only when asked for), last:
  1-3 stages of odd widths 3-63 (in increasing order), 1-2 residual blocks per stage, 1 or 3
  input channels, images of 12-32 pixels square, 2-20 classes (drawn whatever the family, so
  that the sequence of draws depends on ``families`` only). The default families draw none of
  these, so every seed drawn before the ResNet came keeps its configurations.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from fullshard import compat
from fullshard.jobs.planning.families import DRAWN, FAMILIES, Shape

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
CHECKPOINTING = ("none", "full", "selective")
PRECISIONS = ("fp32", "bf16")
WORLDS = (1, 2, 4)
APIS = ("fsdp1", "fsdp2")
EXPERTS_IMPLS = ("grouped_mm", "eager")
_SHORT = {"full_shard": "FULL", "shard_grad_op": "SGO", "no_shard": "NO"}


@dataclasses.dataclass(frozen=True)
class Config:
    """One drawn configuration: where it came from (``seed``, ``index``), the model
    (``family``, ``shape``), one rank's batch (``batch`` sequences of ``seq`` tokens, or
    ``batch`` images), and the FSDP settings."""

    seed: int
    index: int
    family: str
    shape: Shape
    batch: int
    seq: int
    strategy: str
    ac: str
    precision: str
    world: int
    api: str

    def describe(self) -> str:
        """One short line, e.g. ``7#3 qwen3 L3 5x20/kv1 ffn250 V613 b4x96 | SGO ac=sel bf16 w4 fsdp2``."""
        fam, s = FAMILIES[self.family], self.shape
        if fam.convolutional:
            widths = "/".join(map(str, s.widths))
            model = f"w{widths} x{s.blocks} c{s.channels} {s.image}px K{s.classes} b{self.batch}"
        elif fam.language:
            kv = f"/kv{s.kv_heads}" if fam.gqa else ""
            moe = f" E{s.experts}k{s.top_k}:{s.experts_impl}" if fam.moe else ""
            tied = "" if s.tied or self.family != "gpt" else " untied"
            model = f"L{s.layers} {s.heads}x{s.head_dim}{kv} ffn{s.ffn}{moe} V{s.vocab}{tied} b{self.batch}x{self.seq}"
        else:
            model = f"b{self.batch}"
        ac = {"none": "", "full": " ac=full", "selective": " ac=sel"}[self.ac]
        run = f"{_SHORT[self.strategy]}{ac} {self.precision} w{self.world} {self.api}"
        return f"{self.seed}#{self.index} {self.family} {model} | {run}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shape(rng: random.Random, family: str) -> Shape:
    """A shape for ``family`` (every draw made whatever the family, so the sequence of draws
    does not depend on it)."""
    fam = FAMILIES[family]
    layers, heads = rng.randint(2, 4), rng.randint(2, 8)
    head_dim = rng.choice(fam.head_dims)
    kv = rng.choice(_divisors(heads))
    hidden = heads * head_dim
    ffn_dense, ffn_expert = rng.randint(2 * hidden, 4 * hidden), rng.randint(hidden, 2 * hidden)
    experts, top_k, impl = rng.randint(4, 8), rng.randint(1, 2), rng.choice(EXPERTS_IMPLS)
    vocab, tied = rng.randint(200, 1000), rng.random() < 0.5
    return Shape(
        layers=layers,
        heads=heads,
        kv_heads=kv if fam.gqa else heads,
        head_dim=head_dim,
        ffn=ffn_expert if fam.moe else ffn_dense,
        vocab=vocab,
        experts=experts if fam.moe else 0,
        top_k=top_k if fam.moe else 0,
        experts_impl=impl if fam.moe else "",
        tied=tied if family == "gpt" else True,
    )


def _images(rng: random.Random, shape: Shape) -> Shape:
    """``shape`` with the ResNet's sizes drawn (see the module docstring)."""
    stages, blocks = rng.randint(1, 3), rng.randint(1, 2)
    widths = sorted(rng.randrange(3, 64, 2) for _ in range(3))
    channels, image, classes = rng.choice((1, 3)), rng.randint(12, 32), rng.randint(2, 20)
    return dataclasses.replace(
        shape, widths=tuple(widths[:stages]), blocks=blocks, channels=channels, image=image, classes=classes
    )


def _one(rng: random.Random, seed: int, index: int, families: tuple[str, ...] = DRAWN) -> Config:
    family = rng.choice(families)
    shape = _shape(rng, family)
    batch, seq = rng.randint(1, 8), rng.randint(32, 128)
    while True:  # fully_shard has no NO_SHARD: draw the pair again
        strategy, api = rng.choice(STRATEGIES), rng.choice(APIS)
        if not (api == "fsdp2" and strategy == "no_shard"):
            break
    ac, precision, world = rng.choice(CHECKPOINTING), rng.choice(PRECISIONS), rng.choice(WORLDS)
    if any(FAMILIES[f].convolutional for f in families):
        drawn = _images(rng, shape)
        shape = drawn if FAMILIES[family].convolutional else shape
    return Config(seed, index, family, shape, batch, seq, strategy, ac, precision, world, api)


def draw(seed: int, n: int, families: tuple[str, ...] = DRAWN) -> list[Config]:
    """``n`` configurations drawn from ``random.Random(seed)`` among ``families`` (names of
    :data:`~fullshard.jobs.planning.families.FAMILIES`, in the order given: the order is part
    of the draw; see the module docstring).

    Raises:
        ValueError: ``n`` < 0, or ``families`` empty or naming an unknown family.
    """
    if n < 0:
        raise ValueError(f"n={n}: draw 0 configurations or more")
    unknown = [f for f in families if f not in FAMILIES]
    if not families or unknown:
        raise ValueError(f"families={families!r}: name one or more of {', '.join(FAMILIES)}")
    rng = random.Random(seed)
    return [_one(rng, seed, i, tuple(families)) for i in range(n)]


def config_at(seed: int, index: int, families: tuple[str, ...] = DRAWN) -> Config:
    """The configuration ``draw(seed, index + 1, families)[index]``, e.g. to rerun one row of a sweep."""
    return draw(seed, index + 1, families)[index]


def selective_context() -> Any:
    """The sweep's selective activation checkpointing, a ``context_fn`` for
    ``checkpoint_wrapper``: torch's ``create_selective_checkpoint_contexts`` saving the outputs
    of matrix products (``mm``, ``addmm``, ``bmm``) and attention kernels, recomputing the rest
    (norms, activations, elementwise ops, MoE grouped products)."""
    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved = [
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        *(kernel.default for kernel in compat.sdpa_kernels().values()),
    ]
    return create_selective_checkpoint_contexts(saved)
