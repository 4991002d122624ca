"""Every ``EPID_*`` environment variable, read once into a frozen, typed ``Config``.

Each variable is declared once, as a ``Config`` field made by ``setting``: its name, default,
meaning, example and parser (which also states the expected form). ``VARIABLES``, ``--help``
(``help_text``), the README's table (``markdown_table``) and ``describe`` are derived from
these fields. ``load_config`` reads the variables from an environment mapping, validates each
value and the combinations, and raises ``ConfigError`` with one line naming the variable, the
value and the expected form.

The model family (EPID_MODEL, default ``aperture``) brings its training recipe
(``epid.families.ModelFamily.recipe``): values that replace the variables' own defaults when
those variables are unset. The variables' own defaults, which ``Config()`` holds, are the
legacy recipe: ``EPID_MODEL=legacy`` reproduces the legacy behaviour.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epid import sharding
from epid.errors import InputError
from epid.families import DEFAULT_FAMILY, FAMILIES
from epid.parsers import Boolean, Choice, Device, Integer, Parser, Real, Text
from epid.physics import LIMITS, PRESETS, Physics
from epid.plans import PlanArc, scan_plans
from epid.sequences import DEFAULT_CONTROL_POINTS, NUM_DATASETS

GLOBAL_BATCH = 128
VARIABLE = "variable"  # the metadata key of a Config field read from the environment


class ConfigError(InputError):
    """A bad EPID_* value; the message is one line fit to show the user as is."""


# --------------------------------------------------------------------------- parsarations


@dataclass(frozen=True)
class Variable:
    """One ``EPID_*`` variable: the ``Config`` field it sets, how to read it and how to document it.

    ``derived_when_unset``: unset, the value follows from other settings (``load_config``), and
    the field's default is the one for a single rank.
    """

    name: str
    field: str
    default: Any
    meaning: str
    example: str
    parse: Parser
    derived_when_unset: bool = False

    @property
    def expected(self) -> str:
        return self.parse.expected

    @property
    def shown_default(self) -> str:
        if self.derived_when_unset or self.default is None or self.default == "":
            return "(unset)"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


def setting(name: str, default: Any, parse: Parser, *, example: str, meaning: str,
            derived_when_unset: bool = False) -> Any:
    """A ``Config`` field read from the environment variable ``name`` (see ``Variable``)."""
    spec = {"name": name, "meaning": meaning, "example": example, "parse": parse,
            "derived_when_unset": derived_when_unset}
    return dataclasses.field(default=default, metadata={VARIABLE: spec})


def _range_spec(text: str) -> None:
    sharding.parse_range(text)


def _ids_spec(text: str) -> None:
    sharding.parse_id_list(text)


@dataclass(frozen=True)
class Config:
    """The resolved run configuration: one field per ``EPID_*`` variable (see each ``setting``),
    plus ``dataset_ids`` (the selected IDs), ``plan_arcs`` (with EPID_PLANS: the arcs that stand
    for dataset IDs 0, 1, ...) and ``launched_by_torchrun``."""

    # Launch and data selection
    world_size: int = setting(
        "EPID_WORLD_SIZE", 1, Integer(1), example="2",
        meaning="number of ranks spawned on this node (ignored under torchrun, which sets WORLD_SIZE)")
    batch_size: int = setting(
        "EPID_BATCH_SIZE", GLOBAL_BATCH, Integer(1), example="64", derived_when_unset=True,
        meaning="per-rank batch size (samples); unset means 128 // world size")
    dataset_shuffle: bool = setting(
        "EPID_DATASET_SHUFFLE", True, Boolean(), example="0",
        meaning="shuffle dataset IDs before the strided rank split")
    dataset_seed: int = setting(
        "EPID_DATASET_SEED", 12345, Integer(), example="7", meaning="seed of the dataset ID shuffle")
    dataset_range: str = setting(
        "EPID_DATASET_RANGE", "", Text("start:stop[:step] with IDs in 0..639", _range_spec), example="0:640:80",
        meaning="select dataset IDs by a Python-style range")
    dataset_ids_spec: str = setting(
        "EPID_DATASET_IDS", "", Text("comma-separated IDs in 0..639", _ids_spec), example="0,80,160",
        meaning="select dataset IDs by a comma-separated list")
    plans: str = setting(
        "EPID_PLANS", "", Text("a folder of RT Plan files"), example="plans/clinic",
        meaning="train on the arcs of the RT Plan files in this folder instead of the synthetic dataset IDs: each "
                "treatment beam is one arc with its own control points, arc i (files in name order) standing for "
                "dataset ID i (README, Real plans and images)")
    dataset_ids: tuple[int, ...] = tuple(range(NUM_DATASETS))
    plan_arcs: tuple[PlanArc, ...] = ()
    device: str = setting(
        "EPID_DEVICE", "auto", Device(), example="cpu",
        meaning="device to train on: auto picks cuda:LOCAL_RANK when CUDA is available, else cpu")
    backend: str = setting(
        "EPID_BACKEND", "auto", Choice("auto", "nccl", "gloo"), example="gloo",
        meaning="process-group backend: auto is nccl on CUDA, gloo on CPU")
    threads: int = setting(
        "EPID_THREADS", 0, Integer(0), example="1",
        meaning="CPU threads per rank; 0 divides the machine's cores among the node's ranks")
    collective_timeout: int = setting(
        "EPID_COLLECTIVE_TIMEOUT", 900, Integer(1), example="300",
        meaning="seconds a rank waits in a collective for its peers before the job fails (a lost node, a hung rank)")
    dry_run: bool = setting(
        "EPID_DRY_RUN", False, Boolean(), example="1",
        meaning="check everything the launch checks, print the resolved config and each rank's dataset IDs, then exit")
    # Synthesis
    control_points: int = setting(
        "EPID_CONTROL_POINTS", DEFAULT_CONTROL_POINTS, Integer(4), example="66",
        meaning="control points per synthetic arc (smaller values make quick smoke runs)")
    kernel: str = setting(
        "EPID_KERNEL", "", Text("path.mat or path.mat:variable"), example="kernels/epid.mat:kernel",
        meaning="EPID response kernel from a MATLAB .mat file, optionally naming the variable; "
                "unset uses the built-in measured-profile kernel")
    physics_preset: str = setting(
        "EPID_PHYSICS", "ideal", Choice(*PRESETS), example="realistic",
        meaning="synthesis physics preset: ideal (the legacy frames, bit for bit) or realistic (typical leaf and jaw "
                "transmission, rounded leaf ends, tongue-and-groove, interleaf leakage, lag and arm backscatter; "
                "README, Physics); each physics variable set on its own overrides the preset's value")
    leaf_transmission_percent: float = setting(
        "EPID_LEAF_TRANSMISSION_PERCENT", 0.0, Real(0.0, maximum=LIMITS["leaf_transmission_percent"]),
        example="1.2", derived_when_unset=True,
        meaning="share of the open fluence that passes through a closed MLC leaf, % (unset: EPID_PHYSICS's)")
    jaw_transmission_percent: float = setting(
        "EPID_JAW_TRANSMISSION_PERCENT", 0.0, Real(0.0, maximum=LIMITS["jaw_transmission_percent"]),
        example="0.1", derived_when_unset=True,
        meaning="share of the open fluence that passes through the Y jaws, % (unset: EPID_PHYSICS's)")
    leaf_end_offset_mm: float = setting(
        "EPID_LEAF_END_OFFSET_MM", 0.0, Real(0.0, maximum=LIMITS["leaf_end_offset_mm"]),
        example="0.8", derived_when_unset=True,
        meaning="rounded leaf ends: radiation edge outside the nominal leaf position (half the dosimetric leaf "
                "gap), mm (unset: EPID_PHYSICS's)")
    tongue_groove_mm: float = setting(
        "EPID_TONGUE_GROOVE_MM", 0.0, Real(0.0, maximum=LIMITS["tongue_groove_mm"]),
        example="1.0", derived_when_unset=True,
        meaning="width of the strip on each boundary between leaves that is open only where both leaves are open "
                "(tongue-and-groove), mm (unset: EPID_PHYSICS's)")
    interleaf_leakage_percent: float = setting(
        "EPID_INTERLEAF_LEAKAGE_PERCENT", 0.0, Real(0.0, maximum=LIMITS["interleaf_leakage_percent"]),
        example="0.8", derived_when_unset=True,
        meaning="extra transmission of closed leaves in the 1 mm rows beside each boundary between leaves, % "
                "(unset: EPID_PHYSICS's)")
    lag_percent: float = setting(
        "EPID_LAG_PERCENT", 0.0, Real(0.0, maximum=LIMITS["lag_percent"]),
        example="3", derived_when_unset=True,
        meaning="detector lag: each recorded frame carries this share of the previous recorded frame, % "
                "(unset: EPID_PHYSICS's)")
    backscatter_percent: float = setting(
        "EPID_BACKSCATTER_PERCENT", 0.0, Real(0.0, maximum=LIMITS["backscatter_percent"]),
        example="8", derived_when_unset=True,
        meaning="support-arm backscatter: a 40 mm blur of the fluence weighted from 0 at the image's top row to "
                "twice this at its bottom row, % (unset: EPID_PHYSICS's)")
    noise_std: float = setting(
        "EPID_NOISE_STD", 0.005, Real(0.0), example="0",
        meaning="Gaussian noise std per sub-frame before MU scaling (0 = no noise)")
    noise_seed: int = setting(
        "EPID_NOISE_SEED", 0, Integer(0), example="3",
        meaning="seed of the frame noise (a frame's noise depends only on this seed, the dataset ID, the frame and "
                "the device type: CPU and CUDA draw different, equally distributed noise)")
    cache_dir: str = setting(
        "EPID_CACHE_DIR", "", Text("a directory path"), example="/scratch/epid_cache",
        meaning="directory for a float16 frame cache, written once per dataset and reused; "
                "unset synthesises on the fly")
    # Loader
    num_workers: int = setting(
        "EPID_NUM_WORKERS", 0, Integer(0), example="2",
        meaning="DataLoader worker processes per rank (0 = synthesise in the training process, on its device)")
    pin_memory: bool = setting(
        "EPID_PIN_MEMORY", True, Boolean(), example="0", meaning="pin host batches for non-blocking copies to the GPU")
    prefetch_factor: int = setting(
        "EPID_PREFETCH_FACTOR", 2, Integer(1), example="4",
        meaning="batches prefetched per worker (only with EPID_NUM_WORKERS > 0)")
    batch_order: str = setting(
        "EPID_BATCH_ORDER", "sequential", Choice("sequential", "shuffled"), example="shuffled",
        meaning="order of batch windows: sequential (legacy) or shuffled each epoch from EPID_SEED and the epoch")
    # Model and optimisation
    model: str = setting(
        "EPID_MODEL", DEFAULT_FAMILY, Choice(*FAMILIES), example="legacy",
        meaning="model family: which forward and inverse networks are trained (a run resumes only in its "
                "checkpoint's family)")
    model_size: str = setting(
        "EPID_MODEL_SIZE", "full", Choice("full", "small", "tiny"), example="tiny",
        meaning="model size preset: full (design sizes), small or tiny (smoke tests)")
    epochs: int = setting("EPID_EPOCHS", 2000, Integer(1), example="10", meaning="number of epochs")
    steps_per_epoch: int = setting(
        "EPID_STEPS_PER_EPOCH", 0, Integer(0), example="20",
        meaning="cap on optimizer steps per epoch (0 = every batch window); a capped epoch goes on where the "
                "one before stopped, through all windows before any repeats")
    val_steps: int = setting(
        "EPID_VAL_STEPS", 0, Integer(0), example="16",
        meaning="validation batch windows per epoch over all ranks (0 = every window): a fixed set spread over "
                "the selected datasets, the same every epoch")
    lr: float = setting(
        "EPID_LR", 1e-4, Real(0.0, above=True), example="3e-4",
        meaning="AdamW learning rate at global batch 128 (before EPID_LR_SCALING)")
    weight_decay: float = setting("EPID_WEIGHT_DECAY", 1e-4, Real(0.0), example="0.01", meaning="AdamW weight decay")
    lr_scaling: str = setting(
        "EPID_LR_SCALING", "none", Choice("none", "linear", "sqrt"), example="sqrt",
        meaning="scale the learning rate with the global batch relative to 128")
    lr_schedule: str = setting(
        "EPID_LR_SCHEDULE", "cosine-restarts", Choice("cosine-restarts", "cosine", "linear"), example="cosine",
        meaning="learning-rate decay after the warm-up: cosine-restarts (cosine annealing with warm restarts, "
                "legacy), cosine (one cosine down to EPID_LR_MIN at the last epoch) or linear (a straight line "
                "down to it; after a warm-up, one cycle)")
    lr_update: str = setting(
        "EPID_LR_UPDATE", "epoch", Choice("epoch", "step"), example="step",
        meaning="the learning rate moves along its schedule once per epoch (legacy) or at every optimizer step")
    lr_min: float = setting(
        "EPID_LR_MIN", 1e-6, Real(0.0), example="1e-5", meaning="floor of the learning-rate decay")
    lr_restart_epochs: int = setting(
        "EPID_LR_RESTART_EPOCHS", 10, Integer(1), example="50",
        meaning="epochs from the end of the warm-up to the first restart of cosine-restarts")
    lr_restart_factor: int = setting(
        "EPID_LR_RESTART_FACTOR", 2, Integer(1), example="1",
        meaning="each restart period of cosine-restarts is this many times the one before")
    warmup_epochs: int = setting(
        "EPID_WARMUP_EPOCHS", 0, Integer(0), example="2",
        meaning="epochs of linear learning-rate warm-up before the decay")
    warmup_steps: int = setting(
        "EPID_WARMUP_STEPS", 0, Integer(0), example="500",
        meaning="optimizer steps of linear learning-rate warm-up before the decay (with EPID_LR_UPDATE=step; "
                "instead of EPID_WARMUP_EPOCHS)")
    grad_accum: int = setting(
        "EPID_GRAD_ACCUM", 1, Integer(1), example="4", meaning="batches accumulated per optimizer step")
    grad_clip: float = setting(
        "EPID_GRAD_CLIP", 0.0, Real(0.0), example="1.0",
        meaning="clip the global gradient norm to this value before each optimizer step (0 = off)")
    precision: str = setting(
        "EPID_PRECISION", "auto", Choice("auto", "bf16", "fp16", "fp32"), example="fp32",
        meaning="autocast precision: auto is bf16 on GPUs that have it, else fp32; on the CPU bf16 where a few "
                "training steps timed at the start run >= 10 % faster than in fp32 (legacy family; cached per "
                "machine and run shape in the user's cache folder), else fp32; the start line says why")
    compile: bool = setting(
        "EPID_COMPILE", False, Boolean(), example="1", meaning="compile the models with torch.compile")
    seed: int = setting(
        "EPID_SEED", 0, Integer(0), example="1",
        meaning="seed of model initialisation, of the random generators and of the shuffled batch order")
    max_nonfinite_steps: int = setting(
        "EPID_MAX_NONFINITE_STEPS", 5, Integer(1), example="10",
        meaning="consecutive non-finite losses (each skipped) that stop the run")
    early_stop_patience: int = setting(
        "EPID_EARLY_STOP_PATIENCE", 0, Integer(0), example="50",
        meaning="stop after this many epochs without a new best validation loss (0 = off)")
    time_limit: float = setting(
        "EPID_TIME_LIMIT", 0.0, Real(0.0), example="2820",
        meaning="minutes of wall clock after which training stops after its current step, writing a checkpoint "
                "that EPID_RESUME=1 continues (0 = no limit)")
    gamma_samples: int = setting(
        "EPID_GAMMA_SAMPLES", 64, Integer(0), example="16",
        meaning="validation samples whose forward-model gamma pass rate (3 %/3 mm) is reported each epoch (0 = off)")
    # Checkpoints and logging
    checkpoint_path: str = setting(
        "EPID_CHECKPOINT_PATH", "checkpoints/epid_checkpoint.pth", Text("a file path"), example="runs/a/epid.pth",
        meaning="checkpoint written every epoch (best one beside it as *_best.pth; metrics.csv and losses.png in "
                "its folder)")
    resume: bool = setting(
        "EPID_RESUME", False, Boolean(), example="1",
        meaning="continue from EPID_CHECKPOINT_PATH (next epoch, same schedule position and histories)")
    progress: bool = setting(
        "EPID_PROGRESS", True, Boolean(), example="0", meaning="progress bar on rank 0 when attached to a terminal")
    log_seconds: float = setting(
        "EPID_LOG_SECONDS", 300.0, Real(0.0, above=True), example="60",
        meaning="without a terminal, rank 0 prints a progress line (step, samples/s, running loss, ETA of the "
                "epoch and the run) every this many seconds or every tenth of an epoch, whichever comes first")
    tensorboard: str = setting(
        "EPID_TENSORBOARD", "", Text("a directory path"), example="runs/tb",
        meaning="write TensorBoard event files here: loss terms, learning rate, samples/s, gamma pass rate and "
                "validation frames per epoch (needs the tensorboard package); unset = off")
    timing_every: int = setting(
        "EPID_TIMING_EVERY", 0, Integer(0), example="50",
        meaning="print a timing line every N batches (0 = one line per epoch)")
    timing_max: int = setting("EPID_TIMING_MAX", 1, Integer(0), example="20", meaning="most timing lines per epoch")
    launched_by_torchrun: bool = False

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
    """The arcs of EPID_PLANS (``epid.plans.scan_plans``), which replace the dataset selection and
    bring their own control points; ConfigError naming the file and beam of a bad plan."""
    from epid.dataset import MIN_CONTROL_POINTS

    for name in ("EPID_DATASET_RANGE", "EPID_DATASET_IDS", "EPID_CONTROL_POINTS"):
        if environ.get(name, "").strip():
            raise _fail(name, environ[name], "EPID_PLANS is set: its arcs are the datasets, each with its own "
                        "control points", f"{name} unset with EPID_PLANS")
    try:
        return scan_plans(folder, MIN_CONTROL_POINTS)
    except InputError as error:
        raise ConfigError(f"EPID_PLANS={folder!r}: {error}") from None


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
