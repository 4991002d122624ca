"""The ``EPID_*`` variables, each declared once as a field of one of the run's sections.

A field made by ``setting`` carries its variable's name, default, meaning, example and parser
(which also states the expected form); ``epid.config.load.Config`` joins the sections into the
one resolved configuration, and ``VARIABLES``, ``--help`` and the README's table derive from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from epid.core.errors import InputError
from epid.core.parsers import Boolean, Choice, Device, Integer, Parser, Real, Text
from epid.data import sharding
from epid.data.plans import PlanArc
from epid.models.families import DEFAULT_FAMILY, FAMILIES
from epid.synthesis.mlc import MLC_GEOMETRIES
from epid.synthesis.physics import LIMITS, PRESETS
from epid.synthesis.sequences import DEFAULT_CONTROL_POINTS, NUM_DATASETS

GLOBAL_BATCH = 128
VARIABLE = "variable"  # the metadata key of a Config field read from the environment


class ConfigError(InputError):
    """A bad EPID_* value; the message is one line fit to show the user as is."""


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
class LaunchVariables:
    """Launch and data selection: ranks, devices and which datasets (or plans) a run trains on."""

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


@dataclass(frozen=True)
class SynthesisVariables:
    """Synthesis: control points, kernel, physics, noise and the frame cache."""

    control_points: int = setting(
        "EPID_CONTROL_POINTS", DEFAULT_CONTROL_POINTS, Integer(4), example="66",
        meaning="control points per synthetic arc (smaller values make quick smoke runs)")
    kernel: str = setting(
        "EPID_KERNEL", "", Text("path.mat or path.mat:variable"), example="kernels/epid.mat:kernel",
        meaning="EPID response kernel from a MATLAB .mat file, optionally naming the variable: the frames are "
                "synthesised with it and a new aperture model's response starts as it; unset uses the built-in "
                "measured-profile kernel")
    mlc: str = setting(
        "EPID_MLC", "legacy", Text(f"one of {', '.join(MLC_GEOMETRIES)}, or an RT Plan file"), example="millennium120",
        meaning="the MLC the arcs are synthesised on and the models learn: the design's grid of 52 x 5 mm leaves "
                "(legacy), a built-in clinical MLC, or the MLC of an RT Plan's first beam; with EPID_PLANS, unset "
                "means the plans' own MLC. A checkpoint keeps it (README, MLCs)")
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
    x_jaw_transmission_percent: float = setting(
        "EPID_X_JAW_TRANSMISSION_PERCENT", 0.0, Real(0.0, maximum=LIMITS["x_jaw_transmission_percent"]),
        example="0.5", derived_when_unset=True,
        meaning="share of the open fluence that passes through the X jaws of an MLC that has them (not the legacy "
                "grid), % (unset: EPID_PHYSICS's)")
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


@dataclass(frozen=True)
class LoaderVariables:
    """The data loader: worker processes, pinned memory, prefetching and batch order."""

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


@dataclass(frozen=True)
class OptimisationVariables:
    """Model family and size, epochs, learning rate and its schedule, precision and stop rules."""

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
                "machine and run shape in the user's cache folder; a resumed run keeps the precision it started "
                "in on the same CPU, recorded in its checkpoint), else fp32; the start line says why")
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


@dataclass(frozen=True)
class LoggingVariables:
    """Checkpoints, resume, progress, TensorBoard and timing lines."""

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
