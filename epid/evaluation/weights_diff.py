"""Weights of two checkpoints compared per tensor, per module and per model.

For every state-dict entry of the forward and inverse models: the L2 norm of the difference,
the change relative to the reference's norm and the cosine similarity (float64 sums), or why
the entry could not be compared (missing on one side, another shape).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from torch import Tensor

MODEL_STATES = {"forward": "forward_model", "inverse": "inverse_model"}


@dataclass
class WeightDelta:
    """Sums over one or more same-shape tensor pairs (reference ``a``, other ``b``), float64."""

    difference_sq: float
    """sum of (b - a)^2"""
    reference_sq: float
    """sum of a^2"""
    other_sq: float
    """sum of b^2"""
    dot: float
    """sum of a b"""
    tensors: int
    elements: int

    @classmethod
    def zero(cls) -> WeightDelta:
        """The sums over no tensor."""
        return cls(0.0, 0.0, 0.0, 0.0, 0, 0)

    @classmethod
    def of(cls, reference: Tensor, other: Tensor) -> WeightDelta:
        a = reference.detach().double().flatten()
        b = other.detach().double().flatten()
        return cls(
            difference_sq=float((b - a).square().sum()), reference_sq=float(a.square().sum()),
            other_sq=float(b.square().sum()), dot=float(a.dot(b)), tensors=1, elements=a.numel(),
        )

    def add(self, other: WeightDelta) -> None:
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))

    @property
    def l2_difference(self) -> float:
        """||b - a||_2."""
        return math.sqrt(self.difference_sq)

    @property
    def relative_change(self) -> float:
        """||b - a|| / ||a|| (0 for two zero tensors, NaN for a change from zero)."""
        if self.reference_sq > 0:
            return self.l2_difference / math.sqrt(self.reference_sq)
        return 0.0 if self.difference_sq == 0 else math.nan

    @property
    def cosine(self) -> float:
        """a.b / (||a|| ||b||) (1 for two zero tensors, NaN when only one is zero)."""
        if self.reference_sq > 0 and self.other_sq > 0:
            return max(-1.0, min(1.0, self.dot / math.sqrt(self.reference_sq * self.other_sq)))
        return 1.0 if self.reference_sq == self.other_sq == 0 else math.nan

    def to_dict(self) -> dict[str, float]:
        return {
            "l2_difference": self.l2_difference, "relative_change": self.relative_change,
            "cosine": self.cosine, "tensors": self.tensors, "elements": self.elements,
        }


@dataclass(frozen=True)
class TensorDiff:
    """One state-dict entry: ``status`` is "compared", "missing in reference",
    "missing in other" or "shape mismatch"; ``delta`` only when compared."""

    model: str
    name: str
    status: str
    reference_shape: tuple[int, ...] | None
    other_shape: tuple[int, ...] | None
    delta: WeightDelta | None

    @property
    def module(self) -> str:
        """``model.first_name_component``, e.g. ``forward.encoder``."""
        return f"{self.model}.{self.name.split('.')[0]}"

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "model": self.model, "name": self.name, "status": self.status,
            "reference_shape": list(self.reference_shape) if self.reference_shape is not None else None,
            "other_shape": list(self.other_shape) if self.other_shape is not None else None,
        }
        if self.delta is not None:
            row.update(self.delta.to_dict())
        return row


@dataclass
class WeightDiff:
    """Weights of ``other`` against ``reference``: per tensor, per module and per model."""

    reference: str
    other: str
    tensors: list[TensorDiff] = field(default_factory=list)

    def totals(self, key: str) -> dict[str, WeightDelta]:
        """Compared tensors summed per ``"model"`` or per ``"module"``, in state-dict order."""
        groups: dict[str, WeightDelta] = {}
        for tensor in self.tensors:
            group = groups.setdefault(tensor.model if key == "model" else tensor.module, WeightDelta.zero())
            if tensor.delta is not None:
                group.add(tensor.delta)
        return groups

    @property
    def unmatched(self) -> list[TensorDiff]:
        """Tensors missing on one side or with different shapes."""
        return [t for t in self.tensors if t.status != "compared"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference, "other": self.other,
            "models": {name: delta.to_dict() for name, delta in self.totals("model").items()},
            "modules": {name: delta.to_dict() for name, delta in self.totals("module").items()},
            "unmatched": [t.to_dict() for t in self.unmatched],
            "tensors": [t.to_dict() for t in self.tensors],
        }


def diff_state_dicts(model: str, reference: Mapping[str, Tensor], other: Mapping[str, Tensor]) -> list[TensorDiff]:
    """Per-tensor differences of two state dicts of one model, reference order then extra keys."""
    diffs = []
    for name in list(reference) + [name for name in other if name not in reference]:
        a, b = reference.get(name), other.get(name)
        shape_a = tuple(a.shape) if a is not None else None
        shape_b = tuple(b.shape) if b is not None else None
        if a is None:
            status = "missing in reference"
        elif b is None:
            status = "missing in other"
        elif shape_a != shape_b:
            status = "shape mismatch"
        else:
            status = "compared"
        delta = WeightDelta.of(a, b) if status == "compared" else None
        diffs.append(TensorDiff(model, name, status, shape_a, shape_b, delta))
    return diffs


def diff_weights(reference_name: str, reference: Mapping[str, Any], other_name: str,
                 other: Mapping[str, Any]) -> WeightDiff:
    """Forward and inverse model weights of checkpoint ``other`` against checkpoint ``reference``."""
    diff = WeightDiff(reference_name, other_name)
    for model, key in MODEL_STATES.items():
        diff.tensors.extend(diff_state_dicts(model, reference[key], other[key]))
    return diff
