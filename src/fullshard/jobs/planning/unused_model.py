"""The model of a drawn case of :mod:`fullshard.jobs.planning.unused`, sharded or not.

:func:`build` gives :class:`Blocks` (every block and the head in one module: one root) or, for
a case split in two (``case.split == k``), :class:`TwoRoots`: the first ``k`` blocks under
``enc``, the rest and the head under ``dec``, run as ``dec(enc(x))``; the two have the same
parameters, drawn in the same order (only their names differ: ``enc.``/``dec.`` in front).
:func:`set_step` gives every block its use for a step, micro-batch and rank.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from fullshard.jobs.planning.unused import Block, Case, Use


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
    no forward uses. With ``first``, ``last`` (a tower of a split case): blocks ``first`` to
    ``last - 1`` only, the head only where ``last`` is the last block, no spare (:class:`TwoRoots`
    gives ``enc`` the spare); without a head it returns ``h`` (a new tensor, not ``x`` itself)."""

    def __init__(self, case: Case, first: int = 0, last: int | None = None) -> None:
        super().__init__()
        last = len(case.blocks) if last is None else last
        drawn = case.blocks[first:last]
        # Keyed by the block's index in the case: the names are those of a ModuleList of them all
        self.blocks = nn.ModuleDict({str(first + i): DrawnBlock(b, case.hidden) for i, b in enumerate(drawn)})
        for block, b in zip(self.blocks.values(), drawn):
            if b.frozen:
                block.requires_grad_(False)
        self.drop_forward = [b.drop_forward for b in drawn]
        self.ckpt = [b.ckpt for b in drawn]
        self.head = nn.Linear(case.hidden, 2) if last == len(case.blocks) else None
        if case.root_spare and first == 0 and self.head is not None:
            self.spare = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block, drop, ckpt in zip(self.blocks.values(), self.drop_forward, self.ckpt):
            use: Use = block.now[0]  # type: ignore[index, assignment]
            if use is not None and ckpt:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
            elif use is not None:
                h = block(h)
            elif not drop:
                block(h)
        if self.head is not None:
            return self.head(h)
        return h if h is not x else x * 1.0  # a root returning its input: see DrawnBlock.forward


class TwoRoots(nn.Module):
    """A split case's model: ``dec(enc(x))``, each tower a :class:`Blocks` and its own root
    (the top-level module is not wrapped); the first root, ``enc``, holds the spare."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.enc = Blocks(case, 0, case.split)
        self.dec = Blocks(case, case.split)
        if case.root_spare:  # drawn last, as in Blocks
            self.enc.spare = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def build(case: Case) -> nn.Module:
    """The case's model: :class:`Blocks`, or :class:`TwoRoots` where ``case.split``."""
    return TwoRoots(case) if case.split else Blocks(case)


def set_step(model: nn.Module, case: Case, step: int, micro: int, rank: int) -> None:
    """Give each block of ``model`` (:func:`build`'s, sharded or not) its use and tokens for
    ``step``, ``micro`` on ``rank``."""
    drawn = [m for m in model.modules() if isinstance(m, DrawnBlock)]
    for block, b in zip(drawn, case.blocks, strict=True):
        block.now = (b.uses[step][micro][rank], b.tokens[step][micro][rank] if b.tokens else ())
