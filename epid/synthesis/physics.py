"""What a real EPID records beyond the ideal aperture: the synthesis's physics settings.

``ideal`` physics is the legacy synthesis (design section 4): an opaque binary aperture on the
1 mm grid, the response kernel, noise. The other effects each have one setting in a physical
unit (all zero in ``ideal``):

* leaf transmission (%): the fraction of the open fluence that passes through a closed leaf;
* jaw transmission (%): the same for the Y jaws (jaw_1, jaw_2);
* X jaw transmission (%): the same for the X jaws of an MLC that has them (X1, X2);
* leaf-end offset (mm): rounded leaf ends put the radiation edge of every leaf this far
  outside its nominal position (half the dosimetric leaf gap), so each opening is widened by
  the offset at both ends;
* tongue-and-groove (mm): the width of the strip centred on each boundary between two
  neighbouring leaves that is open only where both leaves are open (the tongue of one leaf
  shades the groove of the other), the under-dose strips of a sliding-window delivery;
* interleaf leakage (%): the extra transmission of closed leaves in the 1 mm rows on each side
  of a boundary between leaves;
* lag (%): the share of the signal a frame leaves behind in the detector, released in the
  next frame. Recorded frame f = (1 - lag) S_f + lag R_(f-1): each frame carries lag x the
  previous recorded frame (a first-order ghost that decays geometrically);
* arm backscatter (%): radiation scattered back from the support arm under the panel, a broad
  blur of the fluence (``BACKSCATTER_SIGMA_MM``) whose weight rises linearly along y from 0 at
  the top row of the image to twice the setting at the bottom row, so the signal a field gets
  grows with its size and with its distance towards the arm.

``PRESETS`` names ``ideal`` and ``realistic`` (typical values of a current linac and aSi panel);
each variable set on its own overrides the preset's value.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

BACKSCATTER_SIGMA_MM = 40.0
"""Width (Gaussian sigma) of the arm backscatter blur."""
LAG_TAIL = 1e-9
"""Lag terms smaller than this share of a frame's signal are dropped (the ghost's truncation)."""

LIMITS = {
    "leaf_transmission_percent": 20.0,
    "jaw_transmission_percent": 20.0,
    "x_jaw_transmission_percent": 20.0,
    "leaf_end_offset_mm": 3.0,
    "tongue_groove_mm": 2.0,
    "interleaf_leakage_percent": 20.0,
    "lag_percent": 20.0,
    "backscatter_percent": 30.0,
}
"""Largest accepted value of each setting (all are >= 0)."""


@dataclass(frozen=True)
class Physics:
    """The physics of the synthesised frames (module docstring); all zero is ``ideal``."""

    leaf_transmission_percent: float = 0.0
    jaw_transmission_percent: float = 0.0
    x_jaw_transmission_percent: float = 0.0
    leaf_end_offset_mm: float = 0.0
    tongue_groove_mm: float = 0.0
    interleaf_leakage_percent: float = 0.0
    lag_percent: float = 0.0
    backscatter_percent: float = 0.0

    def __post_init__(self) -> None:
        for name, limit in LIMITS.items():
            value = float(getattr(self, name))
            if not (math.isfinite(value) and 0.0 <= value <= limit):
                raise ValueError(f"{name}={value:g}: expected a number in 0..{limit:g}")
            object.__setattr__(self, name, value)

    @property
    def is_ideal(self) -> bool:
        """True when every effect is off: frames are the legacy synthesis, bit for bit."""
        return all(getattr(self, name) == 0.0 for name in LIMITS)

    @property
    def lag_frames(self) -> int:
        """Earlier frames whose signal still reaches a frame: lag^k >= ``LAG_TAIL`` for k <= this."""
        lag = self.lag_percent / 100.0
        if lag == 0.0:
            return 0
        return max(1, math.ceil(math.log(LAG_TAIL) / math.log(lag)) - 1)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Physics:
        """From ``to_dict`` output; missing settings (runs from before they existed) are 0."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: float(value) for key, value in values.items() if key in known})

    def describe(self) -> str:
        """One line: 'ideal', or each effect that is on with its value and unit."""
        if self.is_ideal:
            return "ideal"
        parts = []
        for name in LIMITS:
            value = getattr(self, name)
            if value:
                label, unit = name.rsplit("_", 1)
                parts.append(f"{label.replace('_', ' ')} {value:g} {'%' if unit == 'percent' else unit}")
        return ", ".join(parts)


PRESETS: dict[str, Physics] = {
    "ideal": Physics(),
    "realistic": Physics(
        leaf_transmission_percent=0.4,
        jaw_transmission_percent=0.1,
        x_jaw_transmission_percent=0.3,
        leaf_end_offset_mm=0.6,
        tongue_groove_mm=0.8,
        interleaf_leakage_percent=0.6,
        lag_percent=2.0,
        backscatter_percent=5.0,
    ),
}
"""``ideal``: the legacy synthesis. ``realistic``: an Agility-like MLC (0.4 % leaf and 0.1 % jaw
transmission, 0.3 % through the X jaws of an MLC with them, 0.6 mm leaf-end offset, a 0.8 mm
tongue-and-groove strip, 1 % transmission between leaves) on an aSi panel with 2 % lag and 5 %
arm backscatter (up to 10 % at the arm)."""


def physics_of(preset: str, **overrides: float | None) -> Physics:
    """The ``preset``'s physics with the settings given (not None) replacing its values."""
    base = PRESETS[preset]
    return dataclasses.replace(base, **{name: value for name, value in overrides.items() if value is not None})
