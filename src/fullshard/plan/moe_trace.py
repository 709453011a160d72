"""Mixture-of-experts layers of transformers (5.x) on the meta device.

transformers' experts modules (``@use_experts_implementation``: Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, ...) run one of several implementations, chosen by ``config._experts_implementation``:

- ``grouped_mm`` (the default on CPU and CUDA): tokens are sorted by expert and every
  (token, expert) pair becomes one row of a grouped matrix product. Every tensor it allocates
  has ``tokens x top_k`` rows or the experts' full weight shape, whatever the routing, so the
  trace's bytes are the real ones: nothing is assumed. Only the meta kernel of
  ``torch._grouped_mm`` differs from the CPU one (it accepts bfloat16 alone), so for other
  dtypes on meta :func:`grouped_mm` stands in with the same outputs and saved tensors.
- ``eager``: a loop over the experts that the routing hits (``nonzero``), each taking its
  tokens (``torch.where(mask)``), so the shapes *are* the routing, which the meta device does
  not have. :func:`bounded_eager_experts` runs transformers' own loop under an assumed
  routing (:func:`worst_case_rows`) whose bytes are at least any real routing's, and says so.

Why the assumed routing bounds every real one. Let a real routing give expert ``e`` ``n_e``
rows (token, expert pairs) out of ``T`` tokens with top-``k`` routing: ``sum n_e = T k`` and
``n_e <= T`` (top-k picks an expert at most once per token). The loop visits the hit experts in
increasing index order, and backward visits them in reverse. Every tensor an expert's step
allocates has ``n_e`` rows or a size fixed by the model (weight gradients, the input's gradient,
index tensors; the weight slices are views), so at any moment of the layer the bytes alive are
``C + a x (rows of the experts whose saved tensors are alive) + alpha x n_j`` for the expert
``j`` running, where ``a >= 0`` (saved bytes per row) is the same for every expert and moment,
``alpha >= 0`` depends only on where in its step ``j`` is, and ``C`` only on that and on whether
an earlier expert's backward already created the gradient buffers (every expert after the first
in backward adds its weight gradients to them: more bytes, never fewer). In forward the saved
rows are those of the experts before ``j``; in backward those of the experts not yet done. So a
real moment holds at most ``C + a (T k - n_j) + alpha n_j``, which is at most
``C + a T (k - 1) + alpha T`` when ``alpha >= a`` (n_j <= T) and at most ``C + a T k + alpha``
when ``alpha < a`` (n_j >= 1). The assumed routing (:func:`worst_case_rows`) gives the last two
experts 1 row each, the one before them ``T`` and the ones before that ``T (k - 1)`` (``T k``
rows before the last two in all; with three experts the first takes them): while the expert with
``T`` rows runs, ``T (k - 1)`` rows are saved before it (forward) or are still to come (backward,
after the two 1-row experts made the buffers), which covers ``alpha >= a``; while the last-but-one
runs with 1 row, ``T k`` rows are saved before it, which covers ``alpha < a``, the buffers
included. Every expert is hit, so the per-expert constants are counted for all of them, and
outside the layer the trace holds all its saved rows (``T k + 2``) against a real ``T k``. With
two experts or fewer, or ``k = E``, every expert takes ``T`` rows, which dominates any routing
tensor by tensor. Everything else in the step has routing-independent shapes, so the trace's
peak is an upper bound of the real one. The bound is loose by ``a`` x 2 rows plus the moments no
real routing reaches at once; on Mixtral's experts alone, the worst of several hundred routings
drawn to be uneven came within 0-26% of it (median 3%). The hit experts' ids (a few int64) live in
CPU memory in a real step; on meta an equal tensor stands in for them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

BOUND = "activations an upper bound: eager MoE experts traced under an assumed worst-case routing"


def worst_case_rows(tokens: int, top_k: int, experts: int) -> list[int]:
    """Rows per expert of the assumed routing (see the module docstring), ``T`` tokens, ``E``
    experts: 1 row for each of the last two experts, ``T`` for the one before them, and
    ``T x (top_k - 1)`` spread evenly over the others (each at least 1); with three experts the
    first takes ``T x top_k``; every expert ``T`` when there are two or fewer, or when every token
    takes every expert (``top_k = E``: the only routing there is).

    Raises:
        ValueError: ``top_k`` outside ``[1, experts]`` or ``tokens`` < 1.
    """
    if not 1 <= top_k <= experts or tokens < 1:
        raise ValueError(f"tokens={tokens}, top_k={top_k}, experts={experts}: need tokens >= 1, 1 <= top_k <= experts")
    if top_k == experts or experts <= 2:
        return [tokens] * experts
    share = experts - 3
    if not share:
        return [tokens * top_k, 1, 1]
    base, extra = divmod(tokens * (top_k - 1), share)
    return [max(1, base + (i < extra)) for i in range(share)] + [tokens, 1, 1]


class _MetaGroupedMM(torch.autograd.Function):
    """``(S, K) x (G, K, N) -> (S, N)`` on meta for any dtype: the output, and in backward the
    two input gradients, as the CPU kernel allocates them; it keeps no other tensor."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)


def grouped_mm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.nn.functional.grouped_mm`` that runs a meta ``(S, K) x (G, K, N)`` product of a
    dtype the meta kernel refuses (float32) through :class:`_MetaGroupedMM`, refusing, as the
    CPU kernel does, operands whose strides are not multiples of 16 bytes (an expert's hidden or
    intermediate size not a multiple of 4 in float32); anything else goes to ``original``.

    Raises:
        RuntimeError: such a stride, named (the real step fails there too).
    """

    def run(mat_a: torch.Tensor, mat_b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        stand_in = (
            mat_a.is_meta
            and mat_a.dtype != torch.bfloat16
            and (mat_a.dim(), mat_b.dim()) == (2, 3)
            and kwargs.get("bias") is None
            and kwargs.get("out_dtype") is None
        )
        if not stand_in:
            return original(mat_a, mat_b, **kwargs)
        for name, t in (("mat_a", mat_a), ("mat_b", mat_b)):
            odd = [s for s in t.stride() if s != 1 and s * t.element_size() % 16]
            if odd:
                raise RuntimeError(f"grouped_mm: {name} strides {t.stride()} are not all multiples of 16 bytes")
        return _MetaGroupedMM.apply(mat_a, mat_b)

    return run


@contextlib.contextmanager
def _routed(rows: list[int]) -> Iterator[None]:
    """Answer the eager loop's value reads on meta from ``rows`` (rows per expert): the hit
    experts' ids (in CPU memory, as the real ``nonzero`` gives them), then each hit expert's
    ``torch.where(mask)`` (its token and slot indices, meta), in the loop's order."""
    hit = [e for e, n in enumerate(rows) if n]
    counts = iter(rows[e] for e in hit)
    nonzero, where = torch.Tensor.nonzero, torch.where

    def hit_experts(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.is_meta and self.dim() == 1 and not args and not kwargs:
            return torch.tensor(hit, dtype=torch.long).unsqueeze(1)
        return nonzero(self, *args, **kwargs)

    def tokens_of(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return torch.empty((next(counts), args[0].dim()), dtype=torch.long, device="meta").unbind(1)
        return where(*args, **kwargs)

    with mock.patch.object(torch.Tensor, "nonzero", hit_experts), mock.patch.object(torch, "where", tokens_of):
        yield


def bounded_eager_experts(assumed: list[str]) -> Callable[..., torch.Tensor]:
    """The ``eager`` experts forward for transformers' experts interface: on meta inputs,
    transformers' own loop under :func:`worst_case_rows` (appending :data:`BOUND` to
    ``assumed``); on real ones, the loop as it is."""

    def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *args: Any) -> torch.Tensor:
        original = getattr(type(self).forward, "__wrapped__", None)
        if original is None:
            raise RuntimeError(f"{type(self).__name__}.forward is not transformers' experts dispatch")
        if not hidden_states.is_meta:
            return original(self, hidden_states, top_k_index, *args)
        rows = worst_case_rows(hidden_states.shape[0], top_k_index.shape[-1], self.num_experts)
        assumed.append(BOUND)
        # the real step holds the hit experts' ids (n_hit x 1 int64) during the loop; on meta
        # they live in CPU memory, so an equal meta tensor stands for them
        shadow = torch.empty((sum(1 for n in rows if n), 1), dtype=torch.long, device="meta")
        with _routed(rows):
            out = original(self, hidden_states, top_k_index, *args)
        del shadow
        return out

    return forward


def patch_experts(stack: contextlib.ExitStack, assumed: list[str]) -> None:
    """Enter, on ``stack``, the patches above where transformers' experts interface is loaded:
    ``grouped_mm`` for meta float32, the ``eager`` experts under the assumed routing."""
    import torch.nn.functional as F

    if hasattr(F, "grouped_mm"):
        stack.enter_context(mock.patch.object(F, "grouped_mm", grouped_mm(F.grouped_mm)))
    moe = sys.modules.get("transformers.integrations.moe")
    interface = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    if interface is not None and isinstance(getattr(interface, "_local_mapping", None), dict):
        eager = bounded_eager_experts(assumed)
        stack.enter_context(mock.patch.dict(interface._local_mapping, {"eager": eager}))
