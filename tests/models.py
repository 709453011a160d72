"""Small models for the tests. Sizes are chosen so dim 0 often does not divide the world size."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Linear + LayerNorm + GELU, with a residual when shapes allow."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(self.norm(self.lin(x)))
        return y + x if y.shape == x.shape else y


class Stack(nn.Module):
    """A stem, four Blocks (13 and 7 rows: not divisible by 2, 3 or 4) and a 3-row head.

    Input float32 (batch, 6), output float32 (batch, 3).
    """

    def __init__(self, scale_shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 13)
        self.blocks = nn.ModuleList([Block(13, 13), Block(13, 7), Block(7, 7), Block(7, 13)])
        self.head = nn.Linear(13, 3)
        self.scale = nn.Parameter(torch.full(scale_shape, 1.5))  # 0-dim by default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale


def make_stack(seed: int = 0, scale_shape: tuple[int, ...] = ()) -> Stack:
    """A seeded Stack; ``scale_shape=(1,)`` for fully_shard, which (as torch's) refuses 0-dim
    parameters."""
    torch.manual_seed(seed)
    return Stack(scale_shape)


def batch(step: int, n: int, seed: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch (inputs (n, 6), targets (n, 3)) for step ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of a global batch along dim 0."""
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def step_both(model, opt, ref, ref_opt, step: int, rank: int, world: int, global_batch: int = 12) -> None:
    """One MSE training step of the sharded model on this rank's share and of the reference on
    the whole global batch (same data: ``batch(step, global_batch)``)."""
    x, y = batch(step, global_batch)
    device = next(ref.parameters()).device
    x, y = x.to(device), y.to(device)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world)).backward()
    opt.step()
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class TinyBlock(nn.Module):
    """Pre-norm attention + GELU MLP, the shape of pytorch/examples' FSDP2 transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = _Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(torch.nn.functional.gelu(self.w1(self.ffn_norm(h))))


class TinyLM(nn.Module):
    """Token and position embeddings, ``layers`` TinyBlocks, a norm and an untied head.

    Vocabulary 37 and 10 positions: dim 0 of the embeddings divides none of 2, 3, 4. Input int64
    (batch, seq <= 10); output float32 logits (batch, seq, 37).
    """

    def __init__(self, layers: int = 3, dim: int = 12, heads: int = 2, vocab: int = 37, max_seq: int = 10) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList([TinyBlock(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def init_weights(self) -> None:
        """Reset every submodule's parameters (after ``to_empty``)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def tokens(step: int, n: int, seq: int = 8, vocab: int = 37, seed: int = 200) -> torch.Tensor:
    """A deterministic global batch of token ids, int64 (n, seq), for step ``step``."""
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed + step))


def accumulating_steps(model: nn.Module, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three AdamW steps of a ``fully_shard`` TinyLM on this rank's tokens, the second after a
    micro-batch accumulated with gradient sync off; (losses, full parameters by name)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        if step == 1:
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            model(tokens(40, 4, seed=300 + rank)).float().pow(2).mean().backward()
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
        loss = model(tokens(step, 4, seed=300 + rank)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


class ConvBlock(nn.Module):
    """Conv2d (3x3, same size) + BatchNorm2d + ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    """Two ConvBlocks (5 and 7 channels), a mean over the image, Linear + BatchNorm1d + ReLU, and a
    3-row head: BatchNorm in a block and outside any. Input float32 (batch, 3, H, W), output (batch, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(3, 5), ConvBlock(5, 7))
        self.fc = nn.Linear(7, 9)
        self.norm = nn.BatchNorm1d(9)
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(x).mean(dim=(2, 3))
        return self.head(torch.relu(self.norm(self.fc(x))))


def make_cnn(seed: int = 0) -> SmallCNN:
    """A seeded SmallCNN (BatchNorm's affine parameters perturbed from their ones and zeros)."""
    torch.manual_seed(seed)
    model = SmallCNN()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.add_(0.1 * torch.randn_like(m.weight))
                m.bias.add_(0.1 * torch.randn_like(m.bias))
    return model


def images(step: int, n: int, size: int = 6, seed: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch (images (n, 3, size, size), targets (n, 3)) for step ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    return torch.randn(n, 3, size, size, generator=g), torch.randn(n, 3, generator=g)
