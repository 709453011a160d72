"""A small ResNet-style image classifier built in code (no torchvision), for the estimator's sweep.

Vocabulary: a *stage* is a run of residual blocks at one width and one resolution; the first
block of every stage after the first halves the resolution (stride 2) and, where the width or
the resolution changes, adds a 1x1 convolution with its BatchNorm to the shortcut. A
:class:`BasicBlock` is the unit of FSDP wrapping.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The model's sizes: ``widths`` (channels of each stage, any positive ints), ``blocks``
    per stage, ``in_channels`` of the images, ``classes`` of the output.

    Raises:
        ValueError: no stage, or a size below 1.
    """

    widths: tuple[int, ...]
    blocks: int = 2
    in_channels: int = 3
    classes: int = 10

    def __post_init__(self) -> None:
        sizes = {"blocks": self.blocks, "in_channels": self.in_channels, "classes": self.classes}
        bad = {k: v for k, v in sizes.items() if v < 1}
        if not self.widths or min(self.widths) < 1 or bad:
            raise ValueError(
                f"ResNetConfig(widths={self.widths}, {', '.join(f'{k}={v}' for k, v in sizes.items())}): "
                "give at least one stage and sizes of 1 or more"
            )


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the shortcut, then ReLU.

    Input: float (batch, ``in_ch``, H, W). Output: (batch, ``out_ch``, ceil(H / stride),
    ceil(W / stride)), the input's dtype.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem (conv3x3 to the first width, BN, ReLU), the stages of :class:`BasicBlock`, global
    average pooling and a Linear head.

    Input: float32 images (batch, ``in_channels``, H, W), H and W at least 1. Output: logits
    (batch, ``classes``) in the model's dtype. In training mode BatchNorm needs more than one
    value per channel: batch x (H / 2^(stages-1)) x (W / ...) above 1.
    """

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        first = cfg.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.in_channels, first, 3, 1, 1, bias=False), nn.BatchNorm2d(first), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        width = first
        for stage, out in enumerate(cfg.widths):
            for b in range(cfg.blocks):
                blocks.append(BasicBlock(width, out, stride=2 if stage and not b else 1))
                width = out
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))
