"""Pre-flight checks: everything a rank would trip over, checked once before any rank starts.

``check(config)`` runs in the launching process of a training run and of ``EPID_DRY_RUN=1``
alike: the device and backend on this node, the kernel file (read as a kernel), the precision
on the device, the checkpoint's folder (writable), the TensorBoard package and folder
(EPID_TENSORBOARD), and the checkpoint to resume (present, readable, of the same model family
and size, its optimizer state fitting the models' parameter groups). Unknown ``EPID_*`` names
and bad values are caught before, by ``epid.config.load.load_config``. Bad input raises InputError
(one line, exit status 2 from the entry script) before anything is spawned; nothing is
written. It returns notes on what a resumed run changes.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from epid.config.load import Config
from epid.core.devices import resolve_device, resolve_precision
from epid.core.errors import InputError
from epid.models.checkpoint import CheckpointError, build_models_from_checkpoint, load_checkpoint
from epid.models.families import CrossModel
from epid.training import distributed
from epid.training.optimizer import group_sizes, parameter_groups
from epid.training.tensorboard_log import check_available


def check(config: Config) -> list[str]:
    """Raise InputError on the first check that fails; notes on the resumed run (if any)."""
    check_launch(config)
    check_kernel(config)
    resolve_precision(config.precision, resolve_device(config.device))
    check_checkpoint_folder(config)
    if config.tensorboard:
        check_available(config.tensorboard)
        check_writable(Path(config.tensorboard), f"EPID_TENSORBOARD={config.tensorboard!r}")
    if not config.resume:
        return []
    return resume_notes(config, load_checkpoint(config.checkpoint_path))


def check_launch(config: Config) -> None:
    """The node's last rank gets its device (so every rank does) and the backend fits the device."""
    ranks_here = distributed.local_world_size(config)
    device = resolve_device(config.device, ranks_here - 1)  # the highest GPU index of the node's ranks
    if config.backend == "nccl" and device.type != "cuda":
        raise distributed.LaunchError(
            "EPID_BACKEND='nccl': nccl needs CUDA devices, training runs on the CPU; expected gloo or auto"
        )


def check_kernel(config: Config) -> None:
    """Load EPID_KERNEL once here so a bad .mat file is one error line, not one per rank."""
    if not config.kernel_path:
        return
    from epid.synthesis.kernel import kernel_from_config

    try:
        kernel_from_config(config.kernel_path, config.kernel_variable)
    except (InputError, ValueError, OSError, KeyError) as error:
        raise InputError(f"EPID_KERNEL={config.kernel!r}: {error}") from None


def check_checkpoint_folder(config: Config) -> None:
    """The checkpoint's folder can be made and written in (``check_writable``)."""
    check_writable(Path(config.checkpoint_path).absolute().parent, "EPID_CHECKPOINT_PATH folder")


def check_writable(folder: Path, what: str) -> None:
    """``folder`` can be made (its nearest existing ancestor is a folder) and files can be written
    in it; nothing is created. InputError naming ``what`` otherwise."""
    folder = folder.absolute()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise InputError(f"{what} {str(folder)!r}: cannot write there ({error.strerror or error})") from None


def resume_notes(config: Config, checkpoint: dict[str, Any]) -> list[str]:
    """Check that ``checkpoint`` can continue under ``config``; describe what changes.

    Raises CheckpointError when the model family or size differs, the models do not rebuild,
    the optimizer state is missing or its parameter groups do not fit the models', or the
    checkpoint already reached EPID_EPOCHS.
    """
    path = config.checkpoint_path
    saved = checkpoint.get("config") or {}
    family = checkpoint["model_config"].get("family")
    if family != config.model:
        raise CheckpointError(
            f"checkpoint {path!r} holds EPID_MODEL={family!r} models; EPID_MODEL={config.model!r} cannot resume it "
            "(use the same family)"
        )
    if saved.get("model_size", config.model_size) != config.model_size:
        raise CheckpointError(
            f"checkpoint {path!r} holds EPID_MODEL_SIZE={saved['model_size']!r} models; "
            f"EPID_MODEL_SIZE={config.model_size!r} cannot resume it (use the same size)"
        )
    models = build_models_from_checkpoint(checkpoint)
    if "optimizer" not in checkpoint:
        raise CheckpointError(f"checkpoint {path!r} has no optimizer state; it cannot be resumed")
    saved_groups = [len(group["params"]) for group in checkpoint["optimizer"]["param_groups"]]
    groups = group_sizes(parameter_groups(CrossModel(*models)))
    if saved_groups != groups:
        raise CheckpointError(
            f"checkpoint {path!r} has optimizer parameter groups of {saved_groups} parameters; the models' "
            f"learning-rate groups now hold {groups}; it cannot be resumed"
        )
    epoch = int(checkpoint["epoch"])
    if epoch >= config.epochs:
        raise CheckpointError(
            f"checkpoint {path!r} already completed {epoch} epoch(s); set EPID_EPOCHS above {epoch} to continue"
        )
    notes = [f"Resuming {path} after epoch {epoch} (run {checkpoint.get('run_id', '?')})"]
    saved_world = int(checkpoint.get("world_size", config.world_size))
    if saved_world != config.world_size:
        notes.append(f"  world size changes from {saved_world} to {config.world_size} rank(s)")
    if list(checkpoint.get("dataset_ids", config.dataset_ids)) != list(config.dataset_ids):
        selected = f"{len(checkpoint['dataset_ids'])} -> {len(config.dataset_ids)} datasets"
        notes.append(f"  dataset selection changes ({selected})")
    if saved.get("plan_arcs", []) != [arc.to_dict() for arc in config.plan_arcs]:
        notes.append(f"  training plan arcs change ({len(saved.get('plan_arcs', []))} -> {len(config.plan_arcs)} "
                     "arcs, or their files)")
    for name in ("batch_size", "grad_accum", "control_points", "lr_schedule", "lr_update"):
        if name in saved and saved[name] != getattr(config, name):
            notes.append(f"  {name} changes from {saved[name]} to {getattr(config, name)}")
    saved_lr = (checkpoint.get("schedule") or {}).get("base_lr")
    if saved_lr is not None and not math.isclose(saved_lr, config.effective_lr, rel_tol=1e-9):
        notes.append(f"  base learning rate changes from {saved_lr:.3g} to {config.effective_lr:.3g} "
                     "(schedule position kept)")
    return notes
