"""``fullshard train hf``: a Hugging Face transformers model, sharded by its layer class name.

The model is built from a config in code (random initialization, nothing downloaded) with a
byte-level vocabulary of 256, wrapped the way Accelerate's ``fsdp_transformer_layer_cls_to_wrap``
does (each ``LlamaDecoderLayer`` or ``GPT2Block`` one FSDP unit), and trained on the same byte
corpus and loop as ``train gpt``. Needs the ``transformers`` package (the ``hf`` extra).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from fullshard import FullyShardedDataParallel as FSDP
from fullshard import apply_activation_checkpointing
from fullshard.jobs import launch
from fullshard.jobs.train import fsdp_options, launcher_options, plan_options
from fullshard.jobs.train.gpt import GPTJobConfig, config_from, make_parser, train_loop
from fullshard.wrap import transformer_auto_wrap_policy


def _llama_tiny() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def _gpt2_tiny() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256,
            n_embd=128,
            n_layer=4,
            n_head=4,
            n_positions=2048,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


HF_CONFIGS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "llama-tiny": (_llama_tiny, "LlamaDecoderLayer"),
    "gpt2-tiny": (_gpt2_tiny, "GPT2Block"),
}


class CausalLMLogits(nn.Module):
    """Adapts a transformers causal LM to tokens (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


def hf_model(name: str, wrap_cls: str | None = None) -> tuple[Callable[[], nn.Module], list[str]]:
    """(builds the model as tokens (batch, seq) int64 -> logits (batch, seq, vocab), the layer
    class names that become FSDP units) for ``name``: one of :data:`HF_CONFIGS`, or a
    transformers causal-LM class (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...) built from its
    default config, sharded by its ``_no_split_modules`` (the layers Accelerate wraps), or by
    ``wrap_cls`` (class names, comma-separated) when given.

    Raises:
        ImportError: transformers is not installed (the ``hf`` extra).
        ValueError: ``name`` is neither, the message listing the configs; or a ``wrap_cls``
            name matches no module of the model (see :func:`layer_classes`).
    """
    make, layers = _hf_builder(name)
    if wrap_cls:
        layers = wrap_cls.split(",")
        with torch.device("meta"):
            layer_classes(make(), layers)
    return make, layers


def _hf_builder(name: str) -> tuple[Callable[[], nn.Module], list[str]]:
    if name in HF_CONFIGS:
        build, layer = HF_CONFIGS[name]
        return (lambda: CausalLMLogits(build())), [layer]
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as err:
        raise ImportError(f"hf:{name} needs transformers: pip install 'fullshard[hf]' ({err})") from err
    cls = getattr(transformers, name, None) if name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else None
    config_class = getattr(cls, "config_class", None)
    layers = list(getattr(cls, "_no_split_modules", None) or [])
    if not isinstance(cls, type) or not issubclass(cls, nn.Module) or config_class is None or not layers:
        raise ValueError(
            f"hf:{name}: use one of {', '.join(HF_CONFIGS)} or a transformers causal-LM class with "
            "_no_split_modules (e.g. hf:LlamaForCausalLM, built from its default config)"
        )
    model_cls: Any = cls
    return (lambda: CausalLMLogits(model_cls(config_class()))), layers


def layer_classes(model: nn.Module, names: Sequence[str]) -> set[type[nn.Module]]:
    """The module classes in ``model`` whose class name is one of ``names``.

    Raises:
        ValueError: a name matches no module class of the model; the message lists the
            model's classes.
    """
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(
            f"layer class name(s) {missing} match no module of {type(model).__name__}; "
            f"its module classes are: {', '.join(sorted(present))}"
        )
    return {present[n] for n in names}


def shard_hf(model: nn.Module, layer_cls_names: Sequence[str], cfg: Any) -> nn.Module:
    """``model`` sharded as the HF job's options ``cfg`` say: one unit per instance of the named
    layer classes, each recomputed in backward under ``cfg.activation_checkpointing``.

    Raises:
        ValueError: a name matches no module class of the model (see :func:`layer_classes`).
    """
    classes = tuple(layer_classes(model, layer_cls_names))
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, classes))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(classes))
    return fsdp_options.shard_model(model, cfg, policy)


def wrap_hf(model: nn.Module, layer_cls_names: Sequence[str], **fsdp_kwargs: Any) -> FSDP:
    """FSDP over ``model`` with one unit per instance of the named layer classes (Accelerate's way)."""
    classes = layer_classes(model, layer_cls_names)
    policy = lambda module, recurse, nonwrapped_numel: transformer_auto_wrap_policy(  # noqa: E731
        module, recurse, nonwrapped_numel, transformer_layer_cls=classes
    )
    return FSDP(model, auto_wrap_policy=policy, **fsdp_kwargs)


@dataclasses.dataclass
class HFJobConfig(GPTJobConfig):
    """Options of the HF job: the GPT job's, with ``--config`` and ``--wrap-cls`` for the model."""

    config: str = "llama-tiny"
    wrap_cls: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.config not in HF_CONFIGS:
            raise ValueError(f"--config {self.config!r}: use one of {', '.join(HF_CONFIGS)}")


def parse_args(argv: Sequence[str]) -> HFJobConfig:
    """Parse command-line options into a validated HFJobConfig (exits with a message on error)."""
    p = make_parser("fullshard train hf", __doc__ or "")
    p.add_argument("--config", default=HFJobConfig.config, help=f"model: {', '.join(HF_CONFIGS)}")
    p.add_argument(
        "--wrap-cls",
        default=None,
        help="layer class name(s) to wrap, comma-separated (default: the model's decoder layer)",
    )
    return config_from(p, argv, HFJobConfig)


def worker(cfg: HFJobConfig) -> dict[str, Any] | None:
    """One rank of the job. Returns the last log record on rank 0, None elsewhere."""
    device = launch.init_process_group()
    launcher_options.watchdog_on()
    try:
        return _run(cfg, device)
    finally:
        launch.destroy_process_group()  # the model is out of scope here: its groups end now


def _run(cfg: HFJobConfig, device: torch.device) -> dict[str, Any] | None:
    torch.manual_seed(cfg.seed)
    make, names = hf_model(cfg.config, cfg.wrap_cls)  # a wrong --wrap-cls fails here
    if cfg.plan == "auto":
        is_unit = lambda m: type(m).__name__ in names  # noqa: E731
        wrapped = plan_options.planned_model(cfg, device, make, is_unit)
    else:
        wrapped = shard_hf(make().to(device), names, cfg)
    title = f"transformers {cfg.config} ({', '.join(names)} per unit)"
    return train_loop(cfg, device, wrapped, title, make)


def main(argv: Sequence[str]) -> int:
    """Entry point: run under an existing launcher (torchrun) or start ``--nproc`` workers."""
    cfg = parse_args(argv)
    code, final = launch.run_job("fullshard train hf", worker, cfg, cfg.nproc, max_restarts=cfg.max_restarts)
    if final is not None:
        print(f"final validation loss {final['val_loss']:.4f} nats/byte after {final['step']} steps", flush=True)
    return code
