"""Cases of parameters that backward uses on some ranks only, drawn at random from a seed.

Rank-dependent control flow (MoE routing, an embedding whose tokens only some ranks see, a
branch one rank takes) leaves some parameters without a gradient on some ranks. docs/api.md
("used on some ranks only", ``set_reduce_scatter_unused_params``) states what fullshard promises
there; :func:`draw` ``(seed, n)`` draws ``n`` cases inside that contract with
``random.Random(seed)`` alone (``draw(seed, m)`` is the first ``m`` of ``draw(seed, n)``), and
:mod:`fullshard.jobs.planning.unused_check` runs one on every rank against an unsharded model.

Vocabulary. A *block* is one residual layer of the drawn model (:class:`Blocks`) made of named
*parts* (submodules); per step, micro-batch and rank its *use* is the tuple of parts whose output
reaches the loss, or None: the block is *skipped* there (its forward runs, or for a block the
root owns may not run at all, and its output is dropped). A *unit* is a module wrapped with
``fully_shard``: a whole block, each expert of an ``experts`` block, and always the root. A unit
is *touched* on a rank when some parameter of it reaches that rank's loss. Each case keeps to
the documented limits:

- every unit runs forward on every rank (a block that may skip its forward is the root's);
- a unit touched on some ranks but not all, in any micro-batch, is flagged
  (``set_reduce_scatter_unused_params(True)``), kept gathered after forward
  (``reshard_after_forward=False``), and no unit prefetches in backward
  (``set_modules_to_backward_prefetch([])`` on every unit);
- only a unit touched on every rank in every micro-batch may reshard after forward (at random);
  every other unit is kept gathered. One touched on no rank is still reached by backward on a
  rank where its input requires grad (its pre-backward hook all-gathers it there), so it may be
  reached on some ranks only. A resharded unit all-gathers in backward, and a tree with a flagged
  unit then reduces at backward's end (until a fix on 2026-11-29 the reductions and that
  all-gather paired crosswise, found by this sweep, and every unit had to be kept gathered once
  some unit was touched on some ranks only);
- half the cases give the model an input that requires grad: then every rank's backward reaches
  a whole-block unit no rank skips (its output requires grad), and such a unit, flagged, may
  reshard after forward (half the time) though its parameters get a gradient on some ranks only
  (a gate: until a fix on 2026-11-29 its reduction paired crosswise with an all-gather); a
  block whose parts no rank's use names returns a new tensor (``h * 1.0``), not its input;
- with such an input, also a whole-block unit frozen 35% of the time (never flagged;
  resharded after forward 70% of the time where no rank skips it: it all-gathers in backward
  without a turn), and where the root is flagged, a block of the root's run in a reentrant
  checkpoint 60% of the time (the root's post-backward may then come early, inside the nested
  backward, on some ranks: with a frozen unit's all-gather, what a review found on 2026-11-29;
  an unflagged root reached twice on some ranks only reduces a different number of times per
  rank, outside docs/api.md's limits); such a root keeps its full parameters through backward
  (``set_reshard_after_backward(False)``, as docs/api.md asks of a unit reached twice; the check
  reshards it after each optimizer step): resharded in its first post-backward, a second
  checkpointed block's recomputation ran with its shards (seed 20261129, case 36);
- other units are flagged or kept gathered at random; a unit touched on every rank or none may
  be unflagged, so its parameters used on some ranks only get a ``.grad`` on every rank, and
  those no rank used keep None.

Drawn per case: world size 2, 3 or 4 (HSDP on a 2x2 mesh at 4, half the time), hidden width 5,
7 or 13, 2-4 blocks, bf16 mixed precision (values made bfloat16's), 1 or 2 micro-batches per
step (gradient sync off for the first), ``zero_grad(set_to_none=True)`` between steps or not,
SGD with momentum or AdamW, ``clip_grad_norm_`` with a max norm that clips or one that does not.
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.utils.checkpoint
from torch import nn

KINDS = ("dense", "branch", "experts", "embed")
HABITS = ("always", "routed", "branch", "skippy")
OPTIMIZERS = ("sgd", "adamw")
STEPS = 3
Use = tuple[str, ...] | None  # the parts that reach the loss; None: the block is skipped


@dataclasses.dataclass(frozen=True)
class Block:
    """One drawn block.

    Attributes:
        kind: one of :data:`KINDS`; parts: its parts' names; width: the inner width of its
            two-layer parts; vocab: an ``embed`` block's table rows (0 elsewhere).
        wrap: ``none`` (the root's), ``block`` (a unit), ``parts`` (each expert a unit).
        habit: how its uses were drawn (one of :data:`HABITS`), for the description.
        spare: it holds a parameter no forward uses.
        drop_forward: a skipped block does not run forward at all (``wrap == "none"`` only).
        uses: ``uses[step][micro][rank]``; tokens: the same for an ``embed`` block's token ids
            (``batch`` of them in ``[0, vocab)``), empty tuples elsewhere.
        flagged, kept: per unit of the block (one, or one per part; none where ``wrap ==
            "none"``), ``set_reduce_scatter_unused_params(True)`` and ``reshard_after_forward=False``.
        frozen: a ``block`` unit whose parameters do not require grad (never flagged).
        ckpt: a block of the root's that runs in a reentrant activation checkpoint when used.
    """

    kind: str
    parts: tuple[str, ...]
    width: int
    vocab: int
    wrap: str
    habit: str
    spare: bool
    drop_forward: bool
    uses: tuple[tuple[tuple[Use, ...], ...], ...]
    tokens: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    flagged: tuple[bool, ...] = ()
    kept: tuple[bool, ...] = ()
    frozen: bool = False
    ckpt: bool = False

    def unit_names(self, index: int) -> tuple[str, ...]:
        """The module paths of its units inside the model (``index``: its place in the model)."""
        if self.wrap == "block":
            return (f"blocks.{index}",)
        if self.wrap == "parts":
            return tuple(f"blocks.{index}.parts.{p}" for p in self.parts)
        return ()

    def touched(self, unit: int, use: Use) -> bool:
        """Whether unit ``unit`` of the block gets a gradient on a rank whose use is ``use``."""
        if use is None or self.frozen:
            return False
        return bool(use) if self.wrap == "block" else self.parts[unit] in use

    def describe(self) -> str:
        """E.g. ``experts3/parts:routed(FK,F,-)`` (F flagged, K kept gathered)."""
        marks = ",".join(("F" if f else "") + ("K" if k else "") or "-" for f, k in zip(self.flagged, self.kept))
        name = f"{self.kind}{len(self.parts) if self.kind == 'experts' else ''}/{self.wrap}:{self.habit}"
        extra = ("+spare" if self.spare else "") + ("+noforward" if self.drop_forward else "")
        extra += ("+frozen" if self.frozen else "") + ("+ckpt" if self.ckpt else "")
        return name + (f"({marks})" if marks else "") + extra


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn case: where it came from (``seed``, ``index``), the model (``hidden`` width,
    ``blocks``, ``root_spare``: the root holds a parameter no forward uses), one rank's batch,
    and the settings (see the module's docstring). ``clip``: the max norm given to
    ``clip_grad_norm_``; ``prefetch_off``: every unit gets ``set_modules_to_backward_prefetch([])``."""

    seed: int
    index: int
    world: int
    hsdp: bool
    hidden: int
    batch: int
    blocks: tuple[Block, ...]
    root_flagged: bool
    root_spare: bool
    prefetch_off: bool
    mixed: bool
    micro: int
    zero_grad: bool
    optim: str
    clip: float
    input_grad: bool = False

    def describe(self) -> str:
        """One line: the settings, then each block's :meth:`Block.describe`."""
        head = [f"#{self.index}", f"h{self.hidden}", "hsdp" if self.hsdp else "", "bf16" if self.mixed else ""]
        head += [f"acc{self.micro}" if self.micro > 1 else "", "" if self.zero_grad else "no-zero", self.optim]
        head += [
            f"clip{self.clip:g}",
            "root:" + ("F" if self.root_flagged else "-") + ("+spare" if self.root_spare else ""),
        ]
        head += ["no-prefetch" if self.prefetch_off else "", "xgrad" if self.input_grad else ""]
        return " ".join(x for x in head if x) + "; " + " ".join(b.describe() for b in self.blocks)


def _use(rng: random.Random, habit: str, parts: tuple[str, ...]) -> Use:
    """One rank's use of a block in one micro-batch, by its habit."""
    if habit == "routed":
        return tuple(p for p in parts if rng.random() < 0.5)
    if habit == "branch":
        return parts[:1] + tuple(p for p in parts[1:] if rng.random() < 0.5)
    if habit == "skippy" and rng.random() < 0.4:
        return None
    return parts


def _uses(rng: random.Random, habit: str, parts: tuple[str, ...], world: int, micro: int) -> list[list[list[Use]]]:
    """``uses[step][micro][rank]``; a tenth of the micro-batches no rank uses the block."""
    out: list[list[list[Use]]] = []
    for _ in range(STEPS):
        out.append([])
        for _ in range(micro):
            nobody = rng.random() < 0.1
            out[-1].append([None if nobody else _use(rng, habit, parts) for _ in range(world)])
    return out


def _tokens(rng: random.Random, vocab: int, world: int, micro: int, batch: int) -> tuple:
    """Token ids per step, micro-batch and rank, each rank from its own window of rows (so some
    rows get no gradient on some ranks, or on any)."""
    windows = [(rng.randrange(vocab), rng.randint(1, max(1, vocab // 2))) for _ in range(world)]
    return tuple(
        tuple(
            tuple(tuple((lo + rng.randrange(span)) % vocab for _ in range(batch)) for lo, span in windows)
            for _ in range(micro)
        )
        for _ in range(STEPS)
    )


def _parts(rng: random.Random, kind: str) -> tuple[str, ...]:
    if kind == "experts":
        return tuple(f"e{i}" for i in range(rng.randint(2, 4)))
    return {"dense": ("up",), "branch": ("main", "side"), "embed": ("emb", "proj")}[kind]


def _block(rng: random.Random, world: int, micro: int, batch: int) -> Block:
    """A block, its uses and its units' settings (forced where the contract needs them)."""
    kind = rng.choice(KINDS)
    parts = _parts(rng, kind)
    width, vocab = rng.choice((5, 7, 9, 13)), rng.choice((7, 11, 13)) if kind == "embed" else 0
    wrap = rng.choices(("none", "block", "parts"), (3, 5, 3 if kind == "experts" else 0))[0]
    habit = rng.choice(HABITS)
    spare, drop = rng.random() < 0.3, wrap == "none" and rng.random() < 0.5
    uses = _uses(rng, habit, parts, world, micro)
    tokens = _tokens(rng, vocab, world, micro, batch) if kind == "embed" else ()
    b = Block(kind, parts, width, vocab, wrap, habit, spare, drop, _frozen(uses), tokens)
    flagged, kept = [], []
    for u in range(len(b.unit_names(0))):
        needy = _needy(b, u, world)
        flagged.append(needy or rng.random() < 0.4)
        kept.append(needy or rng.random() < 0.3)
    return dataclasses.replace(b, flagged=tuple(flagged), kept=tuple(kept))


def _frozen(uses: list[list[list[Use]]]) -> tuple[tuple[tuple[Use, ...], ...], ...]:
    return tuple(tuple(tuple(ranks) for ranks in step) for step in uses)


def _needy(b: Block, unit: int, world: int) -> bool:
    """Whether unit ``unit`` of ``b`` is touched on some ranks but not all in some micro-batch."""
    return any(0 < sum(b.touched(unit, use) for use in ranks) < world for step in b.uses for ranks in step)


def _keep_unless_everywhere(b: Block, gates: bool = False) -> Block:
    """``b`` with every unit kept gathered but those touched on every rank in every micro-batch,
    and with ``gates`` (the model's input requires grad), a flagged block unit that no rank
    skips (every rank's backward reaches it) left as drawn."""
    everywhere = [
        all(b.touched(u, use) for step in b.uses for ranks in step for use in ranks) for u in range(len(b.kept))
    ]
    gate = [gates and (_gate(b, u) or (b.frozen and _unskipped(b))) for u in range(len(b.kept))]
    return dataclasses.replace(b, kept=tuple(k or not (e or g) for k, e, g in zip(b.kept, everywhere, gate)))


def _unskipped(b: Block) -> bool:
    """Whether no rank skips ``b`` in any micro-batch (its output reaches every rank's loss)."""
    return all(use is not None for step in b.uses for r in step for use in r)


def _gate(b: Block, unit: int) -> bool:
    """Whether unit ``unit`` of ``b`` is a flagged whole block that no rank skips in any
    micro-batch: where the model's input requires grad, every rank's backward reaches it (its
    output requires grad), though its parameters may get a gradient on some ranks only."""
    return b.wrap == "block" and b.flagged[unit] and _unskipped(b)


def _freeze_or_checkpoint(b: Block, aux: random.Random, root_flagged: bool) -> Block:
    """With an input that requires grad: a ``block`` unit frozen 35% of the time (unflagged;
    where no rank skips it, resharded after forward 70% of the time: backward all-gathers it on
    every rank without a turn), and where the root is flagged, a block of the root's checkpointed
    (reentrant) 60% of the time: the root's post-backward then comes twice on the ranks that use
    the block, once on the others, which only a flagged tree's late round evens out."""
    if b.wrap == "block" and aux.random() < 0.35:
        kept = not (_unskipped(b) and aux.random() < 0.7)
        return dataclasses.replace(b, frozen=True, flagged=(False,), kept=(kept,))
    if b.wrap == "none" and root_flagged and aux.random() < 0.6:
        return dataclasses.replace(b, ckpt=True)
    return b


def _ungate(b: Block, aux: random.Random) -> Block:
    """``b`` with each gate unit (:func:`_gate`) resharded after forward half the time."""
    kept = tuple(k and not (_gate(b, u) and aux.random() < 0.5) for u, k in enumerate(b.kept))
    return dataclasses.replace(b, kept=kept)


def _case(rng: random.Random, seed: int, index: int) -> Case:
    world = rng.choice((2, 3, 4))
    hsdp = world == 4 and rng.random() < 0.5
    hidden, batch = rng.choice((5, 7, 13)), rng.choice((2, 3))
    mixed, micro = rng.random() < 0.3, rng.choice((1, 1, 2))
    blocks = tuple(_block(rng, world, micro, batch) for _ in range(rng.randint(2, 4)))
    root_flagged, root_spare = rng.random() < 0.4, rng.random() < 0.3
    needy = any(_needy(b, u, world) for b in blocks for u in range(len(b.unit_names(0))))
    # Drawn apart from ``rng`` (whose stream the earlier draws of every seed keep): whether the
    # input requires grad, and then which flagged gate units reshard after forward.
    aux = random.Random(seed * 1_000_003 + index)
    input_grad = aux.random() < 0.5
    if input_grad:
        blocks = tuple(_freeze_or_checkpoint(_ungate(b, aux), aux, root_flagged) for b in blocks)
    blocks = tuple(_keep_unless_everywhere(b, input_grad) for b in blocks)  # see the module's docstring
    prefetch_off = needy or rng.random() < 0.3
    zero_grad, optim, clip = rng.random() < 0.75, rng.choice(OPTIMIZERS), rng.choice((1e9, 0.05))
    return Case(
        seed,
        index,
        world,
        hsdp,
        hidden,
        batch,
        blocks,
        root_flagged,
        root_spare,
        prefetch_off,
        mixed,
        micro,
        zero_grad,
        optim,
        clip,
        input_grad,
    )


def draw(seed: int, n: int) -> list[Case]:
    """``n`` cases drawn from ``random.Random(seed)``, one after another."""
    rng = random.Random(seed)
    return [_case(rng, seed, i) for i in range(n)]


def case_at(seed: int, index: int) -> Case:
    """Case ``index`` of :func:`draw` ``(seed, index + 1)``."""
    return draw(seed, index + 1)[index]


class DrawnBlock(nn.Module):
    """A :class:`Block` as a module: ``now`` (a :data:`Use` and token ids) says what the next
    forward adds to its input ``h`` ``(batch, hidden)``: each used part's output, through GELU
    (an embedding's rows as they are). An ``experts`` block runs every expert (so every expert
    unit runs forward on every rank) and adds the used ones'."""

    def __init__(self, b: Block, hidden: int) -> None:
        super().__init__()
        self.kind = b.kind
        self.parts = nn.ModuleDict({p: self._part(p, b, hidden) for p in b.parts})
        if b.spare:
            self.spare = nn.Parameter(torch.randn(hidden))
        self.now: tuple[Use, tuple[int, ...]] = (b.parts, ())

    @staticmethod
    def _part(name: str, b: Block, hidden: int) -> nn.Module:
        if name == "emb":
            return nn.Embedding(b.vocab, hidden)
        if name in ("main", "proj") or (b.kind == "experts" and name == "e0"):
            return nn.Linear(hidden, hidden)
        return nn.Sequential(nn.Linear(hidden, b.width), nn.GELU(), nn.Linear(b.width, hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        use, tokens = self.now
        chosen = self.parts.keys() if use is None else use  # skipped: runs, output dropped
        if self.kind == "experts":
            outs = {name: part(h) for name, part in self.parts.items()}
        else:
            outs = {name: self.parts[name](torch.tensor(tokens) if name == "emb" else h) for name in chosen}
        out = h
        for name in chosen:
            out = out + (outs[name] if name == "emb" else nn.functional.gelu(outs[name]))
        # A new tensor also where no part is used: a unit returning its input itself would give
        # its pre-backward hook and the previous unit's one tensor (see docs/api.md)
        return out if out is not h else h * 1.0


class Blocks(nn.Module):
    """The drawn model: ``x`` ``(batch, hidden)`` through the blocks in turn (a block whose use
    is None leaves ``h`` as it was), then a ``hidden -> 2`` head; the root may hold a parameter
    no forward uses."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DrawnBlock(b, case.hidden) for b in case.blocks])
        for block, b in zip(self.blocks, case.blocks):
            if b.frozen:
                block.requires_grad_(False)
        self.drop_forward = [b.drop_forward for b in case.blocks]
        self.ckpt = [b.ckpt for b in case.blocks]
        self.head = nn.Linear(case.hidden, 2)
        if case.root_spare:
            self.spare = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block, drop, ckpt in zip(self.blocks, self.drop_forward, self.ckpt):
            use: Use = block.now[0]  # type: ignore[index, assignment]
            if use is not None and ckpt:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
            elif use is not None:
                h = block(h)
            elif not drop:
                block(h)
        return self.head(h)


def set_step(model: nn.Module, case: Case, step: int, micro: int, rank: int) -> None:
    """Give each block of ``model`` (a :class:`Blocks`, sharded or not) its use and tokens for
    ``step``, ``micro`` on ``rank``."""
    for block, b in zip(model.blocks, case.blocks):  # type: ignore[arg-type]
        block.now = (b.uses[step][micro][rank], b.tokens[step][micro][rank] if b.tokens else ())
