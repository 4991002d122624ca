"""A clinic's beam and panel: the off-axis profile, the field-size output, the panel's sag, and how
the panel records a series of frames (a lag of several time constants, a non-linear response).

Forms a real linac and EPID show that the synthesis does not have, which the aperture
family's forward model (``epid.models.aperture``) carries so that commissioning
(``epid.evaluation.commission``) can fit them to a clinic's measured images:

- *off-axis profile* (``BeamProfile.profile``): the fluence times
  1 + t_x x / R + t_y y / R + c_2 (r / R)^2 + c_4 (r / R)^4, R = ``PROFILE_RADIUS_MM``: a flattened
  beam's horns (its fluence rises off the axis) and a steering tilt;
- *field-size output* (``BeamProfile.output``): the frame times 1 + k ln(A / ``REFERENCE_AREA_MM2``),
  A the field's area (the 1 mm cells whose fluence reaches ``FIELD_SHARE`` of the frame's highest,
  at least ``MIN_AREA_MM2``; the leaves' transmission adds nothing): head scatter and the panel's
  own scatter make a large field's output per MU higher than a small one's;
- *sag* (``panel_shift``): the panel and its image move with the gantry angle g, by
  s_xs sin g + s_xc (1 - cos g) along x and s_ys sin g + s_yc (1 - cos g) along y (mm at the
  isocentre); a prediction is moved by it piece by piece (``shift_frames``), a measured frame is
  moved back before its leaves are reconstructed;
- *recording* (``PanelRecording``): a series of frames F_k (the model's prediction with its own
  one-frame lag) recorded as R_k = N_k + sum_c a_c (M_c,k - N_k), where N_k = F_k (F_k / 1 model
  unit)^(-p) is the panel's mildly non-linear response (p > 0: it saturates) and M_c,k the
  exponential average, over ``LAG_FRAMES[c]`` frames, of the frames N before frame k (dark before
  the first): each component a_c carries a share of the signal into frames seconds later, as an
  a-Si panel's trapped charge does, and keeps the series' total. One image (an integrated one) is
  left as it is: the panel carried the lag within it, and its readouts' signals are not known. A
  measured series is read back through its exact inverse (``PanelRecording.undo``) before its
  leaves are reconstructed.

Every coefficient starts at 0 (the model as it was) and is held during training (the synthesis has
none of these forms, and a parameter no loss reaches would stall DistributedDataParallel);
commissioning frees them (``COMMISSIONING_PARAMETERS``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROFILE_RADIUS_MM = 100.0
"""Radius that scales the off-axis profile's coordinates."""
REFERENCE_AREA_MM2 = 1.0e4
"""Open area at which the field-size output is 1 (a 10 x 10 cm field)."""
FIELD_SHARE = 0.5
"""Share of a frame's highest fluence a cell reaches to count in the field's area."""
MIN_AREA_MM2 = 100.0
"""Smallest open area the field-size output takes (a closed aperture keeps a finite output)."""
LAG_FRAMES = (2.0, 8.0, 32.0)
"""Time constants (frames) of the recording's lag components (``PanelRecording``)."""
RECORDING_PARAMETERS = ("recording.lag_2_percent", "recording.lag_8_percent", "recording.lag_32_percent",
                        "recording.power_percent")
COMMISSIONING_PARAMETERS = ("beam.off_axis", "beam.output_per_log_area", "sag_mm", *RECORDING_PARAMETERS)
"""The forward model's parameters of these forms: held in training, fitted in commissioning."""


class BeamProfile(nn.Module):
    """The off-axis profile and the field-size output (module docstring): ``off_axis`` (4,) the
    coefficients t_x, t_y, c_2, c_4 and ``output_per_log_area`` k, all 0 at the start."""

    def __init__(self) -> None:
        super().__init__()
        self.off_axis = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.output_per_log_area = nn.Parameter(torch.zeros(()), requires_grad=False)

    def profile(self, fluence: Tensor, y_mm: Tensor, x_mm: Tensor) -> Tensor:
        """``fluence`` (B, Y, X) on cells centred at ``y_mm`` (Y,) and ``x_mm`` (X,) times the off-axis
        profile."""
        y, x = y_mm[:, None] / PROFILE_RADIUS_MM, x_mm[None, :] / PROFILE_RADIUS_MM
        radius2 = x * x + y * y
        t_x, t_y, c_2, c_4 = self.off_axis
        return fluence * (1.0 + t_x * x + t_y * y + c_2 * radius2 + c_4 * radius2 * radius2)

    def output(self, fluence: Tensor) -> Tensor:
        """The field-size output (B,) of fluences per MU (B, Y, X) on 1 mm cells."""
        cells = fluence.detach().flatten(1)
        area = (cells >= FIELD_SHARE * cells.amax(1, keepdim=True)).sum(1).to(fluence.dtype).clamp_min(MIN_AREA_MM2)
        return 1.0 + self.output_per_log_area * torch.log(area / REFERENCE_AREA_MM2)


class PanelRecording(nn.Module):
    """How the panel records a series of frames (module docstring): ``lag_2_percent``,
    ``lag_8_percent``, ``lag_32_percent`` the shares a_c (%) of the lag components of ``LAG_FRAMES``
    and ``power_percent`` the response's power p (%), all 0 at the start (the frames as they are)."""

    def __init__(self) -> None:
        super().__init__()
        for frames in LAG_FRAMES:
            self.register_parameter(f"lag_{frames:g}_percent", nn.Parameter(torch.zeros(()), requires_grad=False))
        self.power_percent = nn.Parameter(torch.zeros(()), requires_grad=False)

    def shares(self) -> list[Tensor]:
        """The lag components' shares a_c (fractions), in the order of ``LAG_FRAMES``."""
        return [getattr(self, f"lag_{frames:g}_percent") / 100.0 for frames in LAG_FRAMES]

    def forward(self, frames: Tensor) -> Tensor:
        """The series ``frames`` (K, H, W), K > 1, as the panel records it; one image, or all
        coefficients 0, as it is."""
        if self._identity(frames):
            return frames
        power = float(self.power_percent) / 100.0  # a number: frames may lie on another device than the model
        response = torch.where(frames > 0, frames.clamp_min(1e-12) ** (1.0 - power), frames)
        return self._carried(response, undo=False)

    def undo(self, recorded: Tensor) -> Tensor:
        """The series (K, H, W) that the panel recorded as ``recorded`` (``forward``'s exact inverse):
        each frame's carried share taken out given the frames before it as undone, then the response's
        power; one image, or all coefficients 0, as it is. Measured frames are read with it before
        their leaves are reconstructed."""
        if self._identity(recorded):
            return recorded
        response = self._carried(recorded, undo=True)
        power = float(self.power_percent) / 100.0
        return torch.where(response > 0, response.clamp_min(1e-12) ** (1.0 / (1.0 - power)), response)

    def _identity(self, frames: Tensor) -> bool:
        return len(frames) < 2 or not any(bool(value != 0) for value in (*self.shares(), self.power_percent))

    def _carried(self, frames: Tensor, undo: bool) -> Tensor:
        """The lag components applied to responses N (K, H, W): R_k = (1 - sum a_c) N_k + sum a_c M_c,k;
        with ``undo``, ``frames`` are R and N is solved frame by frame. The averages M (C, H, W) are
        updated in place, one frame at a time."""
        shares = torch.tensor([float(share) for share in self.shares()], dtype=frames.dtype,
                              device=frames.device)[:, None, None]
        kept = 1.0 - float(shares.sum())
        rates = torch.tensor([1.0 - math.exp(-1.0 / constant) for constant in LAG_FRAMES],
                             dtype=frames.dtype, device=frames.device)[:, None, None]
        averages = frames.new_zeros((len(LAG_FRAMES), *frames.shape[1:]))
        series = torch.empty_like(frames)
        for index, frame in enumerate(frames):
            carried = (shares * averages).sum(0)
            if undo:
                response = torch.div(frame - carried, kept, out=series[index])
            else:
                response = frame
                torch.add(carried, frame, alpha=kept, out=series[index])
            averages.addcmul_(rates, response - averages)
        return series


def sag_shift(sag_mm: Tensor, gantry_deg: Tensor) -> Tensor:
    """The panel's shift (P, 2) [x, y] mm at gantry angles ``gantry_deg`` (P,) for sag coefficients
    ``sag_mm`` (2, 2): rows x and y, columns the sin g and 1 - cos g terms (module docstring)."""
    angle = torch.deg2rad(gantry_deg.to(sag_mm.dtype))
    terms = torch.stack([torch.sin(angle), 1.0 - torch.cos(angle)], 1)  # (P, 2)
    return terms @ sag_mm.T


def shift_frames(frames: Tensor, shift_mm: Tensor, pixel_mm: float = 1.0, edge: bool = False) -> Tensor:
    """``frames`` (P, H, W) (row 0 the most positive y) with their content moved by ``shift_mm``
    (P, 2) [x, y] mm, linearly interpolated; where it enters from beyond the frame, zero, or with
    ``edge`` the frame's edge row or column continued (``grid_sample``'s border padding: a field
    that reaches past the frame goes on past it); differentiable in both. Bilinear interpolation of
    a translation is separable: each axis is read at its own fractional offset: ``grid_sample``'s
    values without its (P, H, W, 2) grid (64 frames of 256 x 256 in 30 ms against 96 ms, 2 cores of
    an AMD EPYC with AVX2)."""
    shift = shift_mm.to(frames.dtype) / pixel_mm
    # content moved by +x reads the columns at c - x; moved by +y (towards row 0) the rows at r + y
    moved = _read_at(frames, -shift[:, 0], dim=2, edge=edge)
    return _read_at(moved, shift[:, 1], dim=1, edge=edge)


def _read_at(frames: Tensor, offset: Tensor, dim: int, edge: bool) -> Tensor:
    """``frames`` (P, H, W) read along ``dim`` (1 rows, 2 columns) at index i + ``offset`` (P,),
    linearly interpolated, beyond the frame zero or (``edge``) the edge's value: two windows of
    each frame, one index apart."""
    size = frames.shape[dim]
    whole = torch.floor(offset.detach())
    fraction = (offset - whole).to(frames.dtype)
    window = _edge_window if edge else _window
    moved = [torch.lerp(window(frame, start, size, dim - 1), window(frame, start + 1, size, dim - 1), weight)
             for frame, start, weight in zip(frames, whole.long().tolist(), fraction, strict=True)]
    return torch.stack(moved)


def _edge_window(frame: Tensor, start: int, size: int, dim: int) -> Tensor:
    """``size`` entries of ``frame`` (2-D) along ``dim`` from index ``start``, the edge's beyond it."""
    indices = torch.arange(start, start + size, device=frame.device).clamp_(0, frame.shape[dim] - 1)
    return frame.index_select(dim, indices)


def _window(frame: Tensor, start: int, size: int, dim: int) -> Tensor:
    """``size`` entries of ``frame`` (2-D) along ``dim`` from index ``start``, zero where beyond it."""
    total = frame.shape[dim]
    low, high = min(max(start, 0), total), min(max(start + size, 0), total)
    if high == low:
        return frame.new_zeros(frame.shape[:dim] + (size,) + frame.shape[dim + 1:])
    part = frame.narrow(dim, low, high - low)
    before, after = low - start, start + size - high
    if before or after:
        part = F.pad(part, (before, after, 0, 0) if dim == 1 else (0, 0, before, after))
    return part
