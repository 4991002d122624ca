"""Every ``EPID_*`` environment variable, read once into a frozen, typed ``Config``.

``VARIABLES`` is the single table of variables: name, default, meaning, example and
parser. ``load_config`` reads them from an environment mapping, validates each value
and the combinations, and raises ``ConfigError`` with one line naming the variable,
the value and the expected form. Defaults reproduce the legacy behaviour.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from epid import sharding
from epid.errors import InputError
from epid.sequences import DEFAULT_CONTROL_POINTS, NUM_DATASETS

GLOBAL_BATCH = 128
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class ConfigError(InputError):
    """A bad EPID_* value; the message is one line fit to show the user as is."""


@dataclass(frozen=True)
class Variable:
    """One ``EPID_*`` variable: how to read it and how to document it."""

    name: str
    field: str
    default: Any
    meaning: str
    example: str
    parse: Callable[[str], Any]
    expected: str

    @property
    def shown_default(self) -> str:
        if self.default is None or self.default == "":
            return "(unset)"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return str(self.default)


def _integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError("not an integer") from None
        if minimum is not None and value < minimum:
            raise ValueError
        if maximum is not None and value > maximum:
            raise ValueError
        return value

    return parse


def _real(minimum: float = 0.0, strictly_positive: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError("not a number") from None
        if not math.isfinite(value) or value < minimum or (strictly_positive and value <= 0):
            raise ValueError
        return value

    return parse


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().lower()
        if word not in choices:
            raise ValueError
        return word

    return parse


def _device(text: str) -> str:
    word = text.strip().lower()
    if word in ("auto", "cpu", "cuda"):
        return word
    if word.startswith("cuda:") and word[5:].isdigit():
        return word
    raise ValueError


def _text(text: str) -> str:
    return text.strip()


def _range_spec(text: str) -> str:
    sharding.parse_range(text)
    return text.strip()


def _ids_spec(text: str) -> str:
    sharding.parse_id_list(text)
    return text.strip()


def _optional_batch(text: str) -> int:
    return _integer(1)(text)


VARIABLES: tuple[Variable, ...] = (
    # Launch and data selection
    Variable("EPID_WORLD_SIZE", "world_size", 1, "number of ranks spawned on this node (ignored under torchrun, which sets WORLD_SIZE)", "2", _integer(1), "an integer >= 1"),
    Variable("EPID_BATCH_SIZE", "batch_size", None, "per-rank batch size (samples); unset means 128 // world size", "64", _optional_batch, "an integer >= 1"),
    Variable("EPID_DATASET_SHUFFLE", "dataset_shuffle", True, "shuffle dataset IDs before the strided rank split", "0", _boolean, "1/0, true/false or yes/no"),
    Variable("EPID_DATASET_SEED", "dataset_seed", 12345, "seed of the dataset ID shuffle", "7", _integer(), "an integer"),
    Variable("EPID_DATASET_RANGE", "dataset_range", "", "select dataset IDs by a Python-style range", "0:640:80", _range_spec, "start:stop[:step] with IDs in 0..639"),
    Variable("EPID_DATASET_IDS", "dataset_ids_spec", "", "select dataset IDs by a comma-separated list", "0,80,160", _ids_spec, "comma-separated IDs in 0..639"),
    Variable("EPID_DEVICE", "device", "auto", "device to train on: auto picks cuda:LOCAL_RANK when CUDA is available, else cpu", "cpu", _device, "auto, cpu, cuda or cuda:N"),
    Variable("EPID_BACKEND", "backend", "auto", "process-group backend: auto is nccl on CUDA, gloo on CPU", "gloo", _choice("auto", "nccl", "gloo"), "auto, nccl or gloo"),
    Variable("EPID_THREADS", "threads", 0, "CPU threads per rank; 0 divides the machine's cores among the node's ranks", "1", _integer(0), "an integer >= 0"),
    Variable("EPID_COLLECTIVE_TIMEOUT", "collective_timeout", 900, "seconds a rank waits in a collective for its peers before the job fails (a lost node, a hung rank)", "300", _integer(1), "an integer >= 1"),
    Variable("EPID_DRY_RUN", "dry_run", False, "print the resolved config and each rank's dataset IDs, then exit", "1", _boolean, "1/0, true/false or yes/no"),
    # Synthesis
    Variable("EPID_CONTROL_POINTS", "control_points", DEFAULT_CONTROL_POINTS, "control points per synthetic arc (smaller values make quick smoke runs)", "66", _integer(4), "an integer >= 4"),
    Variable("EPID_KERNEL", "kernel", "", "EPID response kernel from a MATLAB .mat file, optionally naming the variable; unset uses the built-in measured-profile kernel", "kernels/epid.mat:kernel", _text, "path.mat or path.mat:variable"),
    Variable("EPID_NOISE_STD", "noise_std", 0.005, "Gaussian noise std per sub-frame before MU scaling (0 = no noise)", "0", _real(0.0), "a finite number >= 0"),
    Variable("EPID_NOISE_SEED", "noise_seed", 0, "seed of the frame noise (a frame's noise depends only on this seed, the dataset ID, the frame and the device type: CPU and CUDA draw different, equally distributed noise)", "3", _integer(0), "an integer >= 0"),
    Variable("EPID_CACHE_DIR", "cache_dir", "", "directory for a float16 frame cache, written once per dataset and reused; unset synthesises on the fly", "/scratch/epid_cache", _text, "a directory path"),
    # Loader
    Variable("EPID_NUM_WORKERS", "num_workers", 0, "DataLoader worker processes per rank (0 = synthesise in the training process, on its device)", "2", _integer(0), "an integer >= 0"),
    Variable("EPID_PIN_MEMORY", "pin_memory", True, "pin host batches for non-blocking copies to the GPU", "0", _boolean, "1/0, true/false or yes/no"),
    Variable("EPID_PREFETCH_FACTOR", "prefetch_factor", 2, "batches prefetched per worker (only with EPID_NUM_WORKERS > 0)", "4", _integer(1), "an integer >= 1"),
    Variable("EPID_BATCH_ORDER", "batch_order", "sequential", "order of batch windows: sequential (legacy) or shuffled each epoch from EPID_SEED and the epoch", "shuffled", _choice("sequential", "shuffled"), "sequential or shuffled"),
    # Model and optimisation
    Variable("EPID_MODEL_SIZE", "model_size", "full", "model size preset: full (design sizes), small or tiny (smoke tests)", "tiny", _choice("full", "small", "tiny"), "full, small or tiny"),
    Variable("EPID_EPOCHS", "epochs", 2000, "number of epochs", "10", _integer(1), "an integer >= 1"),
    Variable("EPID_STEPS_PER_EPOCH", "steps_per_epoch", 0, "cap on optimizer steps per epoch (0 = every batch window)", "20", _integer(0), "an integer >= 0"),
    Variable("EPID_LR", "lr", 1e-4, "AdamW learning rate at global batch 128 (before EPID_LR_SCALING)", "3e-4", _real(0.0, strictly_positive=True), "a number > 0"),
    Variable("EPID_WEIGHT_DECAY", "weight_decay", 1e-4, "AdamW weight decay", "0.01", _real(0.0), "a number >= 0"),
    Variable("EPID_LR_SCALING", "lr_scaling", "none", "scale the learning rate with the global batch relative to 128", "sqrt", _choice("none", "linear", "sqrt"), "none, linear or sqrt"),
    Variable("EPID_WARMUP_EPOCHS", "warmup_epochs", 0, "epochs of linear learning-rate warm-up before the cosine restarts", "2", _integer(0), "an integer >= 0"),
    Variable("EPID_GRAD_ACCUM", "grad_accum", 1, "batches accumulated per optimizer step", "4", _integer(1), "an integer >= 1"),
    Variable("EPID_PRECISION", "precision", "auto", "autocast precision: auto is bf16 where the device supports it, else fp32", "fp32", _choice("auto", "bf16", "fp16", "fp32"), "auto, bf16, fp16 or fp32"),
    Variable("EPID_COMPILE", "compile", False, "compile the models with torch.compile", "1", _boolean, "1/0, true/false or yes/no"),
    Variable("EPID_SEED", "seed", 0, "seed of model initialisation and of the shuffled batch order", "1", _integer(0), "an integer >= 0"),
    Variable("EPID_MAX_NONFINITE_STEPS", "max_nonfinite_steps", 5, "consecutive non-finite losses (each skipped) that stop the run", "10", _integer(1), "an integer >= 1"),
    Variable("EPID_EARLY_STOP_PATIENCE", "early_stop_patience", 0, "stop after this many epochs without a new best validation loss (0 = off)", "50", _integer(0), "an integer >= 0"),
    Variable("EPID_GAMMA_SAMPLES", "gamma_samples", 64, "validation samples whose forward-model gamma pass rate (3 %/3 mm) is reported each epoch (0 = off)", "16", _integer(0), "an integer >= 0"),
    # Checkpoints and logging
    Variable("EPID_CHECKPOINT_PATH", "checkpoint_path", "checkpoints/epid_checkpoint.pth", "checkpoint written every epoch (best one beside it as *_best.pth; metrics.csv and losses.png in its folder)", "runs/a/epid.pth", _text, "a file path"),
    Variable("EPID_RESUME", "resume", False, "continue from EPID_CHECKPOINT_PATH (next epoch, same schedule position and histories)", "1", _boolean, "1/0, true/false or yes/no"),
    Variable("EPID_PROGRESS", "progress", True, "progress bar on rank 0 when attached to a terminal", "0", _boolean, "1/0, true/false or yes/no"),
    Variable("EPID_TIMING_EVERY", "timing_every", 0, "print a timing line every N batches (0 = one line per epoch)", "50", _integer(0), "an integer >= 0"),
    Variable("EPID_TIMING_MAX", "timing_max", 1, "most timing lines per epoch", "20", _integer(0), "an integer >= 0"),
)

@dataclass(frozen=True)
class Config:
    """The resolved run configuration. Field meanings: see ``VARIABLES``."""

    world_size: int = 1
    batch_size: int = GLOBAL_BATCH
    dataset_shuffle: bool = True
    dataset_seed: int = 12345
    dataset_range: str = ""
    dataset_ids_spec: str = ""
    dataset_ids: tuple[int, ...] = tuple(range(NUM_DATASETS))
    device: str = "auto"
    backend: str = "auto"
    threads: int = 0
    collective_timeout: int = 900
    dry_run: bool = False
    control_points: int = DEFAULT_CONTROL_POINTS
    kernel: str = ""
    noise_std: float = 0.005
    noise_seed: int = 0
    cache_dir: str = ""
    num_workers: int = 0
    pin_memory: bool = True
    prefetch_factor: int = 2
    batch_order: str = "sequential"
    model_size: str = "full"
    epochs: int = 2000
    steps_per_epoch: int = 0
    lr: float = 1e-4
    weight_decay: float = 1e-4
    lr_scaling: str = "none"
    warmup_epochs: int = 0
    grad_accum: int = 1
    precision: str = "auto"
    compile: bool = False
    seed: int = 0
    max_nonfinite_steps: int = 5
    early_stop_patience: int = 0
    gamma_samples: int = 64
    checkpoint_path: str = "checkpoints/epid_checkpoint.pth"
    resume: bool = False
    progress: bool = True
    timing_every: int = 0
    timing_max: int = 1
    launched_by_torchrun: bool = False

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

    def rank_dataset_ids(self, rank: int) -> list[int]:
        """The dataset IDs ``rank`` trains on, in order."""
        return sharding.assign_dataset_ids(
            self.dataset_ids, rank, self.world_size, self.dataset_shuffle, self.dataset_seed
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-typed copy (for checkpoints, JSON and printing)."""
        values = dataclasses.asdict(self)
        values["dataset_ids"] = list(self.dataset_ids)
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Config:
        """Rebuild from ``to_dict`` output; unknown keys (older or newer runs) are ignored."""
        known = {field.name for field in dataclasses.fields(cls)}
        kept = {key: value for key, value in values.items() if key in known}
        if "dataset_ids" in kept:
            kept["dataset_ids"] = tuple(kept["dataset_ids"])
        return cls(**kept)


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
        return variable.default
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
    values = {variable.field: _read(variable, environ) for variable in VARIABLES}

    torchrun_size = _torchrun_world_size(environ, values["world_size"])
    if torchrun_size is not None:
        values["world_size"] = torchrun_size
    values["launched_by_torchrun"] = torchrun_size is not None

    world_size = values["world_size"]
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
    ids = sharding.select_dataset_ids(values["dataset_range"], values["dataset_ids_spec"])
    values["dataset_ids"] = tuple(ids)
    if len(ids) < world_size:
        name, raw = _selection_variable(values)
        raise _fail(
            name, raw, f"{len(ids)} dataset(s) for {world_size} ranks: rank {len(ids)} would get no dataset",
            f"at least {world_size} datasets (one per rank), or fewer ranks",
        )

    kernel_path = _split_kernel(values["kernel"])[0]
    if kernel_path and not os.path.isfile(kernel_path):
        raise _fail("EPID_KERNEL", values["kernel"], f"no file {kernel_path!r}", "path.mat or path.mat:variable of an existing file")
    if values["cache_dir"] and os.path.exists(values["cache_dir"]) and not os.path.isdir(values["cache_dir"]):
        raise _fail("EPID_CACHE_DIR", values["cache_dir"], "exists and is not a directory", "a directory path")
    if values["resume"] and not os.path.isfile(values["checkpoint_path"]):
        raise _fail(
            "EPID_RESUME", environ.get("EPID_RESUME", ""), f"no checkpoint at EPID_CHECKPOINT_PATH={values['checkpoint_path']!r}",
            "an existing checkpoint to resume from, or EPID_RESUME=0",
        )
    if os.path.isdir(values["checkpoint_path"]):
        raise _fail("EPID_CHECKPOINT_PATH", values["checkpoint_path"], "is a directory", "a file path such as runs/a/epid.pth")
    return Config(**values)


def _selection_variable(values: Mapping[str, Any]) -> tuple[str, str]:
    if values["dataset_range"]:
        return "EPID_DATASET_RANGE", values["dataset_range"]
    if values["dataset_ids_spec"]:
        return "EPID_DATASET_IDS", values["dataset_ids_spec"]
    return "EPID_WORLD_SIZE", str(values["world_size"])


def help_text() -> str:
    """Every variable with its default and meaning, for ``--help``."""
    width = max(len(variable.name) for variable in VARIABLES)
    lines = ["Environment variables (unset or empty means the default):", ""]
    for item in VARIABLES:
        lines.append(f"  {item.name:<{width}}  default {item.shown_default}")
        lines.append(f"  {'':<{width}}  {item.meaning} (e.g. {item.example})")
    return "\n".join(lines)


def markdown_table() -> str:
    """The README's variable table (``python -m epid.config`` prints it)."""
    rows = ["| Variable | Meaning | Default | Example |", "|---|---|---|---|"]
    for item in VARIABLES:
        rows.append(f"| `{item.name}` | {item.meaning} | `{item.shown_default}` | `{item.example}` |")
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
