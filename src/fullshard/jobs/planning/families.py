"""The model families of the estimator's generated sweep, built from tiny configs in code.

A :class:`Shape` (drawn by :mod:`fullshard.jobs.planning.sweep`) becomes a model of one family:
a transformers causal LM (random initialization, nothing downloaded, every setting not in the
shape left at the family's default, dropout included; token ids 0 so every vocabulary holds
them), the project's GPT, the MNIST Net, or a small ResNet (convolutions and BatchNorm,
:mod:`fullshard.jobs.models.resnet`). Each family also says which modules are its FSDP units
(the decoder layers a transformers model lists in ``_no_split_modules``, the GPT's Blocks, the
Net's large Linear, the ResNet's residual blocks) and which head sizes its rotary embedding
takes. :data:`DRAWN` are the families a sweep draws by default; the ResNet is drawn only when
asked for (``--families``), so that the seeds drawn before it keep their configurations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIMS = (10, 12, 14, 20, 24, 40)  # even (rotary halves), none a power of two
HEAD_DIMS_QUARTER = (12, 20, 24, 40)  # half of the head rotated: a multiple of 4
HEAD_DIMS_EIGHTH = (24, 40)  # a quarter rotated (GPT-NeoX's default): a multiple of 8


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's size: ``layers`` blocks of ``heads`` x ``head_dim`` attention (``kv_heads`` key
    and value heads), an MLP of ``ffn`` hidden units (per expert under MoE: ``experts`` of them,
    ``top_k`` per token, run by transformers' ``experts_impl``), ``vocab`` tokens; ``tied``:
    the GPT's output projection shares the embedding. The ResNet's: ``widths`` (channels of
    each stage), ``blocks`` per stage, images of ``channels`` x ``image`` x ``image`` pixels,
    ``classes`` labels (all 0 for the other families)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    experts_impl: str = ""
    tied: bool = True
    widths: tuple[int, ...] = ()
    blocks: int = 0
    channels: int = 0
    image: int = 0
    classes: int = 0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build one family: ``build(shape) -> model`` (tokens (B, T) int64 -> logits (B, T,
    vocab), images (B, 1, 28, 28) -> log-probabilities for the Net, or images (B, channels,
    image, image) -> logits (B, classes) for a ``convolutional`` family), its units, the head
    sizes it takes, whether it has grouped key/value heads and experts."""

    name: str
    build: Callable[[Shape], nn.Module]
    is_unit: Callable[[nn.Module], bool]
    head_dims: tuple[int, ...] = HEAD_DIMS
    gqa: bool = False
    moe: bool = False
    language: bool = True
    convolutional: bool = False


def _transformers(config: str, model: str, args: dict[str, str]) -> Callable[[Shape], nn.Module]:
    """A builder of transformers' ``model`` from ``config``; ``args`` maps the config's argument
    names to the Shape fields that give them."""

    def build(shape: Shape) -> nn.Module:
        import transformers

        from fullshard.jobs.train.hf import CausalLMLogits

        values = {arg: getattr(shape, field) for arg, field in args.items()}
        ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
        cfg = getattr(transformers, config)(vocab_size=shape.vocab, **ids, **values)
        return CausalLMLogits(getattr(transformers, model)(cfg))

    return build


def _layer(model: str) -> Callable[[nn.Module], bool]:
    """Units of transformers' ``model``: the classes its ``_no_split_modules`` names."""
    names: list[set[str]] = []

    def is_unit(m: nn.Module) -> bool:
        if not names:
            import transformers

            names.append(set(getattr(transformers, model)._no_split_modules))
        return type(m).__name__ in names[0]

    return is_unit


_SIZES = {"num_hidden_layers": "layers", "num_attention_heads": "heads", "hidden_size": "hidden"}
_MHA = {**_SIZES, "intermediate_size": "ffn"}  # head size hidden / heads
_GQA = {**_MHA, "num_key_value_heads": "kv_heads"}
_DECODER = {**_GQA, "head_dim": "head_dim"}
_MOE = {
    **_DECODER,
    "num_local_experts": "experts",
    "num_experts_per_tok": "top_k",
    "experts_implementation": "experts_impl",
}
_GPT2 = {"n_layer": "layers", "n_head": "heads", "n_embd": "hidden", "n_inner": "ffn"}
_OPT = {**_SIZES, "ffn_dim": "ffn", "word_embed_proj_dim": "hidden"}
_FALCON = {**_SIZES, "ffn_hidden_size": "ffn"}  # multi-query attention by default: one key/value head


def _hf(name: str, model: str, args: dict[str, str], **kw: Any) -> Family:
    config = model.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config")
    return Family(name, _transformers(config, model, args), _layer(model), **kw)


def _gpt(shape: Shape) -> nn.Module:
    from fullshard.jobs.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(
        d_model=shape.hidden,
        n_layers=shape.layers,
        n_heads=shape.heads,
        vocab_size=shape.vocab,
        mlp_hidden=shape.ffn,
        tie_embeddings=shape.tied,
    )
    return GPT(cfg)


def _is_block(m: nn.Module) -> bool:
    from fullshard.jobs.models.gpt import Block

    return isinstance(m, Block)


def _net(shape: Shape) -> nn.Module:
    from fullshard.jobs.models.net import Net

    return Net()


def _net_unit(m: nn.Module) -> bool:
    """The MNIST job's units: Linear layers of 20,000 parameters or more (fc1)."""
    return isinstance(m, nn.Linear) and sum(p.numel() for p in m.parameters()) >= 20000


def _resnet(shape: Shape) -> nn.Module:
    from fullshard.jobs.models.resnet import ResNet, ResNetConfig

    return ResNet(ResNetConfig(shape.widths, shape.blocks, shape.channels, shape.classes))


def _is_residual_block(m: nn.Module) -> bool:
    from fullshard.jobs.models.resnet import BasicBlock

    return isinstance(m, BasicBlock)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _hf("llama", "LlamaForCausalLM", _DECODER, gqa=True),
        _hf("mistral", "MistralForCausalLM", _DECODER, gqa=True),
        _hf("qwen2", "Qwen2ForCausalLM", _GQA, gqa=True),
        _hf("qwen3", "Qwen3ForCausalLM", _DECODER, gqa=True),
        _hf("gemma2", "Gemma2ForCausalLM", _DECODER, gqa=True),
        _hf("phi", "PhiForCausalLM", _GQA, gqa=True, head_dims=HEAD_DIMS_QUARTER),
        _hf("phi3", "Phi3ForCausalLM", _GQA, gqa=True),
        _hf("gpt-neox", "GPTNeoXForCausalLM", _MHA, head_dims=HEAD_DIMS_EIGHTH),
        _hf("gpt2", "GPT2LMHeadModel", _GPT2),
        _hf("opt", "OPTForCausalLM", _OPT),
        _hf("falcon", "FalconForCausalLM", _FALCON),
        _hf("mixtral", "MixtralForCausalLM", _MOE, gqa=True, moe=True),
        Family("gpt", _gpt, _is_block),
        Family("mnist", _net, _net_unit, language=False),
        Family("resnet", _resnet, _is_residual_block, language=False, convolutional=True),
    )
}
"""Every family of the sweep, by name."""

DRAWN = tuple(name for name in FAMILIES if not FAMILIES[name].convolutional)
"""The families a sweep draws from unless told otherwise: every one but the ResNet, which came
later (adding it here would change every configuration the older seeds draw)."""


def parts(family: str, shape: Shape, batch: int, seq: int) -> tuple[Any, Any, Any, Any]:
    """(make_model, example, loss_fn, is_unit) of ``family`` at ``shape``: ``example()`` gives
    one rank's batch of zeros (tokens (batch, seq) int64 and targets, or images (batch, 1, 28,
    28) float32 and labels (batch,) int64, or for the ResNet images (batch, channels, image,
    image) float32 and labels), ``loss_fn(model, batch)`` the training loss (the cross-entropy
    of the logits in float32, averaged; the Net's summed NLL, as the MNIST job).

    Raises:
        KeyError: ``family`` is not one of :data:`FAMILIES`.
    """
    from fullshard.jobs.train.plan_options import lm_parts

    f = FAMILIES[family]
    if f.language:
        example, loss_fn = lm_parts(batch, seq)
        return (lambda: f.build(shape)), example, loss_fn, f.is_unit

    pixels = (shape.channels, shape.image, shape.image) if f.convolutional else (1, 28, 28)

    def images() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(batch, *pixels), torch.zeros(batch, dtype=torch.long)

    def nll(model: nn.Module, b: Any) -> torch.Tensor:
        return F.nll_loss(model(b[0]).float(), b[1], reduction="sum")

    def cross_entropy(model: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(model(b[0]).float(), b[1])

    return (lambda: f.build(shape)), images, cross_entropy if f.convolutional else nll, f.is_unit


def random_batch(family: str, example: Any, vocab: int, classes: int = 0) -> tuple[torch.Tensor, ...]:
    """A real batch shaped as ``example()``: tokens and targets in ``[0, vocab)``, or normal
    images with labels in ``[0, classes)`` (``classes`` 0: the Net's 10)."""
    x, y = example()
    if FAMILIES[family].language:
        return x.random_(0, vocab), y.random_(0, vocab)
    return x.normal_(), y.random_(0, classes or 10)
