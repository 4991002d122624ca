"""CPU speed rewrites of layers: the same parameters and results as torch's layers, faster on a CPU.

oneDNN's CPU kernels run some of the models' layers far below the speed of the rest: 1x1
convolutions and 2x2 transposed convolutions (backward passes especially), 3x3 convolutions
of one-channel images, and the fused attention kernel in bf16/fp16 at these sequence lengths.
On the CPU these layers run as matrix products instead, feature maps stay in channels_last,
and the forward model's last upsampling stage and head run on the grid of 2x2 blocks
(``upsample_head``). Every other device uses torch's own layers; the results are equal
(tests/models/test_legacy.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def cpu_channels_last(x: Tensor) -> Tensor:
    """Feature maps (B, C, H, W) in channels_last on the CPU, unchanged elsewhere.

    oneDNN's CPU convolutions are several times faster in channels_last than in NCHW, the
    backward pass of the few-channel 256 x 256 layers by 5x or more; convolutions, norms,
    pooling and concatenation keep the format, so one conversion per block suffices. On GPUs
    the caller picks the format with ``model.to(memory_format=...)``.
    """
    return x.contiguous(memory_format=torch.channels_last) if x.device.type == "cpu" else x


def pixels_last(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H, W, C) view; contiguous when ``x`` is channels_last."""
    return x.permute(0, 2, 3, 1)


def channels_first(x: Tensor) -> Tensor:
    """(B, H, W, C) -> (B, C, H, W) view, which is channels_last in memory."""
    return x.permute(0, 3, 1, 2)


class PointwiseConv(nn.Conv2d):
    """1x1 convolution; on the CPU one matrix product over the pixels (faster than oneDNN's
    1x1 convolution backward pass here). Same parameters and result as ``nn.Conv2d(c_in, c_out, 1)``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        return channels_first(F.linear(pixels_last(x), self.weight.flatten(1), self.bias))


class SingleChannelConv3x3(nn.Conv2d):
    """3x3 convolution (padding 1) of a one-channel image; on the CPU a matrix product over
    the 9 neighbours of each pixel, since oneDNN runs one-channel inputs far below its speed
    on wider ones. Same parameters and result as ``nn.Conv2d(1, c_out, 3, padding=1)``."""

    def __init__(self, out_channels: int) -> None:
        super().__init__(1, out_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        batch, _, height, width = x.shape
        neighbours = F.unfold(x, 3, padding=1).transpose(1, 2)  # (B, H*W, 9)
        y = F.linear(neighbours, self.weight.flatten(1), self.bias)
        return channels_first(y.view(batch, height, width, self.out_channels))


class TransposedConv2x2(nn.ConvTranspose2d):
    """2x2, stride-2 transposed convolution (B, C_in, H, W) -> (B, C_out, 2H, 2W).

    On the CPU one matrix product per input pixel (C_in -> 2 x 2 x C_out) and a pixel shuffle,
    2-4x faster than oneDNN's transposed convolution, backward pass included. Same parameters
    and result as ``nn.ConvTranspose2d(c_in, c_out, 2, stride=2)``.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels, 2, stride=2)

    def blocks(self, x: Tensor) -> Tensor:
        """(B, C_in, H, W) -> (B, H, W, 4 * C_out): each input pixel's 2x2 output block, channels
        ordered (row in block, column in block, output channel). Any device."""
        weight = self.weight.permute(0, 2, 3, 1).reshape(self.in_channels, 4 * self.out_channels)
        return F.linear(pixels_last(x), weight.t(), self.bias.repeat(4))

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        batch, _, height, width = x.shape
        y = self.blocks(x).view(batch, height, width, 2, 2, self.out_channels).permute(0, 1, 3, 2, 4, 5)
        return channels_first(y.reshape(batch, 2 * height, 2 * width, self.out_channels))


def block_head_index(channels: int) -> Tensor:
    """Where each weight of ``upsample_head``'s conv comes from in a 3x3 head's flattened weight.

    The conv runs on the grid of 2x2 blocks: output channel (a, b) is the sub-pixel, input channel
    (a', b', c) the block's sub-pixel and channel, kernel offset (i, j) the neighbouring block.
    Full-resolution row offset ``2 i + a' - a`` (and the same for columns) must lie in -1..1 to
    reach the head's 3x3 window; elsewhere the index points past the weight, at an appended zero.
    (4, 4 * channels, 3, 3) int64.
    """
    a, b, a_in, b_in, c, i, j = torch.meshgrid(
        *(torch.arange(n) for n in (2, 2, 2, 2, channels, 3, 3)), indexing="ij"
    )
    dy, dx = 2 * (i - 1) + a_in - a, 2 * (j - 1) + b_in - b
    inside = (dy.abs() <= 1) & (dx.abs() <= 1)
    index = torch.where(inside, c * 9 + (dy + 1) * 3 + (dx + 1), 9 * channels)
    return index.reshape(4, 4 * channels, 3, 3)


def upsample_head(upsample: TransposedConv2x2, head: nn.Conv2d, index: Tensor, x: Tensor) -> Tensor:
    """``head(relu(upsample(x)))`` for a 3x3 (padding 1) head with one output channel:
    (B, C_in, H, W) -> (B, 1, 2H, 2W).

    On the CPU the 2H x 2W feature map is never formed: the upsampled pixels stay in their 2x2
    blocks (``TransposedConv2x2.blocks``, 4 * C channels at H x W), the head becomes a 3x3 conv
    on that grid with one output channel per sub-pixel (its weight gathered from the head's), and
    only the one-channel result is shuffled to 2H x 2W. ``index`` is
    ``block_head_index(upsample.out_channels)`` on the CPU. Same parameters and result.
    """
    if x.device.type != "cpu":
        return head(F.relu(upsample(x)))
    batch, _, height, width = x.shape
    blocks = channels_first(F.relu(upsample.blocks(x)))
    weight = torch.cat([head.weight.flatten(), head.weight.new_zeros(1)])[index]
    y = F.conv2d(blocks, weight, head.bias.expand(4), padding=1)  # (B, 4, H, W), channels_last
    y = pixels_last(y).reshape(batch, height, width, 2, 2).permute(0, 1, 3, 2, 4)
    return y.reshape(batch, 1, 2 * height, 2 * width)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) v over (B, heads, length, head_dim) tensors.

    On the CPU in bf16/fp16 the explicit product is several times faster than the fused
    CPU kernel (its backward pass especially) at these sequence lengths (<= 336 tokens).
    """
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        logits = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return torch.softmax(logits, dim=-1) @ v
    return F.scaled_dot_product_attention(q, k, v)
