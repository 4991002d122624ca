"""The aperture family: models shaped by the physics of an MLC aperture seen by an EPID.

Forward model (``ApertureForwardModel``): the leaves and jaws of the frame's motion, from the prev to the curr
control point, are interpolated at the 7 sub-apertures the delivery integrates (t = 0, 1/6, ..., 1); each covers a
1 mm cell of the leaf grid by the length of its opening inside the cell, with a real MLC's physics learned
(``ApertureFluence``: edge shift, leaf-end offset per bank, leaf, jaw and interleaf transmission, tongue-and-groove
strip, the X jaws' own edge offset and transmission where the arcs have X jaws; the rendering
``epid.synthesis.fluence.aperture_fluence`` that the synthesis uses too). The mean over the sub-apertures is the
frame's fluence per MU; a learned detector response (``epid.models.response.DetectorResponse``: a separable mixture
of Gaussians starting as a 1 mm Gaussian, isotropic 2-D Gaussians that make it non-separable, a broad term weighted
along y, one FFT convolution) turns it into the frame per MU, scaled by ``mu_curr``; given the recorded previous
frame, a learned share of it (the detector's lag) is mixed in. Nothing of the frame synthesis is read: every
physical parameter starts generic and is fitted by training, so the same model can be trained on measured frames;
the one exception is a measured response (``DetectorResponse.start_from``, when the run names a kernel file): the
response then starts as that kernel, which the generic mixture fitted too loosely for the reconstruction (its
leaves' motion within a frame is read from the shape of the blurred edges, and under a 12 mm wide response a learned
kernel a little too narrow or wide reads as motion that is not there). The beam's off-axis profile and field-size
output and the panel's sag (``epid.models.panel``) are held at zero in training and fitted by commissioning. Latent:
the fluence pooled to 4 mm (B, 1, 64, 64).

Inverse model (``LeafEdgeInverseModel``): each frame is normalised by its maximum; where the run names a broad
measured response, the frames are first read through its Wiener filter (the rows the tracking reads,
``read_through``). Per leaf row, a learned combination of the pixel rows around the leaf (the row deblur) gives a
profile along x; its rising steps are bank A's edges, its falling steps bank B's. A small CNN on the (leaf row, x)
grid of both frames, with a coarse branch for context, places a soft window on each edge of each frame; the window's
centroid, spread and mass of the step density (``edge_moments``) of the prev and the curr frame, and how long the
row was open between the jaws during the frame, feed a per-row MLP that returns the prev and curr positions (a
staircase of 7 sub-aperture edges spans prev to curr, so centroid and spread carry the motion). Jaws: the same along
y on each frame's row maxima. MU: the curr frame's sum over the expected frame sum of the predicted aperture
(learned in-field weights per row and column account for the response reaching past the imager). The curr frame's
lag (a learned share of the prev frame) is taken out first. Latent: the predicted aperture's fluence pooled to 4 mm.

Both models work on the strips of their MLC (``epid.synthesis.geometry.StripGrid``, told by the length of
``strip_leaves``): the 52 strips of 5 mm, or for leaves of 2.5 mm (HD120) 104 strips of 2.5 mm, for which the
inverse model's CNN and row deblur see the frames on rows of 0.5 mm (each pixel row twice) and a strip beyond the
MLC's leaves is rendered open (the jaws close it).

The inverse model returns the network's estimate; ``epid.reconstruction.estimate`` refines it by tracking the leaf
edges through the measured frames with the forward model's physics (``epid.reconstruction.leaves``: pair or arc).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from epid.models.legacy import LATENT_SIZE, NUM_SCALARS, _check_vector, as_frame_batch
from epid.models.panel import COMMISSIONING_PARAMETERS, BeamProfile, PanelRecording, sag_shift
from epid.models.response import DetectorResponse, ResponseFilter, centred_kernel, to_imager, to_leaf_grid
from epid.synthesis.fluence import aperture_fluence
from epid.synthesis.geometry import (
    GRID_SIZE,
    LEAF_GRID_ROWS,
    MLC_Y_MIN_MM,
    ROWS_PER_LEAF,
    STRIP_GRIDS,
    STRIPS,
    SUB_APERTURES,
    StripGrid,
    strip_grid,
)

LATENT_POOL = GRID_SIZE // LATENT_SIZE
PHYSICS_LR_FACTOR = 10.0
"""Learning-rate factor of the few physical parameters (response, edge shift, in-field weights)."""
X_JAW_PARAMETERS = ("aperture.x_jaw_edge_offset", "aperture.x_jaw_transmission_change_percent")  # older lack them
X_JAW_SCALARS = 4
"""Columns a beam with X jaws appends to the scalars: [X1 prev, X1 curr, X2 prev, X2 curr] mm."""
MIN_EXPECTED_SUM = 1.0
"""Added to the expected frame sum per MU (pixels), so that MU stays finite for a closed aperture."""
MAX_MU = 200.0
BEYOND_LEAVES_MM = float(GRID_SIZE)
"""Where a strip beyond an MLC's leaves is rendered open to: bank A at -256 mm, bank B at +256 mm."""


def column_centres(device: torch.device | None = None) -> Tensor:
    """x of the 256 imager columns' centres, mm."""
    return torch.arange(GRID_SIZE, device=device) - GRID_SIZE / 2 + 0.5


def leaf_grid_centres(device: torch.device | None = None) -> Tensor:
    """y of the 260 leaf-grid rows' centres, ascending from -129.5 mm."""
    return STRIPS.row_centres(device)


def sub_aperture_positions(prev: Tensor, curr: Tensor) -> Tensor:
    """Positions (...) at prev and curr -> (..., 7) at the sub-apertures t = 0, 1/6, ..., 1."""
    t = torch.linspace(0.0, 1.0, SUB_APERTURES, device=prev.device, dtype=prev.dtype)
    return prev.unsqueeze(-1) + (curr - prev).unsqueeze(-1) * t


def frame_sub_apertures(points: Tensor) -> Tensor:
    """Positions (..., F + 1, K) at consecutive control points -> (..., F, 7, K) at the sub-apertures
    of the F frames between them."""
    return sub_aperture_positions(points[..., :-1, :], points[..., 1:, :]).transpose(-2, -1)


# --------------------------------------------------------------------------- forward model


StripLeaves = tuple[tuple[int, ...], ...]
"""Per layer of an MLC, the leaf covering each strip, -1 beyond the layer's leaves
(``MlcGeometry.strip_layout``); empty when the 52 strips are the leaves."""


def strip_leaves_value(values: object) -> StripLeaves:
    """A stored ``strip_leaves`` (lists or tuples) as tuples of ints; ValueError unless there are at
    most two layers, each naming a leaf for every strip of one grid (52 or 104)."""
    layers = tuple(tuple(int(leaf) for leaf in layer) for layer in values)
    counts = {len(layer) for layer in layers}
    if len(layers) > 2 or len(counts) > 1 or not counts <= {grid.count for grid in STRIP_GRIDS}:
        raise ValueError(f"strip_leaves: expected at most 2 layers of "
                         f"{' or '.join(str(grid.count) for grid in STRIP_GRIDS)} leaf indices, "
                         f"got {[len(layer) for layer in layers]}")
    return layers


def layout_grid(strip_leaves: StripLeaves) -> StripGrid:
    """The strips a model of this ``strip_leaves`` works on (the 52 of 5 mm when empty)."""
    return strip_grid(len(strip_leaves[0])) if strip_leaves else STRIPS


class ApertureFluence(nn.Module):
    """Leaves and jaws of a frame's motion -> mean fluence of each 1 mm cell per MU, with the
    physics of a real MLC learned (``epid.synthesis.fluence.aperture_fluence``, the synthesis's own
    rendering): a shift of every edge (mm, widening), a leaf-end offset per bank (mm), leaf, jaw
    and interleaf transmission (%), the tongue-and-groove strip's width (mm), and the X jaws' edge offset
    and transmission added to the Y jaws' (``X_JAW_PARAMETERS``, learned with ``x_jaws``, else held); all
    start at 0, an opaque aperture with its nominal edges. Returns the fluence (B, 260, 256), y ascending.

    ``strip_leaves`` (per layer, the leaf of each strip) renders a real MLC as the synthesis does:
    interleaf leakage only between two leaves of a layer, and for a dual layer each layer's leaves
    at the most open position their strips' edges allow at each control point (``layer_edges``),
    a cell behind both layers transmitting the leaf transmission squared."""

    def __init__(self, strip_leaves: StripLeaves = (), x_jaws: bool = False) -> None:
        super().__init__()
        self.edge_shift = nn.Parameter(torch.zeros(()))
        self.leaf_end_offset = nn.Parameter(torch.zeros(2))
        self.leaf_transmission_percent = nn.Parameter(torch.zeros(()))
        self.jaw_transmission_percent = nn.Parameter(torch.zeros(()))
        self.interleaf_leakage_percent = nn.Parameter(torch.zeros(()))
        self.tongue_groove_mm = nn.Parameter(torch.zeros(()))
        self.x_jaw_edge_offset = nn.Parameter(torch.zeros(()), requires_grad=x_jaws)
        self.x_jaw_transmission_change_percent = nn.Parameter(torch.zeros(()), requires_grad=x_jaws)
        self.layers = len(strip_leaves)
        self.grid = layout_grid(strip_leaves)
        beyond = None  # (layers, strips): the strips beyond each layer's leaves, where any are
        if self.layers:
            leaves = torch.tensor(strip_leaves, dtype=torch.long)
            under = leaves >= 0
            self.register_buffer("same_leaf", ((leaves[:, :, None] == leaves[:, None, :]) & under[:, None, :]).float(),
                                 persistent=False)
            between = (leaves[:, 1:] != leaves[:, :-1]) & under[:, 1:] & under[:, :-1]
            self.register_buffer("interleaf", between.float(), persistent=False)
            beyond = None if under.all() else ~under
        self.register_buffer("beyond", beyond, persistent=False)

    def layer_edges(self, leaf_a: Tensor, leaf_b: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Strip edges (..., strips) mm -> the edges (..., strips) of ``layer``'s leaves over each
        strip: bank A at the smallest of its strips' edges, bank B at the largest
        (``MlcGeometry.layer_edges``), open beyond the layer's leaves."""
        same = self.same_leaf[layer] > 0
        return self.opened(torch.where(same, leaf_a[..., None, :], torch.inf).amin(-1),
                           torch.where(same, leaf_b[..., None, :], -torch.inf).amax(-1), layer)

    def opened(self, leaf_a: Tensor, leaf_b: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        """Edges (..., strips) with the strips beyond ``layer``'s leaves open (``BEYOND_LEAVES_MM``)."""
        if self.beyond is None:
            return leaf_a, leaf_b
        beyond = self.beyond[layer]
        return (torch.where(beyond, -BEYOND_LEAVES_MM, leaf_a), torch.where(beyond, BEYOND_LEAVES_MM, leaf_b))

    @property
    def tongue_groove_width(self) -> Tensor:
        """The tongue-and-groove strip's width, mm: the parameter clamped at 0, its gradient passed
        through the clamp, so that a step that takes it below 0 early in training does not leave it
        where a clamp would give it no gradient (a run under a 12 mm wide response stopped at
        -0.02 mm; the synthesis's strip is 0.8 mm)."""
        width = self.tongue_groove_mm
        return width + (width.clamp_min(0.0) - width).detach()

    def forward(self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor) -> Tensor:
        """The fluence (B, 260, 256) of leaves (B, 2 x strips) [prev, curr] and scalars (B, 5), or
        (B, 9) with the X jaws' [X1 prev, X1 curr, X2 prev, X2 curr] appended (``X_JAW_SCALARS``)."""
        batch = leaf_a.shape[0]
        jaw_1 = sub_aperture_positions(scalars[:, 1], scalars[:, 2])  # (B, 7)
        jaw_2 = sub_aperture_positions(scalars[:, 3], scalars[:, 4])
        layers: dict[str, object] = {"interleaf": self.interleaf} if self.layers else {}
        if scalars.shape[1] == NUM_SCALARS + X_JAW_SCALARS:
            layers["x_jaws"] = (sub_aperture_positions(scalars[:, 5], scalars[:, 6]),
                                sub_aperture_positions(scalars[:, 7], scalars[:, 8]))
        if self.layers > 1:
            strips = (leaf_a.unflatten(1, (2, self.grid.count)), leaf_b.unflatten(1, (2, self.grid.count)))
            layers["second_layer"] = self.moving_leaves(*(e.flatten(1) for e in self.layer_edges(*strips, 1)))
            leaf_a, leaf_b = (e.flatten(1) for e in self.layer_edges(*strips, 0))
        elif self.beyond is not None:
            strips = self.opened(leaf_a.unflatten(1, (2, self.grid.count)), leaf_b.unflatten(1, (2, self.grid.count)))
            leaf_a, leaf_b = (e.flatten(1) for e in strips)
        a, b = self.moving_leaves(leaf_a, leaf_b)
        weights = leaf_a.new_full((batch, SUB_APERTURES), 1.0 / SUB_APERTURES)
        return aperture_fluence(
            a, b, jaw_1, jaw_2, weights, **layers,
            leaf_end_offset_a=self.edge_shift + self.leaf_end_offset[0],
            leaf_end_offset_b=self.edge_shift + self.leaf_end_offset[1],
            jaw_edge_offset=self.edge_shift, tongue_groove_mm=self.tongue_groove_width,
            leaf_transmission=self.leaf_transmission_percent / 100.0,
            interleaf_leakage=self.interleaf_leakage_percent / 100.0,
            jaw_transmission=self.jaw_transmission_percent / 100.0,
            x_jaw_edge_offset=self.edge_shift + self.x_jaw_edge_offset,
            x_jaw_transmission=(self.jaw_transmission_percent + self.x_jaw_transmission_change_percent) / 100.0,
        )

    @staticmethod
    def moving_leaves(leaf_a: Tensor, leaf_b: Tensor) -> tuple[Tensor, Tensor]:
        """Edges (B, 2 x strips) at prev and curr -> (B, 7, strips) each at the frame's sub-apertures."""
        half = leaf_a.shape[-1] // 2
        return tuple(sub_aperture_positions(edges[:, :half], edges[:, half:]).transpose(1, 2)
                     for edges in (leaf_a, leaf_b))


@dataclass(frozen=True)
class ApertureForwardConfig:
    """The forward model's response: reach (mm each side), the Gaussians' starting widths (mm) and
    the width that holds the weight at the start; the MLC's leaves over the strips and whether its arcs
    have X jaws, whose own physics is then learned (``ApertureFluence``)."""

    response_reach: int = 128
    response_widths_mm: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
    start_width_mm: float = 1.0
    strip_leaves: StripLeaves = ()
    x_jaws: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "response_widths_mm", tuple(float(w) for w in self.response_widths_mm))
        object.__setattr__(self, "strip_leaves", strip_leaves_value(self.strip_leaves))
        if self.start_width_mm not in self.response_widths_mm:
            raise ValueError(f"start_width_mm {self.start_width_mm} must be one of {self.response_widths_mm}")


class ApertureForwardModel(nn.Module):
    """Control point -> EPID frame through the aperture's fluence and a learned detector response."""

    takes_prev_frame = True
    renders_x_jaws = True
    ADDED_PARAMETERS = ("aperture.leaf_end_offset", "aperture.leaf_transmission_percent",
                        "aperture.jaw_transmission_percent", "aperture.interleaf_leakage_percent",
                        "aperture.tongue_groove_mm", "lag_percent", "response.radial_log_width",
                        "response.radial_weight", "response.broad_log_width", "response.broad_gain",
                        "response.measured_logit", "response.measured", "response.measured_present",
                        *COMMISSIONING_PARAMETERS, *X_JAW_PARAMETERS)
    """Parameters that checkpoints written before the realistic physics (and before commissioning's
    beam and panel forms) lack; their initial values leave the model as it was."""

    def __init__(self, config: ApertureForwardConfig | None = None) -> None:
        super().__init__()
        self.config = config or ApertureForwardConfig()
        self.aperture = ApertureFluence(self.config.strip_leaves, self.config.x_jaws)
        self.response = DetectorResponse(
            self.config.response_reach, self.config.response_widths_mm, self.config.start_width_mm
        )
        self.lag_percent = nn.Parameter(torch.zeros(()))
        self.beam = BeamProfile()
        self.sag_mm = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        self.recording = PanelRecording()

    def parameter_groups(self) -> list[tuple[list[nn.Parameter], float]]:
        """Every trainable parameter is physical: one group at ``PHYSICS_LR_FACTOR``."""
        return [([p for p in self.parameters() if p.requires_grad], PHYSICS_LR_FACTOR)]

    @property
    def lag_fraction(self) -> Tensor:
        """The learned share of a recorded frame carried into the next one (0-d)."""
        return self.lag_percent / 100.0

    def fluence(self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor) -> Tensor:
        """The frame's fluence per MU on the leaf grid (B, 260, 256): the aperture's, times the beam's
        off-axis profile."""
        fluence = self.aperture(leaf_a.float(), leaf_b.float(), scalars.float())
        return self.beam.profile(fluence, leaf_grid_centres(fluence.device), column_centres(fluence.device))

    def render(self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor) -> tuple[Tensor, Tensor]:
        """(signal per MU without lag (B, 256, 256), leaf-grid fluence (B, 260, 256)): the response
        to the fluence times the field-size output."""
        fluence = self.fluence(leaf_a, leaf_b, scalars)
        return self.response(fluence) * self.beam.output(fluence)[:, None, None], fluence

    def panel_shift(self, gantry_deg: Tensor) -> Tensor:
        """How far the panel's sag moves the image at gantry angles ``gantry_deg`` (P,): (P, 2) [x, y] mm."""
        return sag_shift(self.sag_mm, gantry_deg.to(self.sag_mm.device))

    def forward(self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor,
                epid_prev: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Predict ``(epid (B,1,256,256), latent (B,1,64,64))`` from leaves (B, 2 x strips) mm and scalars (B,5),
        or (B,9) with a beam's X jaws appended (``ApertureFluence.forward``).

        With the recorded previous frame ``epid_prev`` (B,1,256,256), the prediction is the
        recorded frame (1 - lag) x signal + lag x ``epid_prev`` (learned lag, starting at 0);
        without it, the signal alone."""
        _check_vector("leaf_a", leaf_a, 2 * self.aperture.grid.count)
        _check_vector("leaf_b", leaf_b, 2 * self.aperture.grid.count)
        if scalars.shape[-1] != NUM_SCALARS + X_JAW_SCALARS:
            _check_vector("scalars", scalars, NUM_SCALARS)
        per_mu, fluence = self.render(leaf_a, leaf_b, scalars)
        epid = (per_mu * scalars[:, :1, None].float()).unsqueeze(1)
        if epid_prev is not None:
            lag = self.lag_fraction
            epid = (1.0 - lag) * epid + lag * as_frame_batch("epid_prev", epid_prev).float()
        return epid, fluence_latent(fluence)


def fluence_latent(fluence: Tensor) -> Tensor:
    """A leaf-grid fluence (B, 260, 256) -> (B, 1, 64, 64): the imager's fluence pooled to 4 mm."""
    return F.avg_pool2d(to_imager(fluence).unsqueeze(1), LATENT_POOL)


# --------------------------------------------------------------------------- inverse model


class RowBlock(nn.Module):
    """Residual block on the (leaf row, x) grid: a conv along x, ReLU, a conv over neighbouring leaf
    rows and x, the shortcut, ReLU. (B, C, strips, W) -> same."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.along = nn.Conv2d(channels, channels, (1, width), padding=(0, width // 2))
        self.across = nn.Conv2d(channels, channels, (3, width), padding=(1, width // 2))

    def forward(self, h: Tensor) -> Tensor:
        return F.relu(h + self.across(F.relu(self.along(h))))


class LineBlock(nn.Module):
    """Residual block of two dilated convolutions along one axis. (B, C, L) -> same."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.first = nn.Conv1d(channels, channels, 5, padding=2 * dilation, dilation=dilation)
        self.second = nn.Conv1d(channels, channels, 5, padding=2 * dilation, dilation=dilation)

    def forward(self, h: Tensor) -> Tensor:
        return F.relu(h + self.second(F.relu(self.first(h))))


def boundary_softmax(logits: Tensor) -> Tensor:
    """Logits on n cells (..., n) -> soft windows on their n - 1 inner boundaries (..., n - 1)."""
    return torch.softmax(0.5 * (logits[..., 1:] + logits[..., :-1]), -1)


def edge_moments(density: Tensor, window: Tensor, positions: Tensor, floor: float = 1e-4
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Centroid (mm), spread (mm) and mean of a step ``density`` seen through a soft ``window``.

    density, window: (..., n) >= 0 on the cell boundaries at ``positions`` (n,) mm; the window
    sums to 1. ``floor`` keeps the centroid at the window's own where there is no step.
    """
    weights = (density + floor) * window
    total = weights.sum(-1)
    centre = (weights * positions).sum(-1) / total
    spread = ((weights * (positions - centre.unsqueeze(-1)).square()).sum(-1) / total).clamp_min(1e-6).sqrt()
    return centre, spread, (density * window).sum(-1)


def row_visibility(jaw_1: tuple[Tensor, Tensor], jaw_2: tuple[Tensor, Tensor],
                   grid: StripGrid = STRIPS) -> tuple[Tensor, Tensor]:
    """How each strip of ``grid`` is open between moving jaws during a frame.

    jaw_1, jaw_2: (start, end) positions (B,) mm. Returns (open fraction of the strip averaged
    over the 7 sub-apertures, mean time t of its opening), each (B, strips).
    """
    device = jaw_1[0].device
    leaf_lower_mm = torch.arange(grid.count, device=device) * grid.strip_mm + MLC_Y_MIN_MM
    t = torch.linspace(0.0, 1.0, SUB_APERTURES, device=device)
    low = torch.maximum(sub_aperture_positions(*jaw_1)[:, :, None], leaf_lower_mm)
    high = torch.minimum(sub_aperture_positions(*jaw_2)[:, :, None], leaf_lower_mm + grid.strip_mm)
    open_fraction = ((high - low) / grid.strip_mm).clamp(0.0, 1.0)  # (B, 7, strips)
    mean_time = (open_fraction * t[None, :, None]).sum(1) / (open_fraction.sum(1) + 1e-3)
    return open_fraction.mean(1), mean_time


class MotionReadout(nn.Module):
    """One edge's (prev, curr) positions from the moments of its two frames.

    Features: curr minus prev centroid, both spreads, both log step masses, the mass change and
    ``extra`` per-row features; an MLP returns offsets (mm) from the prev and curr centroids, starting at zero.
    """

    def __init__(self, hidden: int, extra: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6 + extra, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 2))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, prev: tuple[Tensor, Tensor, Tensor], curr: tuple[Tensor, Tensor, Tensor],
                extra: Tensor | None = None) -> tuple[Tensor, Tensor]:
        features = torch.stack([curr[0] - prev[0], prev[1], curr[1], torch.log(prev[2] + 1e-3),
                                torch.log(curr[2] + 1e-3), curr[2] - prev[2]], -1)
        if extra is not None:
            features = torch.cat([features, extra], -1)
        offsets = self.net(features)
        return prev[0] + offsets[..., 0], curr[0] + offsets[..., 1]


@dataclass(frozen=True)
class LeafEdgeInverseConfig:
    """Sizes of the inverse model: the window CNN (``channels`` on the (leaf row, x) grid in
    ``depth`` blocks, a coarse branch of ``coarse_channels`` pooled ``coarse_pool`` x), the jaw
    CNN, the readout MLPs' width, the pixel rows the row deblur reaches beyond its leaf, and the
    stages of the leaf tracking that refines the estimate with the forward model's physics
    (``epid.reconstruction.leaves``: (range, grid step) mm each; none = the network's estimate);
    the MLC's leaves over the strips, as the forward model's (its aperture estimates the MU)."""

    channels: int = 8
    depth: int = 3
    coarse_channels: int = 16
    coarse_depth: int = 2
    coarse_pool: int = 8
    jaw_channels: int = 16
    jaw_depth: int = 3
    readout_hidden: int = 32
    deblur_reach_rows: int = 10
    track_stages: tuple[tuple[float, float], ...] = ((16.0, 1.0), (2.0, 0.2), (16.0, 1.0), (1.0, 0.1))
    strip_leaves: StripLeaves = ()

    RETIRED_FIELDS = ("fit_steps", "split_rounds", "refine_steps")
    """Fields of configs stored before leaf tracking: the eval-mode fit's descent steps (0 = no fit),
    split rounds and refine steps."""

    @classmethod
    def from_stored(cls, values: dict) -> LeafEdgeInverseConfig:
        """A stored config; one of the retired fit refines with the default stages where its fit
        ran (fit_steps > 0), else not at all."""
        values = dict(values)
        retired = {name: values.pop(name) for name in cls.RETIRED_FIELDS if name in values}
        if retired and "track_stages" not in values and retired.get("fit_steps", 0) <= 0:
            values["track_stages"] = ()
        return cls(**values)

    def __post_init__(self) -> None:
        if GRID_SIZE % self.coarse_pool:
            raise ValueError(f"coarse_pool {self.coarse_pool} must divide {GRID_SIZE}")
        if min(self.channels, self.coarse_channels, self.jaw_channels, self.readout_hidden) < 1:
            raise ValueError("channel counts must be positive")
        object.__setattr__(self, "track_stages", tuple((float(r), float(s)) for r, s in self.track_stages))
        object.__setattr__(self, "strip_leaves", strip_leaves_value(self.strip_leaves))
        if any(step <= 0 or reach < 0 for reach, step in self.track_stages):
            raise ValueError(f"track_stages {self.track_stages}: expected (range >= 0, grid step > 0) mm pairs")


READ_THROUGH_REACH = ApertureForwardConfig.response_reach
"""Reach of the measured response the inverse network reads frames through, mm each side: the default
forward model's (``ApertureForwardConfig.response_reach``)."""


class LeafEdgeInverseModel(nn.Module):
    """EPID frame pair -> control points through leaf-edge moments (see the module docstring)."""

    ADDED_PARAMETERS = (*ApertureForwardModel.ADDED_PARAMETERS[:6], *X_JAW_PARAMETERS, "response_kernel",
                        "response_present")
    """As ``ApertureForwardModel.ADDED_PARAMETERS``: the aperture's physics, the lag and the measured
    response read through (``read_through``)."""

    def __init__(self, config: LeafEdgeInverseConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or LeafEdgeInverseConfig()
        c = config.channels
        self.grid = layout_grid(config.strip_leaves)
        self.stem = nn.Conv2d(2, c, (9, 7), stride=(ROWS_PER_LEAF, 1), padding=(2, 3))
        self.blocks = nn.Sequential(*(RowBlock(c, 7) for _ in range(config.depth)))
        self.to_coarse = nn.Conv2d(c, config.coarse_channels, 1)
        self.coarse = nn.Sequential(*(RowBlock(config.coarse_channels, 5) for _ in range(config.coarse_depth)))
        self.from_coarse = nn.Conv2d(config.coarse_channels, c, 1)
        self.refine = RowBlock(c, 7)
        self.window_head = nn.Conv2d(c, 4, (1, 7), padding=(0, 3))  # bank A prev, curr; bank B prev, curr
        reach = config.deblur_reach_rows * self.grid.rows_per_pixel
        self.row_deblur = nn.Conv2d(1, 1, (ROWS_PER_LEAF + 2 * reach, 1), stride=(ROWS_PER_LEAF, 1),
                                    padding=(reach, 0), bias=False)
        with torch.no_grad():
            self.row_deblur.weight.zero_()
            self.row_deblur.weight[0, 0, reach:reach + ROWS_PER_LEAF, 0] = 1.0 / ROWS_PER_LEAF
        self.leaf_readout = nn.ModuleList(MotionReadout(config.readout_hidden, extra=4) for _ in range(2))
        self.jaw_stem = nn.Conv1d(4, config.jaw_channels, 5, padding=2)
        self.jaw_blocks = nn.Sequential(*(LineBlock(config.jaw_channels, 2**i) for i in range(config.jaw_depth)))
        self.jaw_head = nn.Conv1d(config.jaw_channels, 4, 3, padding=1)  # jaw_1 prev, curr; jaw_2 prev, curr
        self.jaw_readout = nn.ModuleList(MotionReadout(config.readout_hidden) for _ in range(2))
        self.aperture = ApertureFluence(config.strip_leaves)
        self.in_field_y = nn.Parameter(torch.zeros(LEAF_GRID_ROWS))
        self.in_field_x = nn.Parameter(torch.zeros(GRID_SIZE))
        self.lag_percent = nn.Parameter(torch.zeros(()))
        size = 2 * READ_THROUGH_REACH + 1
        self.register_buffer("response_kernel", torch.zeros(size, size))
        self.register_buffer("response_present", torch.zeros(()))
        self._filter: tuple[Tensor, ResponseFilter | None] | None = None

    def read_through(self, kernel: Tensor) -> None:
        """Read every frame through the Wiener filter of a measured response ``kernel`` (2-D, odd
        sides, centred, rows along y; cut to ``READ_THROUGH_REACH``) where that response is broad
        (``ResponseFilter.broad``): the frames the network reads are then the fluence seen through a
        Gaussian of ``ResponseFilter.target_sigma_mm``, the rows the reconstruction's tracking reads.
        A response no broader than the tracking was tuned with leaves the frames as they are."""
        with torch.no_grad():
            self.response_kernel.copy_(centred_kernel(kernel, READ_THROUGH_REACH))
            self.response_present.fill_(1.0)

    def response_filter(self) -> ResponseFilter | None:
        """The filter the frames are read through (``read_through``), None where none applies; built
        once per kernel and device (``ResponseFilter.of_kernel``), not again where the kernel is only
        copied over (DistributedDataParallel broadcasts the buffers at every step)."""
        kernel = self.response_kernel * self.response_present  # zeros where none is read through
        if self._filter is None or self._filter[0].device != kernel.device or not torch.equal(self._filter[0], kernel):
            response_filter = ResponseFilter.of_kernel(kernel, kernel.device) if bool(self.response_present) else None
            self._filter = (kernel, response_filter if response_filter and response_filter.broad(self.grid) else None)
        return self._filter[1]

    def parameter_groups(self) -> list[tuple[list[nn.Parameter], float]]:
        """The network at factor 1, the physical parameters (edge shift, in-field weights) at
        ``PHYSICS_LR_FACTOR``."""
        physical = [p for p in (*self.aperture.parameters(), self.in_field_y, self.in_field_x, self.lag_percent)
                    if p.requires_grad]
        ids = {id(p) for p in physical}
        network = [p for p in self.parameters() if p.requires_grad and id(p) not in ids]
        return [(network, 1.0), (physical, PHYSICS_LR_FACTOR)]

    def forward(self, epid_prev: Tensor, epid_curr: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The network's estimate ``(leaf_a (B, 2 x strips) mm, leaf_b (B, 2 x strips) mm, scalars (B,5),
        latent (B,1,64,64))``; ``epid.reconstruction.estimate.pair_estimate`` refines it with the forward model."""
        recorded = torch.cat([as_frame_batch("epid_prev", epid_prev), as_frame_batch("epid_curr", epid_curr)], 1)
        lag, response_filter = self.lag_percent / 100.0, self.response_filter()
        frames = remove_lag(recorded.float(), lag)
        # the filter is linear: the recorded frames (data: no gradient to carry) filtered, then the lag taken out
        rows = None if response_filter is None else remove_lag(response_filter.filtered_rows(recorded), lag)
        leaf_a, leaf_b, jaws = self.estimate(frames, rows)
        mu = self.mu_estimate(frames[:, 1], leaf_a.detach(), leaf_b.detach(), jaws.detach())
        scalars = torch.cat([mu[:, None], jaws], 1)
        return leaf_a, leaf_b, scalars, fluence_latent(self.aperture(leaf_a, leaf_b, scalars))

    def estimate(self, frames: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The network's estimate from frames (B, 2, 256, 256) [prev, curr], or from ``rows`` (B, 2, 260,
        256), the frames read through the response's filter (``read_through``): leaf_a, leaf_b (B, 2 x
        strips) and jaws (B, 4) [jaw_1 prev, jaw_1 curr, jaw_2 prev, jaw_2 curr], mm. The jaws are read
        on the 1 mm rows, the leaves on the strips' rows (each pixel row repeated on the fine strips)."""
        batch = frames.shape[0]
        peak = frames.amax(dim=(-2, -1), keepdim=True).clamp_min(1e-6)
        leaf_grid = to_leaf_grid(frames / peak) if rows is None else rows / peak  # (B, 2, 260, 256)
        if leaf_grid.device.type == "cpu":
            leaf_grid = leaf_grid.contiguous(memory_format=torch.channels_last)
        jaws = self.jaws(leaf_grid)
        jaw_now = jaws.detach()
        curr_open = row_visibility((jaw_now[:, 0], jaw_now[:, 1]), (jaw_now[:, 2], jaw_now[:, 3]), self.grid)
        prev_open = row_visibility((2 * jaw_now[:, 0] - jaw_now[:, 1], jaw_now[:, 0]),
                                   (2 * jaw_now[:, 2] - jaw_now[:, 3], jaw_now[:, 2]), self.grid)
        visibility = torch.stack([*prev_open, *curr_open], -1)  # (B, strips, 4)
        strip_rows = self.grid.strip_rows(leaf_grid)  # (B, 2, grid rows, 256)
        windows = boundary_softmax(self.window_logits(strip_rows))  # (B, 4, strips, 255)
        profiles = self.row_deblur(strip_rows.reshape(batch * 2, 1, self.grid.rows, GRID_SIZE))
        step = torch.diff(profiles.reshape(batch, 2, self.grid.count, GRID_SIZE), dim=-1)
        boundaries = column_centres(frames.device)[1:] - 0.5
        banks = []
        for bank, density in enumerate((F.relu(step), F.relu(-step))):
            prev = edge_moments(density[:, 0], windows[:, 2 * bank], boundaries)
            curr = edge_moments(density[:, 1], windows[:, 2 * bank + 1], boundaries)
            banks.append(torch.cat(self.leaf_readout[bank](prev, curr, visibility), 1))
        return banks[0], banks[1], jaws

    def window_logits(self, leaf_grid: Tensor) -> Tensor:
        """The CNN on both frames' rows of the strips (B, 2, grid rows, 256) -> window logits (B, 4, strips, 256)."""
        pool = self.config.coarse_pool
        h = self.blocks(F.relu(self.stem(leaf_grid)))
        coarse = self.coarse(F.avg_pool2d(self.to_coarse(h), (1, pool)))
        h = self.refine(h + self.from_coarse(coarse).repeat_interleave(pool, dim=-1))
        return self.window_head(h)

    def jaws(self, leaf_grid: Tensor) -> Tensor:
        """Jaws (B, 4) [jaw_1 prev, jaw_1 curr, jaw_2 prev, jaw_2 curr] from the row maxima."""
        row_max = leaf_grid.amax(-1)  # (B, 2, 260)
        h = F.relu(self.jaw_stem(torch.cat([leaf_grid.mean(-1), row_max], 1)))
        windows = boundary_softmax(self.jaw_head(self.jaw_blocks(h)))  # (B, 4, 259)
        step = torch.diff(row_max, dim=-1)
        boundaries = leaf_grid_centres(leaf_grid.device)[1:] - 0.5
        jaws = []
        for side, density in enumerate((F.relu(step), F.relu(-step))):
            prev = edge_moments(density[:, 0], windows[:, 2 * side], boundaries)
            curr = edge_moments(density[:, 1], windows[:, 2 * side + 1], boundaries)
            jaws.extend(self.jaw_readout[side](prev, curr))
        return torch.stack(jaws, 1)

    def mu_estimate(self, frame: Tensor, leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor) -> Tensor:
        """MU (B,) of the curr frame (B, 256, 256): its sum over the expected sum per MU of the
        aperture the leaves and jaws describe (in-field weights learned per row and column)."""
        fluence = self.aperture(leaf_a, leaf_b, torch.cat([jaws.new_zeros(len(jaws), 1), jaws], 1))
        weight = (1 + self.in_field_y)[:, None] * (1 + self.in_field_x)[None, :]
        expected = (fluence * weight).sum((-2, -1)) + MIN_EXPECTED_SUM
        log_mu = torch.log(frame.sum((-2, -1)).clamp_min(1e-6)) - torch.log(expected)
        return torch.exp(log_mu.clamp(max=math.log(MAX_MU)))


def remove_lag(frames: Tensor, lag: Tensor | float) -> Tensor:
    """Frame pairs (B, 2, 256, 256) [prev, curr] with the curr frame's lag removed: the curr
    frame recorded (1 - lag) S + lag x prev becomes the signal S (the prev frame keeps the lag of
    the frame before it, which the pair does not show)."""
    curr = (frames[:, 1] - lag * frames[:, 0]) / (1.0 - lag)
    return torch.stack([frames[:, 0], curr], 1)


SIZES: dict[str, tuple[ApertureForwardConfig, LeafEdgeInverseConfig]] = {
    "full": (ApertureForwardConfig(), LeafEdgeInverseConfig()),
    "small": (ApertureForwardConfig(), LeafEdgeInverseConfig(depth=2, coarse_depth=1,
                                                              track_stages=((6.0, 0.5), (0.8, 0.1)))),
    "tiny": (
        ApertureForwardConfig(response_reach=32, response_widths_mm=(1.0, 4.0, 16.0)),
        LeafEdgeInverseConfig(channels=4, depth=1, coarse_channels=4, coarse_depth=1, jaw_channels=4, jaw_depth=1,
                              readout_hidden=8, deblur_reach_rows=2, track_stages=((2.0, 1.0),)),
    ),
}
"""Named sizes: full, small (a shallower window CNN, a shorter fit) and tiny (smoke tests)."""
