"""Cases of parameters that backward uses on some ranks only, drawn at random from a seed.

Rank-dependent control flow (MoE routing, an embedding whose tokens only some ranks see, a
branch one rank takes) leaves some parameters without a gradient on some ranks. docs/api.md
("used on some ranks only", ``set_reduce_scatter_unused_params``) states what fullshard promises
there; :func:`draw` ``(seed, n)`` draws ``n`` cases inside that contract with
``random.Random(seed)`` and two generators per case (``draw(seed, m)`` is the first ``m`` of
``draw(seed, n)``), :mod:`fullshard.jobs.planning.unused_model` builds its model, and
:mod:`fullshard.jobs.planning.unused_check` runs one on every rank against an unsharded model.

Vocabulary. A *block* is one residual layer of the drawn model (:class:`Blocks`) made of named
*parts* (submodules); per step, micro-batch and rank its *use* is the tuple of parts whose output
reaches the loss, or None: the block is *skipped* there (its forward runs, or for a block the
root owns may not run at all, and its output is dropped). A *unit* is a module wrapped with
``fully_shard``: a whole block, each expert of an ``experts`` block, and always the root (each
of the two roots of a split case: below, "the root" is the root of the block's tree). A unit
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
  rank, outside docs/api.md's limits); such a root reshards after backward as by default (until
  2026-11-29 the check kept it gathered through backward: resharded in its post-backward inside
  the block's nested backward, it ran a second checkpointed block's recomputation on its shards,
  seed 20261129 case 36, or failed where a block it owns ran before the checkpointed one, seed
  730001 case 6; its gradient from the nested backward now waits for the rest of its own); and
  where the root is not flagged, from a fourth generator (a case it leaves alone is as it was),
  a block of the root's that every rank uses in every step in a reentrant checkpoint 40% of the
  time, since 2026-11-29 (one used on some ranks only reduce-scatters the root a different
  number of times per rank: outside docs/api.md's limits);
- other units are flagged or kept gathered at random; a unit touched on every rank or none may
  be unflagged, so its parameters used on some ranks only get a ``.grad`` on every rank, and
  those no rank used keep None;
- 40% of the cases (from a third generator per case, drawn after every other draw, so a case
  not split is exactly as before) are split in two roots, as ``dec(enc(x))``: the first ``k``
  blocks under one root (``enc``, flagged as the single root would be, holding its spare), the
  other blocks and the head under a second (``dec``, flagged 40% of the time); the top-level
  module is not wrapped. Each tree keeps the limits above on its own: ``k`` is drawn among the
  splits where ``enc``'s output requires grad on every rank in every micro-batch (a tree whose
  forward has grad, and whose backward comes, on some ranks only is outside docs/api.md's
  limits: the other root's turns would wait on some ranks only) and, where ``enc``'s root is
  not flagged, the blocks it owns are touched on every rank or on none in each micro-batch;
  ``dec`` is flagged wherever it owns a block in a reentrant checkpoint (``enc`` does only where
  its root is flagged, as drawn). Where no ``k`` fits, the case keeps one root.

Drawn per case: world size 2, 3 or 4 (HSDP on a 2x2 mesh at 4, half the time), hidden width 5,
7 or 13, 2-4 blocks, bf16 mixed precision (values made bfloat16's), 1 or 2 micro-batches per
step (gradient sync off for the first), ``zero_grad(set_to_none=True)`` between steps or not,
SGD with momentum or AdamW, ``clip_grad_norm_`` with a max norm that clips or one that does not,
and one root or two.
"""

from __future__ import annotations

import dataclasses
import random

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
    ``clip_grad_norm_``; ``prefetch_off``: every unit gets ``set_modules_to_backward_prefetch([])``.
    ``split``: 0 (one root, the whole model) or ``k``: the first ``k`` blocks under one root
    (``enc``, flagged where ``root_flagged``, holding the spare), the other blocks and the head
    under a second (``dec``, flagged where ``root2_flagged``), run as ``dec(enc(x))``."""

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
    split: int = 0
    root2_flagged: bool = False

    def tree(self, index: int) -> str:
        """The module path of block ``index``'s root: ``""`` (the model), ``enc`` or ``dec``."""
        return "" if not self.split else "enc" if index < self.split else "dec"

    def unit_names(self, index: int) -> tuple[str, ...]:
        """Block ``index``'s units' module paths in the model (``enc.``/``dec.`` in front where split)."""
        tower = self.tree(index) + "." if self.split else ""
        return tuple(tower + name for name in self.blocks[index].unit_names(index))

    def describe(self) -> str:
        """One line: the settings (``root:`` the first root's flag and spare; ``roots:2@k:F``: split
        after ``k`` blocks, the second root flagged), then each block's :meth:`Block.describe`."""
        head = [f"#{self.index}", f"h{self.hidden}", "hsdp" if self.hsdp else "", "bf16" if self.mixed else ""]
        head += [f"acc{self.micro}" if self.micro > 1 else "", "" if self.zero_grad else "no-zero", self.optim]
        head += [
            f"clip{self.clip:g}",
            "root:" + ("F" if self.root_flagged else "-") + ("+spare" if self.root_spare else ""),
        ]
        head += ["no-prefetch" if self.prefetch_off else "", "xgrad" if self.input_grad else ""]
        head += [f"roots:2@{self.split}:" + ("F" if self.root2_flagged else "-") if self.split else ""]
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


def _feeds(b: Block, use: Use) -> bool:
    """Whether ``b``'s output requires grad on a rank whose use is ``use`` though its input does
    not: some used part has a trainable parameter."""
    return use is not None and bool(use) and not b.frozen


def splits_at(blocks: tuple[Block, ...], k: int, input_grad: bool, root_flagged: bool) -> bool:
    """Whether the first ``k`` blocks may be a root of their own (``enc`` of ``dec(enc(x))``):
    its output requires grad on every rank in every micro-batch (every rank's backward reaches
    that tree, and every rank counts its forward as one with grad), and where its root is not
    flagged, the blocks it owns are touched on every rank or on none in each micro-batch."""
    first = blocks[:k]
    for step in range(STEPS):
        for micro, ranks in enumerate(first[0].uses[step]):
            uses = [[b.uses[step][micro][r] for b in first] for r in range(len(ranks))]
            if not all(input_grad or any(_feeds(b, u) for b, u in zip(first, us)) for us in uses):
                return False
            touched = {any(b.wrap == "none" and _feeds(b, u) for b, u in zip(first, us)) for us in uses}
            if len(touched) > 1 and not root_flagged:
                return False
    return True


def _split(rnd: random.Random, blocks: tuple[Block, ...], input_grad: bool, root_flagged: bool) -> tuple[int, bool]:
    """``(k, flagged)``: 40% of the time, a ``k`` where :func:`splits_at` holds (0: one root, also
    where none does); the second root flagged 40% of the time, and always where it owns a block
    in a reentrant checkpoint (drawn only under a flagged root: see :func:`_freeze_or_checkpoint`).
    Its blocks' units are drawn as before: a unit's limits do not depend on its tree."""
    wanted, flagged = rnd.random() < 0.4, rnd.random() < 0.4
    fits = [k for k in range(1, len(blocks)) if splits_at(blocks, k, input_grad, root_flagged)]
    if not (wanted and fits):
        return 0, False
    k = rnd.choice(fits)
    return k, flagged or any(b.ckpt for b in blocks[k:])


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
    if input_grad and not root_flagged:  # from a fourth generator: a case it leaves alone is as it was
        ck = random.Random(seed * 1_000_037 + index)
        blocks = tuple(
            dataclasses.replace(b, ckpt=True) if b.wrap == "none" and b.habit == "always" and ck.random() < 0.4 else b
            for b in blocks
        )
    blocks = tuple(_keep_unless_everywhere(b, input_grad) for b in blocks)  # see the module's docstring
    prefetch_off = needy or rng.random() < 0.3
    zero_grad, optim, clip = rng.random() < 0.75, rng.choice(OPTIMIZERS), rng.choice((1e9, 0.05))
    # From a third generator, after every other draw (so a case not split is as it was): two roots
    split, root2_flagged = _split(random.Random(seed * 1_000_033 + index), blocks, input_grad, root_flagged)
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
        split,
        root2_flagged,
    )


def draw(seed: int, n: int) -> list[Case]:
    """``n`` cases drawn from ``random.Random(seed)``, one after another."""
    rng = random.Random(seed)
    return [_case(rng, seed, i) for i in range(n)]


def case_at(seed: int, index: int) -> Case:
    """Case ``index`` of :func:`draw` ``(seed, index + 1)``."""
    return draw(seed, index + 1)[index]
