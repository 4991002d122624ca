"""Model families: which forward and inverse models a run trains, in which named size, and the
model config a checkpoint stores to rebuild them.

A family names its forward and inverse model classes, their config dataclasses and its sizes
(named pairs of configs). Two families: ``aperture`` (``epid.models.aperture``: an aperture
renderer with a learned detector response, and a leaf-edge reader) and ``legacy``, the design's
architecture (``epid.models.legacy``), each in the sizes full, small and tiny. ``aperture`` is the default
and trains with its own recipe (``APERTURE_RECIPE``); ``legacy`` with the variables' defaults, the
design's recipe. A model config stored
without a family name is a legacy one. A new family is a module with its two models and their config
dataclasses, and one entry in ``FAMILIES``.

``CrossModel`` holds a pair as one module: one DistributedDataParallel wrapper, one optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from epid.models import aperture, legacy
from epid.models.losses import shown_leaves
from epid.synthesis.geometry import STRIPS, StripGrid
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry

LEGACY = "legacy"
APERTURE = "aperture"
DEFAULT_FAMILY = APERTURE

APERTURE_RECIPE = {
    "EPID_BATCH_SIZE": "8", "EPID_BATCH_ORDER": "shuffled", "EPID_LR": "2e-3", "EPID_LR_SCHEDULE": "cosine",
    "EPID_LR_UPDATE": "step", "EPID_WARMUP_STEPS": "50", "EPID_GRAD_CLIP": "1",
}
"""The aperture family's training recipe, measured on held-out arcs (README, Model quality): small
batches of shuffled windows, a peak learning rate of 2e-3 after 50 warm-up steps, one cosine
decay per optimizer step over the whole run, the gradient norm clipped at 1."""


@dataclass(frozen=True)
class ModelFamily:
    """A kind of model pair: the two model classes (each built from one config dataclass), the
    config classes and the named sizes (size name -> (forward config, inverse config))."""

    name: str
    forward_model: type[nn.Module]
    inverse_model: type[nn.Module]
    forward_config: type
    inverse_config: type
    sizes: Mapping[str, tuple[Any, Any]]
    recipe: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The training recipe the family is made for: ``EPID_*`` values used in place of the
    variables' own defaults when those variables are unset (``epid.config.load.load_config``)."""


FAMILIES: dict[str, ModelFamily] = {
    LEGACY: ModelFamily(LEGACY, legacy.ForwardModel, legacy.InverseModel, legacy.ForwardConfig,
                        legacy.InverseConfig, legacy.SIZES),
    APERTURE: ModelFamily(APERTURE, aperture.ApertureForwardModel, aperture.LeafEdgeInverseModel,
                          aperture.ApertureForwardConfig, aperture.LeafEdgeInverseConfig,
                          aperture.SIZES,
                          recipe=APERTURE_RECIPE),
}


def family(name: str) -> ModelFamily:
    """The family called ``name``; ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[name]


@dataclass(frozen=True)
class PairConfig:
    """The configs of a forward/inverse model pair and the family they belong to.

    ``to_dict`` is what a checkpoint stores (plain dicts and lists, loadable with
    ``torch.load(weights_only=True)``); ``from_dict`` reads it back, a dict without ``family``
    as a legacy pair.
    """

    family: str
    forward: Any
    inverse: Any

    @classmethod
    def preset(cls, size: str, family_name: str = DEFAULT_FAMILY) -> PairConfig:
        """The configs of the named size of a family."""
        sizes = family(family_name).sizes
        if size not in sizes:
            raise ValueError(f"unknown model size {size!r}; expected one of {sorted(sizes)}")
        return cls(family_name, *sizes[size])

    @classmethod
    def of(cls, forward_model: nn.Module, inverse_model: nn.Module) -> PairConfig:
        """The pair config of two built models."""
        for entry in FAMILIES.values():
            if isinstance(forward_model, entry.forward_model) and isinstance(inverse_model, entry.inverse_model):
                return cls(entry.name, forward_model.config, inverse_model.config)
        raise ValueError(f"{type(forward_model).__name__} and {type(inverse_model).__name__} are no known family")

    def for_mlc(self, mlc: MlcGeometry) -> PairConfig:
        """This pair for the MLC ``mlc``: the configs that render apertures (a ``strip_leaves`` field)
        take its leaves over the strips (``MlcGeometry.strip_layout``), and one that learns X jaws (an
        ``x_jaws`` field) learns them where the synthetic arcs have them (every MLC with X jaws but the
        legacy grid, ``epid.synthesis.sequences.x_jaw_path``); the legacy family's stay."""
        def fitted(config: Any) -> Any:
            fields = {field.name for field in dataclasses.fields(config)}
            changes = {"strip_leaves": mlc.strip_layout, "x_jaws": mlc.arcs_have_x_jaws}
            return dataclasses.replace(config, **{name: value for name, value in changes.items() if name in fields})

        return dataclasses.replace(self, forward=fitted(self.forward), inverse=fitted(self.inverse))

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "forward": _plain(self.forward), "inverse": _plain(self.inverse)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PairConfig:
        """Read a stored pair config; TypeError / ValueError when it does not fit its family."""
        entry = family(values.get("family", LEGACY))
        inverse = getattr(entry.inverse_config, "from_stored", None) or (lambda stored: entry.inverse_config(**stored))
        return cls(entry.name, entry.forward_config(**values["forward"]), inverse(values["inverse"]))

    def build(self) -> tuple[nn.Module, nn.Module]:
        """Freshly initialised (forward, inverse) models of these configs."""
        entry = family(self.family)
        return entry.forward_model(self.forward), entry.inverse_model(self.inverse)


def _plain(config: Any) -> dict[str, Any]:
    """A config dataclass as a dict of plain values (tuples as lists)."""
    values = dataclasses.asdict(config)
    return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}


def model_strips(model: nn.Module) -> StripGrid:
    """The strips a built model works on: its aperture's (``epid.models.aperture.layout_grid``), or the
    design's 52 for a model without one (the legacy family)."""
    aperture_module = getattr(model, "aperture", None)
    return aperture_module.grid if aperture_module is not None else STRIPS


def build_models(size: str = "full", family_name: str = DEFAULT_FAMILY,
                 mlc: MlcGeometry = LEGACY_GRID) -> tuple[nn.Module, nn.Module]:
    """Freshly initialised (forward, inverse) models of a family's named size for the MLC ``mlc``."""
    return PairConfig.preset(size, family_name).for_mlc(mlc).build()


def predict_frames(forward_model: nn.Module, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor,
                   epid_prev: Tensor) -> tuple[Tensor, Tensor]:
    """The forward model's (epid, latent) for one batch; a model that predicts the detector's lag
    (``takes_prev_frame``) also gets the recorded previous frame ``epid_prev``. Scalars with a beam's
    X jaws appended (B, 9) reach a model that renders them (``renders_x_jaws``, the aperture family);
    the legacy family gets the first 5 and renders the leaves folded into the X jaws alone."""
    if scalars.shape[-1] > legacy.NUM_SCALARS and not getattr(forward_model, "renders_x_jaws", False):
        leaf_a, leaf_b = shown_leaves(leaf_a, leaf_b, scalars)
        scalars = scalars[:, :legacy.NUM_SCALARS]
    if getattr(forward_model, "takes_prev_frame", False):
        return forward_model(leaf_a, leaf_b, scalars, epid_prev)
    return forward_model(leaf_a, leaf_b, scalars)


class CrossModel(nn.Module):
    """The forward and inverse models as one module (one DDP wrapper, one optimizer)."""

    def __init__(self, forward_model: nn.Module, inverse_model: nn.Module) -> None:
        super().__init__()
        self.forward_model = forward_model
        self.inverse_model = inverse_model

    def forward(
        self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor, epid_prev: Tensor, epid_curr: Tensor
    ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]:
        """(forward model output, inverse model output) for one batch (shapes: ``epid.data.dataset.Batch``)."""
        return predict_frames(self.forward_model, leaf_a, leaf_b, scalars, epid_prev), self.inverse_model(
            epid_prev, epid_curr)

    @staticmethod
    def backward(loss: Tensor) -> None:
        """``loss.backward()``: the counterpart of ``SideBySide.backward`` (also through a DDP wrapper)."""
        loss.backward()

    @property
    def config(self) -> PairConfig:
        """The pair's configs, as a checkpoint stores them."""
        return PairConfig.of(self.forward_model, self.inverse_model)

    def place(self, device: torch.device) -> CrossModel:
        """Move to ``device`` in training mode; on the CPU with channels_last weights.

        The models keep CPU feature maps in channels_last; weights in the same format give
        gradients whose strides match DDP's bucket views (no per-step copy or warning).
        """
        self.to(device).train()
        if device.type == "cpu":
            self.to(memory_format=torch.channels_last)
        return self
