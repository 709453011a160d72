"""A decoder-only transformer for byte-level language modelling (the model of ``train gpt``).

Pre-norm blocks (RMSNorm), rotary position embeddings, a SwiGLU MLP, and an output projection
tied to the token embedding (or its own weight with ``tie_embeddings=False``). Shapes: tokens
int64 (batch, seq) -> logits (batch, seq, vocab) in the parameters' compute dtype.

:func:`init_module` initializes one module's own parameters (normal(0, 0.02), residual
projections scaled by 1/sqrt(2 x layers)); it is used at construction and, for models built on
the meta device, as FSDP's ``param_init_fn``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``mlp_hidden`` defaults to 8/3 x d_model rounded up to a multiple of 64.

    ``tie_embeddings``: the output projection shares the token embedding's weight (default).
    """

    d_model: int
    n_layers: int
    n_heads: int
    vocab_size: int = 256
    max_seq_len: int = 2048
    mlp_hidden: int = 0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not self.mlp_hidden:
            object.__setattr__(self, "mlp_hidden", 64 * math.ceil(8 * self.d_model / 3 / 64))

    @property
    def num_params(self) -> int:
        """Parameters, a tied embedding counted once."""
        d, h = self.d_model, self.mlp_hidden
        block = 4 * d * d + 3 * d * h + 2 * d
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * block + d


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, n_layers=4, n_heads=4),
    "124m": GPTConfig(d_model=768, n_layers=12, n_heads=12),
    "350m": GPTConfig(d_model=1024, n_layers=24, n_heads=16),
    "1.3b": GPTConfig(d_model=2048, n_layers=24, n_heads=16),
    "7b": GPTConfig(d_model=4096, n_layers=32, n_heads=32),
}


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rotary_tables(
    seq_len: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim // 2)."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj.residual = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        cos, sin = rotary_tables(t, d // self.n_heads, x.device, q.dtype)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)
        self.down.residual = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): the FSDP unit of the GPT job."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token embedding, ``n_layers`` Blocks, a final RMSNorm and the output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        for m in self.modules():
            init_module(m, cfg.n_layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def init_module(m: nn.Module, n_layers: int) -> None:
    """Initialize ``m``'s own parameters (not its children's): the GPT recipe."""
    with torch.no_grad():
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layers) if getattr(m, "residual", False) else 0.02
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.RMSNorm) and m.weight is not None:
            nn.init.ones_(m.weight)
