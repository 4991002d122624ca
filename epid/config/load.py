"""Every ``EPID_*`` environment variable, read once into a frozen, typed ``Config``.

``Config`` joins the sections of ``epid.config.variables``, where each variable is declared once
(name, default, meaning, example and parser, which also states the expected form).
``VARIABLES``, ``--help`` (``help_text``), the README's table (``markdown_table``) and
``describe`` are derived from those fields. ``load_config`` reads the variables from an
environment mapping, validates each value and the combinations, and raises ``ConfigError`` with
one line naming the variable, the value and the expected form.

The model family (EPID_MODEL, default ``aperture``) brings its training recipe
(``epid.models.families.ModelFamily.recipe``): values that replace the variables' own defaults
when those variables are unset. The variables' own defaults, which ``Config()`` holds, are the
legacy recipe: ``EPID_MODEL=legacy`` reproduces the legacy behaviour.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epid.config.variables import (
    GLOBAL_BATCH,
    VARIABLE,
    ConfigError,
    LaunchVariables,
    LoaderVariables,
    LoggingVariables,
    OptimisationVariables,
    SynthesisVariables,
    Variable,
)
from epid.core.errors import InputError
from epid.data import sharding
from epid.data.dataset import EpidData
from epid.data.plans import PlanArc, scan_plans
from epid.models.families import FAMILIES
from epid.models.families import LEGACY as LEGACY_FAMILY
from epid.synthesis.kernel import kernel_from_config
from epid.synthesis.mlc import LEGACY_GRID, MLC_GEOMETRIES, MlcGeometry
from epid.synthesis.physics import LIMITS, PRESETS, Physics
from epid.synthesis.sequences import MIN_CONTROL_POINTS


@dataclass(frozen=True)
class Config(LoggingVariables, OptimisationVariables, LoaderVariables, SynthesisVariables, LaunchVariables):
    """The resolved run configuration: one field per ``EPID_*`` variable (see each ``setting``),
    plus ``dataset_ids`` (the selected IDs), ``plan_arcs`` (with EPID_PLANS: the arcs that stand
    for dataset IDs 0, 1, ...) and ``launched_by_torchrun``."""

    launched_by_torchrun: bool = False
    mlc_geometry: MlcGeometry = LEGACY_GRID
    """EPID_MLC resolved (with EPID_PLANS and EPID_MLC unset: the plans' MLC)."""

    @property
    def physics(self) -> Physics:
        """The synthesis physics of the run (preset and overrides resolved)."""
        return Physics(**{name: getattr(self, name) for name in LIMITS})

    @property
    def kernel_path(self) -> str:
        """Path part of EPID_KERNEL ("" for the built-in kernel)."""
        return _split_kernel(self.kernel)[0]

    @property
    def kernel_variable(self) -> str | None:
        """Variable part of EPID_KERNEL (``path.mat:variable``), or None."""
        return _split_kernel(self.kernel)[1]

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.batch_size * self.world_size * self.grad_accum

    @property
    def effective_lr(self) -> float:
        """EPID_LR scaled by EPID_LR_SCALING for the global batch, relative to 128."""
        ratio = self.global_batch / GLOBAL_BATCH
        factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]
        return self.lr * factor

    def arc_control_points(self, dataset_id: int) -> int:
        """Control points of the arc of ``dataset_id``: its plan arc's own with EPID_PLANS, else
        EPID_CONTROL_POINTS."""
        return self.plan_arcs[dataset_id].control_points if self.plan_arcs else self.control_points

    def rank_dataset_ids(self, rank: int) -> list[int]:
        """The dataset IDs ``rank`` trains on, in order."""
        return sharding.assign_dataset_ids(
            self.dataset_ids, rank, self.world_size, self.dataset_shuffle, self.dataset_seed
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-typed copy (for checkpoints, JSON and printing)."""
        values = dataclasses.asdict(self)
        values["dataset_ids"] = list(self.dataset_ids)
        values["plan_arcs"] = [arc.to_dict() for arc in self.plan_arcs]
        values["mlc_geometry"] = self.mlc_geometry.to_dict()
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Config:
        """Rebuild from ``to_dict`` output; unknown keys (older or newer runs) are ignored."""
        known = {field.name for field in dataclasses.fields(cls)}
        kept = {key: value for key, value in values.items() if key in known}
        if "dataset_ids" in kept:
            kept["dataset_ids"] = tuple(kept["dataset_ids"])
        if "plan_arcs" in kept:
            kept["plan_arcs"] = tuple(PlanArc(**arc) for arc in kept["plan_arcs"])
        if "mlc_geometry" in kept:
            kept["mlc_geometry"] = MlcGeometry.from_dict(kept["mlc_geometry"])
        return cls(**kept)


VARIABLES: tuple[Variable, ...] = tuple(
    Variable(field=field.name, default=field.default, **field.metadata[VARIABLE])
    for field in dataclasses.fields(Config)
    if VARIABLE in field.metadata
)
VARIABLE_OF_FIELD = {variable.field: variable for variable in VARIABLES}
OTHER_VARIABLES = ("EPID_TEST_INDUCTOR",)  # read by the test suite, not by a run


def _split_kernel(spec: str) -> tuple[str, str | None]:
    """``path.mat:variable`` -> (path, variable); a Windows drive colon is not a separator."""
    if not spec:
        return "", None
    head, sep, tail = spec.rpartition(":")
    if sep and head and not head.endswith(("\\", "/")) and "/" not in tail and "\\" not in tail and len(head) > 1:
        return head, tail or None
    return spec, None


def _fail(variable: Variable | str, value: str, problem: str, expected: str) -> ConfigError:
    name = variable.name if isinstance(variable, Variable) else variable
    detail = f"{problem}; " if problem else ""
    return ConfigError(f"{name}={value!r}: {detail}expected {expected}")


def _read(variable: Variable, environ: Mapping[str, str]) -> Any:
    raw = environ.get(variable.name)
    if raw is None or raw.strip() == "":
        return None if variable.derived_when_unset else variable.default
    try:
        return variable.parse(raw)
    except ValueError as error:
        raise _fail(variable, raw, str(error), variable.expected) from None


def _torchrun_world_size(environ: Mapping[str, str], requested: int) -> int | None:
    """WORLD_SIZE when launched by torchrun (RANK set), else None."""
    if "RANK" not in environ:
        return None
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = environ.get(name, "")
        if not raw.strip().isdigit():
            raise _fail(name, raw, "RANK is set, so this looks like a torchrun launch", "a non-negative integer")
    world_size = int(environ["WORLD_SIZE"])
    if world_size < 1:
        raise _fail("WORLD_SIZE", environ["WORLD_SIZE"], "", "an integer >= 1")
    explicit = environ.get("EPID_WORLD_SIZE", "").strip()
    if explicit and requested != world_size:
        raise _fail(
            "EPID_WORLD_SIZE", explicit, f"torchrun set WORLD_SIZE={world_size}",
            "EPID_WORLD_SIZE unset or equal to WORLD_SIZE under torchrun",
        )
    return world_size


def load_config(environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate every EPID_* variable (default: ``os.environ``).

    Raises ConfigError (one line: variable, value, expected form) on the first problem.
    """
    environ = os.environ if environ is None else environ
    check_names(environ)
    environ = with_recipe(environ)
    values = {variable.field: _read(variable, environ) for variable in VARIABLES}

    torchrun_size = _torchrun_world_size(environ, values["world_size"])
    if torchrun_size is not None:
        values["world_size"] = torchrun_size
    values["launched_by_torchrun"] = torchrun_size is not None

    world_size = values["world_size"]
    preset = PRESETS[values["physics_preset"]]
    for name in LIMITS:
        if values[name] is None:
            values[name] = getattr(preset, name)

    if values["batch_size"] is None:
        if world_size > GLOBAL_BATCH:
            raise _fail(
                "EPID_WORLD_SIZE", str(world_size), "the default per-rank batch 128 // world size would be 0",
                "at most 128 ranks, or set EPID_BATCH_SIZE",
            )
        values["batch_size"] = GLOBAL_BATCH // world_size

    if values["dataset_range"] and values["dataset_ids_spec"]:
        raise _fail(
            "EPID_DATASET_IDS", values["dataset_ids_spec"], "EPID_DATASET_RANGE is also set",
            "only one of EPID_DATASET_RANGE and EPID_DATASET_IDS",
        )
    if values["plans"]:
        values["plan_arcs"] = _plan_arcs(values["plans"], environ)
        ids = list(range(len(values["plan_arcs"])))
    else:
        ids = sharding.select_dataset_ids(values["dataset_range"], values["dataset_ids_spec"])
    values["dataset_ids"] = tuple(ids)
    values["mlc_geometry"] = _mlc_geometry(values["mlc"], environ, values.get("plan_arcs", ()))
    if values["model"] == LEGACY_FAMILY and values["mlc_geometry"].design_strips_reason:
        geometry = values["mlc_geometry"]
        raise _fail("EPID_MLC", values["mlc"], f"{geometry.description}: {geometry.design_strips_reason}; the legacy "
                    "model family works on the design's 52 strips of 5 mm", "EPID_MODEL=aperture, or another MLC")
    if len(ids) < world_size:
        name, raw = _selection_variable(values)
        raise _fail(
            name, raw, f"{len(ids)} dataset(s) for {world_size} ranks: rank {len(ids)} would get no dataset",
            f"at least {world_size} datasets (one per rank), or fewer ranks",
        )

    if values["warmup_steps"] and values["warmup_epochs"]:
        raise _fail(
            "EPID_WARMUP_STEPS", str(values["warmup_steps"]), "EPID_WARMUP_EPOCHS is also set",
            "only one of EPID_WARMUP_EPOCHS and EPID_WARMUP_STEPS",
        )
    if values["warmup_steps"] and values["lr_update"] != "step":
        raise _fail(
            "EPID_WARMUP_STEPS", str(values["warmup_steps"]), "the learning rate moves once per epoch",
            "EPID_LR_UPDATE=step with it, or EPID_WARMUP_EPOCHS",
        )

    kernel_path = _split_kernel(values["kernel"])[0]
    if kernel_path and not os.path.isfile(kernel_path):
        raise _fail("EPID_KERNEL", values["kernel"], f"no file {kernel_path!r}",
                    "path.mat or path.mat:variable of an existing file")
    for name, field in (("EPID_CACHE_DIR", "cache_dir"), ("EPID_TENSORBOARD", "tensorboard")):
        if values[field] and os.path.exists(values[field]) and not os.path.isdir(values[field]):
            raise _fail(name, values[field], "exists and is not a directory", "a directory path")
    sizes = FAMILIES[values["model"]].sizes
    if values["model_size"] not in sizes:
        raise _fail("EPID_MODEL_SIZE", values["model_size"], f"the {values['model']} family has no such size",
                    f"one of {', '.join(sizes)}")
    if values["resume"] and not os.path.isfile(values["checkpoint_path"]):
        raise _fail(
            "EPID_RESUME", environ.get("EPID_RESUME", ""),
            f"no checkpoint at EPID_CHECKPOINT_PATH={values['checkpoint_path']!r}",
            "an existing checkpoint to resume from, or EPID_RESUME=0",
        )
    if os.path.isdir(values["checkpoint_path"]):
        raise _fail("EPID_CHECKPOINT_PATH", values["checkpoint_path"], "is a directory",
                    "a file path such as runs/a/epid.pth")
    return Config(**values)


def _plan_arcs(folder: str, environ: Mapping[str, str]) -> tuple[PlanArc, ...]:
    """The arcs of EPID_PLANS (``epid.data.plans.scan_plans``), which replace the dataset selection and
    bring their own control points; ConfigError naming the file and beam of a bad plan."""
    for name in ("EPID_DATASET_RANGE", "EPID_DATASET_IDS", "EPID_CONTROL_POINTS"):
        if environ.get(name, "").strip():
            raise _fail(name, environ[name], "EPID_PLANS is set: its arcs are the datasets, each with its own "
                        "control points", f"{name} unset with EPID_PLANS")
    try:
        return scan_plans(folder, MIN_CONTROL_POINTS)
    except InputError as error:
        raise ConfigError(f"EPID_PLANS={folder!r}: {error}") from None


def _mlc_geometry(spec: str, environ: Mapping[str, str], plan_arcs: tuple[PlanArc, ...]) -> MlcGeometry:
    """EPID_MLC's geometry: a built-in MLC by name, or the MLC of the first beam of an RT Plan file;
    with EPID_PLANS the plans' MLC, which EPID_MLC, when set, must be. ConfigError for an unknown
    name, a file that is not a readable plan, or an MLC no strips can show."""
    from epid.dicom.plan import read_plan

    set_by_user = bool(environ.get("EPID_MLC", "").strip())
    if spec in MLC_GEOMETRIES:
        geometry = MLC_GEOMETRIES[spec]
    elif os.path.isfile(spec):
        try:
            geometry = read_plan(spec)[0].geometry
        except InputError as error:
            raise ConfigError(f"EPID_MLC={spec!r}: {error}") from None
    else:
        raise _fail("EPID_MLC", spec, "no built-in MLC of that name and no such file",
                    f"one of {', '.join(MLC_GEOMETRIES)}, or an RT Plan file")
    if not geometry.modelled:
        raise _fail("EPID_MLC", spec, f"{geometry.description}: {geometry.unmodelled_reason}",
                    "an MLC whose leaves are no finer than the 2.5 mm strips")
    if plan_arcs:
        plans = read_plan(plan_arcs[0].path, plan_arcs[0].beam_number)[0].geometry
        if set_by_user and plans != geometry:
            raise _fail("EPID_MLC", spec, f"EPID_PLANS's plans are on {plans.name} ({plans.description})",
                        f"EPID_MLC unset, or {plans.name}")
        geometry = plans
    return geometry


RECIPE_YIELDS_TO = {"EPID_WARMUP_STEPS": ("EPID_WARMUP_EPOCHS", "EPID_LR_UPDATE")}
"""A family recipe's value of the key is left out when the user sets one of these variables."""


def with_recipe(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the EPID_MODEL family's recipe filling the variables it leaves unset (a
    recipe value also gives way to the variables of ``RECIPE_YIELDS_TO`` that are set)."""
    def unset(name: str) -> bool:
        return not environ.get(name, "").strip()

    family_name = _read(VARIABLE_OF_FIELD["model"], environ)
    filled = dict(environ)
    for name, text in FAMILIES[family_name].recipe.items():
        if unset(name) and all(unset(other) for other in RECIPE_YIELDS_TO.get(name, ())):
            filled[name] = text
    return filled


def recipe_defaults(variable: Variable, quote: str = "") -> str:
    """``; aperture 2e-3``: what the families' recipes put in place of the variable's default
    (values between ``quote`` marks)."""
    return "".join(f"; {name} {quote}{entry.recipe[variable.name]}{quote}" for name, entry in FAMILIES.items()
                   if variable.name in entry.recipe)


def check_names(environ: Mapping[str, str]) -> None:
    """Raise ConfigError for the first ``EPID_*`` name that is no known variable, naming the closest
    known ones (a misspelt variable would otherwise be ignored silently)."""
    known = {variable.name.removeprefix("EPID_"): variable.name for variable in VARIABLES}
    for name in sorted(environ):
        if not name.startswith("EPID_") or name in known.values() or name in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name.removeprefix("EPID_"), list(known), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(known[word] for word in close)}?" if close else ""
        raise ConfigError(f"{name}={environ[name]!r}: not a known variable{hint} (expected one of the EPID_* "
                          "variables that generate_and_train.py --help lists)")


def _selection_variable(values: Mapping[str, Any]) -> tuple[str, str]:
    if values["plans"]:
        return "EPID_PLANS", values["plans"]
    if values["dataset_range"]:
        return "EPID_DATASET_RANGE", values["dataset_range"]
    if values["dataset_ids_spec"]:
        return "EPID_DATASET_IDS", values["dataset_ids_spec"]
    return "EPID_WORLD_SIZE", str(values["world_size"])


def help_text() -> str:
    """Every variable with its default and meaning, for ``--help``."""
    width = max(len(variable.name) for variable in VARIABLES)
    lines = ["Environment variables (unset or empty means the default; where a model family's recipe has its",
             "own default, it follows the variable's own, which the legacy family uses):", ""]
    for item in VARIABLES:
        lines.append(f"  {item.name:<{width}}  default {item.shown_default}{recipe_defaults(item)}")
        lines.append(f"  {'':<{width}}  {item.meaning} (e.g. {item.example})")
    return "\n".join(lines)


def markdown_table() -> str:
    """The README's variable table (``python -m epid.config`` prints it)."""
    rows = ["| Variable | Meaning | Default | Example |", "|---|---|---|---|"]
    for item in VARIABLES:
        default = f"`{item.shown_default}`{recipe_defaults(item, '`')}"
        rows.append(f"| `{item.name}` | {item.meaning} | {default} | `{item.example}` |")
    return "\n".join(rows)


def describe(config: Config) -> str:
    """The resolved config, one ``name = value`` line per variable."""
    width = max(len(variable.name) for variable in VARIABLES)
    lines = []
    for item in VARIABLES:
        value = getattr(config, item.field)
        lines.append(f"  {item.name:<{width}} = {value}")
    ids = config.dataset_ids
    lines.append(f"  {'selected datasets':<{width}} = {len(ids)} ({_compact(ids)})")
    for dataset_id, arc in enumerate(config.plan_arcs):
        lines.append(f"  {f'plan arc {dataset_id}':<{width}} = {arc.describe()}")
    lines.append(f"  {'global batch':<{width}} = {config.global_batch}; lr {config.effective_lr:.3g}")
    if config.launched_by_torchrun:
        lines.append(f"  {'launch':<{width}} = torchrun (WORLD_SIZE={config.world_size})")
    return "\n".join(lines)


def rank_report(config: Config) -> str:
    """Each rank's dataset IDs, one line per rank (shown at start and by EPID_DRY_RUN)."""
    lines = []
    for rank in range(config.world_size):
        ids = config.rank_dataset_ids(rank)
        lines.append(f"  rank {rank}: {len(ids)} dataset(s): {', '.join(str(i) for i in ids)}")
    return "\n".join(lines)


def _compact(ids: tuple[int, ...] | list[int]) -> str:
    """A short rendering of an ID list: ``0..639`` runs or the first few IDs."""
    if not ids:
        return "none"
    if list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    shown = ", ".join(str(i) for i in ids[:8])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")


if __name__ == "__main__":
    print(markdown_table())


def epid_data(config: Config, dataset_ids: Sequence[int]) -> EpidData:
    """The data of ``dataset_ids`` with the arcs, kernel, physics, noise and cache of ``config``."""
    return EpidData(
        dataset_ids,
        control_points=config.control_points,
        kernel=kernel_from_config(config.kernel_path, config.kernel_variable),
        noise_std=config.noise_std,
        noise_seed=config.noise_seed,
        cache_dir=config.cache_dir or None,
        physics=config.physics,
        plan_arcs=config.plan_arcs,
        mlc=config.mlc_geometry,
    )
