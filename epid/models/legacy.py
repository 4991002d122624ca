"""Forward model (control point -> EPID frame) and inverse model (EPID frame pair -> control point).

Both models work in the sample layout of ``epid.data.dataset.Batch``:

* ``leaf_a``, ``leaf_b``: (B, 104) mm, ``[prev 52, curr 52]``;
* ``scalars``: (B, 5) ``[mu_curr (MU), jaw_1 prev, jaw_1 curr, jaw_2 prev, jaw_2 curr (mm)]``;
* ``epid_prev``, ``epid_curr``: (B, 1, 256, 256) frames; the inverse model also accepts
  (B, 256, 256) and (B, 1, 1, 256, 256);
* ``latent``: (B, 1, 64, 64), a low-resolution image produced by both models and aligned by the loss.

Scaling: inside the networks, positions are divided by ``LEAF_SCALE_MM`` (130 mm) and MU and
frame values by ``MU_SCALE`` (40 MU), the normalisation the loss uses, so every head predicts
O(1) numbers; outputs are scaled back to mm and MU at the model boundary. The forward model
predicts the frame per MU and multiplies it by ``mu_curr``: a frame is the MU-weighted sum of
convolved apertures, so it is linear in the MU of its control point and the network only has
to learn the aperture geometry.

Initialisation (in the constructors): Kaiming normal (fan_in, ReLU) for convolutions, Xavier
uniform for linear layers, zero biases, norms with weight 1 and bias 0, normal(std 0.02) for
learned tokens, queries and embeddings.

Sizes: ``ForwardConfig`` and ``InverseConfig``, with the named ``SIZES`` full, small and tiny;
``epid.models.families`` builds and rebuilds model pairs from them. The layers that a CPU runs slowly
in torch's own form come from ``epid.models.layers`` (same parameters and results); the split
points ``InverseModel.encode`` / ``decode`` let ``epid.training.side_by_side`` run the two encoder towers
in different threads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from epid.models.layers import (
    PointwiseConv,
    SingleChannelConv3x3,
    TransposedConv2x2,
    block_head_index,
    cpu_channels_last,
    scaled_dot_product_attention,
    upsample_head,
)
from epid.synthesis.geometry import GRID_SIZE, NUM_LEAF_PAIRS

NUM_LEAVES = 2 * NUM_LEAF_PAIRS
NUM_SCALARS = 5
LATENT_SIZE = 64
LEAF_SCALE_MM = 130.0
MU_SCALE = 40.0
SCALAR_SCALE = (MU_SCALE, LEAF_SCALE_MM, LEAF_SCALE_MM, LEAF_SCALE_MM, LEAF_SCALE_MM)
TOKEN_INIT_STD = 0.02


def init_weights(module: nn.Module) -> None:
    """Initialise every convolution, linear layer and norm inside ``module`` (in place)."""
    for sub in module.modules():
        if isinstance(sub, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.kaiming_normal_(sub.weight, mode="fan_in", nonlinearity="relu")
        elif isinstance(sub, nn.Linear):
            nn.init.xavier_uniform_(sub.weight)
        elif isinstance(sub, (nn.GroupNorm, nn.LayerNorm)):
            nn.init.ones_(sub.weight)
        else:
            continue
        if sub.bias is not None:
            nn.init.zeros_(sub.bias)


def learned_tokens(*shape: int) -> nn.Parameter:
    """A learned token/query/embedding tensor, initialised normal(0, 0.02)."""
    return nn.Parameter(torch.randn(*shape) * TOKEN_INIT_STD)



class ResidualBlock(nn.Module):
    """conv3x3 -> GroupNorm(1) -> ReLU -> conv3x3 -> GroupNorm(1), plus shortcut, ReLU.

    The shortcut is the identity, or a 1x1 convolution when the channel count changes.
    (B, in_channels, H, W) -> (B, out_channels, H, W).
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = (
            SingleChannelConv3x3(out_channels)
            if in_channels == 1
            else nn.Conv2d(in_channels, out_channels, 3, padding=1)
        )
        self.norm1 = nn.GroupNorm(1, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(1, out_channels)
        self.shortcut = (
            nn.Identity() if in_channels == out_channels else PointwiseConv(in_channels, out_channels)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.norm1(cpu_channels_last(self.conv1(x))))
        h = self.norm2(self.conv2(h))
        return F.relu(h + cpu_channels_last(self.shortcut(x)))


class Encoder(nn.Module):
    """Encoder stages (residual block + 2x2 max-pool) of widths ``widths``.

    Returns the pre-pool feature map of every stage (the skips, finest first) and the pooled
    output of the last stage (resolution divided by 2 ** len(widths)).
    """

    def __init__(self, in_channels: int, widths: Sequence[int]) -> None:
        super().__init__()
        channels = [in_channels, *widths]
        self.blocks = nn.ModuleList(
            ResidualBlock(c_in, c_out) for c_in, c_out in itertools.pairwise(channels)
        )

    def forward(self, x: Tensor) -> tuple[list[Tensor], Tensor]:
        skips = []
        for block in self.blocks:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        return skips, x


class Decoder(nn.Module):
    """Decoder stages (2x2 transposed conv, concat skip, residual block) back to ``widths[0]``.

    ``widths`` are the encoder widths (finest first); the stages run coarsest first.
    """

    def __init__(self, in_channels: int, widths: Sequence[int]) -> None:
        super().__init__()
        self.upsamples = nn.ModuleList()
        self.blocks = nn.ModuleList()
        for width in reversed(widths):
            self.upsamples.append(TransposedConv2x2(in_channels, width))
            self.blocks.append(ResidualBlock(2 * width, width))
            in_channels = width

    def forward(self, x: Tensor, skips: Sequence[Tensor]) -> Tensor:
        for upsample, block, skip in zip(self.upsamples, self.blocks, reversed(skips), strict=True):
            x = block(torch.cat([upsample(x), skip], dim=1))
        return x


# --------------------------------------------------------------------------- transformer parts


class Attention(nn.Module):
    """Multi-head attention of ``queries`` (B, L, D) over ``context`` (B, S, D) -> (B, L, D)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.query = nn.Linear(d_model, d_model)
        self.key_value = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, queries: Tensor, context: Tensor) -> Tensor:
        batch, length, d_model = queries.shape
        head_dim = d_model // self.num_heads
        q = self.query(queries).view(batch, length, self.num_heads, head_dim).transpose(1, 2)
        kv = self.key_value(context).view(batch, -1, 2, self.num_heads, head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = scaled_dot_product_attention(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, length, d_model))


class FeedForward(nn.Sequential):
    """Linear(d_model, ff_dim) -> GELU -> Linear(ff_dim, d_model)."""

    def __init__(self, d_model: int, ff_dim: int) -> None:
        super().__init__(nn.Linear(d_model, ff_dim), nn.GELU(), nn.Linear(ff_dim, d_model))


class EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer (self-attention, feed-forward), no dropout."""

    def __init__(self, d_model: int, num_heads: int, ff_dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = Attention(d_model, num_heads)
        self.feed_forward_norm = nn.LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, ff_dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.attention_norm(x)
        x = x + self.attention(h, h)
        return x + self.feed_forward(self.feed_forward_norm(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer decoder layer: query self-attention, cross-attention, feed-forward."""

    def __init__(self, d_model: int, num_heads: int, ff_dim: int) -> None:
        super().__init__()
        self.self_attention_norm = nn.LayerNorm(d_model)
        self.self_attention = Attention(d_model, num_heads)
        self.cross_attention_norm = nn.LayerNorm(d_model)
        self.cross_attention = Attention(d_model, num_heads)
        self.feed_forward_norm = nn.LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, ff_dim)

    def forward(self, queries: Tensor, memory: Tensor) -> Tensor:
        h = self.self_attention_norm(queries)
        queries = queries + self.self_attention(h, h)
        queries = queries + self.cross_attention(self.cross_attention_norm(queries), memory)
        return queries + self.feed_forward(self.feed_forward_norm(queries))


# --------------------------------------------------------------------------- boundary helpers


def _check_vector(name: str, value: Tensor, width: int) -> None:
    if value.dim() != 2 or value.shape[1] != width:
        raise ValueError(f"{name} must have shape (B, {width}), got {tuple(value.shape)}")


def as_frame_batch(name: str, frames: Tensor) -> Tensor:
    """View EPID frames given as (B,256,256), (B,1,256,256) or (B,1,1,256,256) as (B,1,256,256)."""
    grid = (GRID_SIZE, GRID_SIZE)
    if frames.dim() not in (3, 4, 5) or tuple(frames.shape[-2:]) != grid or (
        frames.dim() > 3 and frames.shape[1:-2].numel() != 1
    ):
        raise ValueError(
            f"{name} must have shape (B,256,256), (B,1,256,256) or (B,1,1,256,256), "
            f"got {tuple(frames.shape)}"
        )
    return frames.reshape(frames.shape[0], 1, GRID_SIZE, GRID_SIZE)


def split_banks(leaves: Tensor) -> Tensor:
    """(B, 104) ``[prev 52, curr 52]`` -> (B, 52, 2) per leaf ``(prev, curr)``."""
    return leaves.view(-1, 2, NUM_LEAF_PAIRS).transpose(1, 2)


def merge_banks(pairs: Tensor) -> Tensor:
    """(B, 52, 2) per leaf ``(prev, curr)`` -> (B, 104) ``[prev 52, curr 52]``."""
    return pairs.transpose(1, 2).reshape(-1, NUM_LEAVES)


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ForwardConfig:
    """Sizes of the forward model (``ForwardModel`` names what each one sets); the defaults are
    the design's. Sequences are kept as tuples (lists from a stored config are converted)."""

    d_model: int = 128
    num_heads: int = 4
    ff_dim: int = 256
    num_layers: int = 3
    unet_widths: tuple[int, ...] = (32, 64, 128)
    bottleneck_width: int = 256
    upsample_widths: tuple[int, ...] = (16, 8)

    def __post_init__(self) -> None:
        _as_tuples(self, "unet_widths", "upsample_widths")
        if len(self.upsample_widths) != 2:
            raise ValueError("upsample_widths must name the two 2x stages from 64 to 256 pixels")


@dataclass(frozen=True)
class InverseConfig:
    """Sizes of the inverse model (``InverseModel`` names what each one sets); the defaults are
    the design's. Sequences are kept as tuples (lists from a stored config are converted)."""

    unet_widths: tuple[int, ...] = (32, 64, 128)
    bottleneck_width: int = 256
    d_model: int = 128
    num_heads: int = 2
    ff_dim: int = 256
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    patch_size: int = 4

    def __post_init__(self) -> None:
        _as_tuples(self, "unet_widths")
        if (LATENT_SIZE // 4) % self.patch_size:
            raise ValueError(f"patch_size {self.patch_size} must divide {LATENT_SIZE // 4}")


def _as_tuples(config: object, *names: str) -> None:
    for name in names:
        object.__setattr__(config, name, tuple(getattr(config, name)))


class ForwardModel(nn.Module):
    """Control-point parameters -> EPID frame.

    108 tokens of width ``d_model``: a learned CLS token, one MU token (Linear 1 -> d), two jaw
    tokens (each ``(prev, curr)``, Linear 2 -> d) and 104 leaf tokens (bank A then bank B, each
    ``(prev, curr)``, Linear 2 -> d), plus learned positional embeddings; ``num_layers`` pre-norm
    encoder layers; LayerNorm on the CLS output; Linear d -> 64*64 latent image. A UNet on the
    latent (``unet_widths``, bottleneck ``bottleneck_width``, back to ``unet_widths[0]`` at 64x64),
    2x transposed convs through ``upsample_widths`` (each followed by ReLU) to 256x256, conv3x3 to
    one channel and ReLU give the frame per MU, scaled by ``mu_curr``.
    """

    def __init__(self, config: ForwardConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ForwardConfig()
        d_model, num_heads, ff_dim = config.d_model, config.num_heads, config.ff_dim
        unet_widths, bottleneck_width = config.unet_widths, config.bottleneck_width
        upsample_widths = config.upsample_widths
        self.mu_embedding = nn.Linear(1, d_model)
        self.jaw_embedding = nn.Linear(2, d_model)
        self.leaf_embedding = nn.Linear(2, d_model)
        self.layers = nn.ModuleList(EncoderLayer(d_model, num_heads, ff_dim) for _ in range(config.num_layers))
        self.cls_norm = nn.LayerNorm(d_model)
        self.to_latent = nn.Linear(d_model, LATENT_SIZE * LATENT_SIZE)
        self.encoder = Encoder(1, unet_widths)
        self.bottleneck = ResidualBlock(unet_widths[-1], bottleneck_width)
        self.decoder = Decoder(bottleneck_width, unet_widths)
        upsample_channels = [unet_widths[0], *upsample_widths]
        self.upsample = nn.Sequential(
            *(
                layer
                for c_in, c_out in itertools.pairwise(upsample_channels)
                for layer in (TransposedConv2x2(c_in, c_out), nn.ReLU())
            )
        )
        self.head = nn.Conv2d(upsample_widths[-1], 1, 3, padding=1)
        self.register_buffer("head_index", block_head_index(upsample_widths[-1]), persistent=False)
        init_weights(self)
        self.cls_token = learned_tokens(1, 1, d_model)
        self.positions = learned_tokens(1, 4 + NUM_LEAVES, d_model)

    def tokens(self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor) -> Tensor:
        """Embedded tokens (B, 108, d_model): CLS, MU, jaw_1, jaw_2, 52 bank A, 52 bank B leaves."""
        batch = scalars.shape[0]
        dtype = self.positions.dtype
        mu = (scalars[:, :1] / MU_SCALE).to(dtype)
        jaws = (scalars[:, 1:].reshape(batch, 2, 2) / LEAF_SCALE_MM).to(dtype)
        leaves = (torch.cat([split_banks(leaf_a), split_banks(leaf_b)], dim=1) / LEAF_SCALE_MM).to(dtype)
        return self.positions + torch.cat(
            [
                self.cls_token.expand(batch, -1, -1),
                self.mu_embedding(mu).unsqueeze(1),
                self.jaw_embedding(jaws),
                self.leaf_embedding(leaves),
            ],
            dim=1,
        )

    def forward(self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor) -> tuple[Tensor, Tensor]:
        """Predict ``(epid (B,1,256,256), latent (B,1,64,64))`` from leaves (B,104) mm and scalars (B,5)."""
        _check_vector("leaf_a", leaf_a, NUM_LEAVES)
        _check_vector("leaf_b", leaf_b, NUM_LEAVES)
        _check_vector("scalars", scalars, NUM_SCALARS)
        x = self.tokens(leaf_a, leaf_b, scalars)
        for layer in self.layers:
            x = layer(x)
        latent = self.to_latent(self.cls_norm(x[:, 0])).view(-1, 1, LATENT_SIZE, LATENT_SIZE)
        skips, x = self.encoder(latent)
        x = self.decoder(self.bottleneck(x), skips)
        per_mu = F.relu(upsample_head(self.upsample[-2], self.head, self.head_index, self.upsample[:-2](x)))
        epid = per_mu * scalars[:, :1, None, None].to(per_mu.dtype)
        return epid, latent


class InverseModel(nn.Module):
    """EPID frame pair -> control-point parameters.

    Both frames are max-pooled 4x (two 2x pools) to 64x64 and encoded by separate towers
    (``unet_widths``); each skip and the bottleneck input fuse the two towers by concat + 1x1
    conv; bottleneck ``bottleneck_width``; decoder back to ``unet_widths[0]``; conv3x3 + ReLU
    gives the latent (B,1,64,64). Memory tokens: the latent at 64, 32 and 16 pixels (average
    pooling), each cut into ``patch_size`` patches (256 + 64 + 16 tokens at the default 4) by a
    per-scale patch embedding, plus per-scale positional and scale embeddings, then
    ``num_encoder_layers`` pre-norm encoder layers. A ``num_decoder_layers`` cross-attention
    decoder runs typed queries: 52 leaf queries plus a bank embedding (A, B) with a head
    predicting (prev, curr), one MU query, two jaw queries predicting (prev, curr).

    Attention uses 2 heads of 64 channels by default (the forward model's 4 heads of 32 would
    double the size of the 336 x 336 attention maps, the costliest part of this model on a CPU).
    """

    def __init__(self, config: InverseConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or InverseConfig()
        unet_widths, bottleneck_width, patch_size = config.unet_widths, config.bottleneck_width, config.patch_size
        d_model, num_heads, ff_dim = config.d_model, config.num_heads, config.ff_dim
        self.patch_size = patch_size
        self.prev_encoder = Encoder(1, unet_widths)
        self.curr_encoder = Encoder(1, unet_widths)
        self.skip_fusions = nn.ModuleList(PointwiseConv(2 * width, width) for width in unet_widths)
        self.bottleneck_fusion = PointwiseConv(2 * unet_widths[-1], unet_widths[-1])
        self.bottleneck = ResidualBlock(unet_widths[-1], bottleneck_width)
        self.decoder = Decoder(bottleneck_width, unet_widths)
        self.to_latent = nn.Conv2d(unet_widths[0], 1, 3, padding=1)
        self.patch_embeddings = nn.ModuleList(
            nn.Conv2d(1, d_model, patch_size, stride=patch_size) for _ in range(3)
        )
        self.memory_layers = nn.ModuleList(
            EncoderLayer(d_model, num_heads, ff_dim) for _ in range(config.num_encoder_layers)
        )
        self.memory_norm = nn.LayerNorm(d_model)
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(d_model, num_heads, ff_dim) for _ in range(config.num_decoder_layers)
        )
        self.query_norm = nn.LayerNorm(d_model)
        self.leaf_head = nn.Linear(d_model, 2)
        self.mu_head = nn.Linear(d_model, 1)
        self.jaw_head = nn.Linear(d_model, 2)
        init_weights(self)
        tokens_per_scale = [(LATENT_SIZE // (2**s) // patch_size) ** 2 for s in range(3)]
        self.positions = nn.ParameterList(learned_tokens(1, n, d_model) for n in tokens_per_scale)
        self.scale_embeddings = learned_tokens(3, d_model)
        self.leaf_queries = learned_tokens(NUM_LEAF_PAIRS, d_model)
        self.bank_embeddings = learned_tokens(2, d_model)
        self.mu_query = learned_tokens(1, d_model)
        self.jaw_queries = learned_tokens(2, d_model)

    def encode(self, tower: str, frame: Tensor) -> tuple[Tensor, ...]:
        """One frame's encoder tower, ``tower`` "prev" or "curr": the frame (B,1,256,256), or any
        shape ``as_frame_batch`` accepts -> the tower's skips (finest first) and pooled output."""
        encoders = {"prev": self.prev_encoder, "curr": self.curr_encoder}
        if tower not in encoders:
            raise ValueError(f"tower must be 'prev' or 'curr', got {tower!r}")
        frame = as_frame_batch(f"epid_{tower}", frame)
        # pool first: max-pooling commutes with the positive scale, on 16x fewer pixels
        skips, x = encoders[tower](F.max_pool2d(frame, 4) / MU_SCALE)
        return (*skips, x)

    def latent_image(self, prev: Sequence[Tensor], curr: Sequence[Tensor]) -> Tensor:
        """Both towers' outputs (``encode``) fused and decoded -> latent (B,1,64,64)."""
        skips = [
            fusion(torch.cat([p, c], dim=1))
            for fusion, p, c in zip(self.skip_fusions, prev[:-1], curr[:-1], strict=True)
        ]
        x = self.bottleneck(self.bottleneck_fusion(torch.cat([prev[-1], curr[-1]], dim=1)))
        return F.relu(self.to_latent(self.decoder(x, skips)))

    def memory(self, latent: Tensor) -> Tensor:
        """Multi-scale memory tokens (B, 336, d_model) from the latent (B,1,64,64)."""
        scales = []
        for scale, (embed, positions) in enumerate(zip(self.patch_embeddings, self.positions, strict=True)):
            image = F.avg_pool2d(latent, 2**scale) if scale else latent
            tokens = embed(image).flatten(2).transpose(1, 2)
            scales.append(tokens + positions + self.scale_embeddings[scale])
        x = torch.cat(scales, dim=1)
        for layer in self.memory_layers:
            x = layer(x)
        return self.memory_norm(x)

    def queries(self, batch: int) -> Tensor:
        """Typed queries (B, 107, d_model): 52 bank A leaves, 52 bank B leaves, MU, jaw_1, jaw_2."""
        leaves = (self.leaf_queries.unsqueeze(0) + self.bank_embeddings.unsqueeze(1)).flatten(0, 1)
        return torch.cat([leaves, self.mu_query, self.jaw_queries]).expand(batch, -1, -1)

    def forward(self, epid_prev: Tensor, epid_curr: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Predict ``(leaf_a (B,104) mm, leaf_b (B,104) mm, scalars (B,5), latent (B,1,64,64))``."""
        return self.decode(self.encode("prev", epid_prev), self.encode("curr", epid_curr))

    def decode(self, prev: Sequence[Tensor], curr: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Everything after the two encoder towers: their outputs (``encode``) -> ``forward``'s outputs."""
        latent = self.latent_image(prev, curr)
        memory = self.memory(latent)
        q = self.queries(latent.shape[0])
        for layer in self.decoder_layers:
            q = layer(q, memory)
        q = self.query_norm(q)
        leaves = self.leaf_head(q[:, :NUM_LEAVES]) * LEAF_SCALE_MM
        leaf_a = merge_banks(leaves[:, :NUM_LEAF_PAIRS])
        leaf_b = merge_banks(leaves[:, NUM_LEAF_PAIRS:])
        mu = self.mu_head(q[:, NUM_LEAVES]) * MU_SCALE
        jaws = self.jaw_head(q[:, NUM_LEAVES + 1 :]).flatten(1) * LEAF_SCALE_MM
        return leaf_a, leaf_b, torch.cat([mu, jaws], dim=1), latent


SIZES: dict[str, tuple[ForwardConfig, InverseConfig]] = {
    "full": (ForwardConfig(), InverseConfig()),
    "small": (
        ForwardConfig(d_model=64, ff_dim=128, num_layers=2, unet_widths=(16, 32, 64), bottleneck_width=128),
        InverseConfig(unet_widths=(16, 32, 64), bottleneck_width=128, d_model=64, ff_dim=128),
    ),
    "tiny": (
        ForwardConfig(d_model=16, num_heads=2, ff_dim=32, num_layers=1, unet_widths=(4, 8, 16), bottleneck_width=32,
                      upsample_widths=(4, 4)),
        InverseConfig(unet_widths=(4, 8, 16), bottleneck_width=32, d_model=16, num_heads=2, ff_dim=32,
                      num_encoder_layers=1, num_decoder_layers=1),
    ),
}
"""Named sizes of these models: full (the design's), small and tiny (smoke tests)."""
