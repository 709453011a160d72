"""What the meta-device trace needs to run a model as the real device would.

A model traced on the meta device (:mod:`fullshard.plan.peak`, and calibration's shape
pass in :mod:`fullshard.plan.calibrate`) allocates nothing, but two things differ from a
real step, and :func:`traced` mends both for the length of a trace:

- kernels picked by device: meta tensors take SDPA's math path, which saves the attention
  weights (batch x heads x T x T); CPU runs its flash kernel and CUDA its flash (half
  precision) or memory-efficient kernel, which save only the output and the log-sum-exp
  (:func:`device_attention`);
- values: a meta tensor has none, so code that branches on one (``.item()``, ``bool(t)``,
  ``.all()``) cannot run. transformers' masking code does it once on the training path: it asks
  whether the position ids hold several packed sequences. The position ids it makes itself when
  none are passed are ``0..T-1`` in every row, one sequence each, so the trace answers as
  transformers does for them (:func:`_unpacked`). Models with a padding token id (GPT-2 and
  some sixty others) look for it at the ends of the input ids to warn when no attention mask
  was passed; the trace skips that warning (:func:`_unwarned`). Any other value read fails with a
  :class:`MetaValueRead` naming what happened;
- mixture-of-experts layers (:mod:`fullshard.plan.moe_trace`): transformers' default grouped
  experts have routing-independent shapes and trace exactly (float32 through a stand-in for the
  meta kernel, which takes bfloat16 only); its eager experts loop over the routing's values, and
  trace under an assumed worst-case routing, which :func:`traced` reports.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from fullshard import compat
from fullshard.plan.moe_trace import patch_experts

_SDPA = F.scaled_dot_product_attention


class MetaValueRead(RuntimeError):
    """The traced model read a tensor's value, which the meta-device trace cannot give."""


def device_attention(device_type: str) -> Any:
    """``F.scaled_dot_product_attention`` as ``device_type`` ("cpu" or "cuda") runs it, for the
    meta trace.

    Meta tensors take SDPA's math path, which saves the attention weights (B x H x T x T); on
    CPU torch runs its flash kernel, which saves only the output and the log-sum-exp (measured on
    the tiny GPT in bf16: 82.6 MiB of activations traced the math way, 66.8 MiB real). On CUDA
    (torch 2.11 on an H100, checked op by op with ``tools/peak_by_op.py``) SDPA runs fp16/bf16
    with a head size up to 256 in flash attention, first padding query, key and value to a
    head size that is a multiple of 8 (the padded copies are what flash saves; traced so);
    otherwise the memory-efficient kernel where the head size is a multiple of 16 bytes, else
    its math path, which saves the B x H x T x T weights (what the meta device runs). On the
    H100, bf16 with an aligned head size ran cuDNN's attention instead of flash, saving what
    flash saves plus the statistics; traced as flash. Flash takes grouped key/value heads as
    they are (``enable_gqa=True``); in float32 they take the math path, which repeats them. On
    CPU, grouped key/value heads
    (``enable_gqa=True``, transformers' call when no mask is passed) run the same CPU flash
    kernel on the ungrouped key and value (B x H_kv x T x D saved, no B x H x T x T weights; an
    op log of a real CPU call shows that kernel alone). Calls with a mask, dropout on CPU, or
    real tensors, are SDPA's own (CUDA's kernels take
    dropout: GPT-2's attention dropout ran the memory-efficient kernel there, its math path on
    CPU).
    """

    def attention(*args: Any, **kwargs: Any) -> Any:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        opts = {**dict(zip(names, args)), **kwargs}
        q, k, v = (opts.get(n) for n in names[:3])
        dropout = float(opts.get("dropout_p") or 0.0)
        # CPU's flash kernel takes no dropout (SDPA runs its math path then); CUDA's kernels do.
        plain = opts.get("attn_mask") is None and (not dropout or device_type == "cuda")
        if not (plain and isinstance(q, torch.Tensor) and q.is_meta and k is not None and v is not None):
            return _SDPA(*args, **kwargs)
        grouped = bool(opts.get("enable_gqa"))
        if grouped and (q.dim() < 3 or q.shape[-3] % k.shape[-3]):
            return _SDPA(*args, **kwargs)
        causal, scale = bool(opts.get("is_causal", False)), opts.get("scale")
        if device_type == "cpu":
            return compat.sdpa_kernels()["flash_cpu"](q, k, v, 0.0, causal, scale=scale)[0]
        head = q.shape[-1]
        if q.dtype in (torch.float16, torch.bfloat16) and head <= 256 and k.shape[-1] == v.shape[-1] == head:
            pad = -head % 8
            if not pad:
                return compat.sdpa_kernels()["flash"](q, k, v, dropout, causal, False, scale=scale)[0]
            scale = head**-0.5 if scale is None else scale  # the unpadded head size's, as torch keeps
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
            return compat.sdpa_kernels()["flash"](q, k, v, dropout, causal, False, scale=scale)[0][..., :head]
        if grouped or head % (16 // q.element_size()):
            # the math path, as CUDA runs it for grouped heads (the memory-efficient kernel takes
            # none) and for a head size that is no multiple of 16 bytes
            return _SDPA(*args, **kwargs)
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        return compat.sdpa_kernels()["efficient"](q, k, v, None, grad, dropout, causal, scale=scale)[0]

    return attention


def _unpacked(original: Any) -> Any:
    """transformers' ``find_packed_sequence_indices``, answering for meta position ids as it
    answers for ids ``0..T-1`` per row: no packed sequences (None). Real ids go to ``original``."""

    def find(position_ids: torch.Tensor) -> Any:
        return None if position_ids.is_meta else original(position_ids)

    return find


def _unwarned(original: Any) -> Any:
    """transformers' ``warn_if_padding_and_no_attention_mask`` that says nothing for meta
    input ids (it only warns; it reads their values to decide). Real ids go to ``original``."""

    def warn(self: Any, input_ids: Any, attention_mask: Any) -> None:
        if isinstance(input_ids, torch.Tensor) and input_ids.is_meta:
            return
        original(self, input_ids, attention_mask)

    return warn


@contextlib.contextmanager
def traced(device_type: str) -> Iterator[list[str]]:
    """Patch what the meta trace of a step on ``device_type`` needs (see the module docstring)
    while inside; patched functions, not a TorchFunctionMode, since checkpointed blocks recompute
    in autograd's own thread. Yields the list of what the trace had to assume, filled as it runs
    (one entry per assumption made; empty when it knew every shape, and its bytes are exact).

    Raises:
        MetaValueRead: the model read a tensor value inside (its message names the fix).
    """
    assumed: list[str] = []
    with contextlib.ExitStack() as stack:
        patch_experts(stack, assumed)
        if device_type in ("cpu", "cuda"):
            stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", device_attention(device_type)))
        masking = sys.modules.get("transformers.masking_utils")
        if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
            unpacked = _unpacked(masking.find_packed_sequence_indices)
            stack.enter_context(mock.patch.object(masking, "find_packed_sequence_indices", unpacked))
        modeling = sys.modules.get("transformers.modeling_utils")
        pretrained = getattr(modeling, "PreTrainedModel", None)
        if pretrained is not None and hasattr(pretrained, "warn_if_padding_and_no_attention_mask"):
            unwarned = _unwarned(pretrained.warn_if_padding_and_no_attention_mask)
            stack.enter_context(mock.patch.object(pretrained, "warn_if_padding_and_no_attention_mask", unwarned))
        try:
            yield assumed
        except (RuntimeError, NotImplementedError) as err:
            if "meta" not in str(err) or not any(w in str(err) for w in ("item", "data-dependent", "nonzero")):
                raise
            raise MetaValueRead(
                f"the model reads a tensor's value in forward or backward ({err}); the memory estimate "
                "traces it on the meta device, where tensors have shapes but no values: make that "
                "branch independent of values (e.g. pass the masks or position ids it checks as "
                "None), or estimate the model without it"
            ) from err
