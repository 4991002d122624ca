"""Training checkpoints: plain containers, written atomically, loadable with weights_only.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so
``torch.load(path, weights_only=True)`` reads it without running pickled code. Keys (format 2):

  format_version, run_id, epoch (last completed, 1-based), forward_model, inverse_model
  (state dicts without ``module.`` / ``_orig_mod.`` prefixes), model_config
  (``epid.models.families.PairConfig.to_dict()``: {"family", "forward": config, "inverse": config}),
  optimizer, schedule (the learning-rate schedule's base rate and shape), scaler (or None), rng,
  history {"train": {term: [...]}, "val": {term: [...]}, "gamma_pass": [...], "lr": [...],
  "samples_per_s": [...], ...}, best_val_loss, best_epoch, window_cursor (where the next capped
  epoch starts in each rank's window stream; 0 when missing), config (Config.to_dict()),
  dataset_ids, world_size, torch_version, precision (the autocast precision the run trains in and
  the CPU it was chosen on: {"name", "cpu", "cpu_features"}; missing in older checkpoints), and
  ``interrupted`` (None, or where an epoch was
  stopped by a signal: {"epoch", "batches_done", "rank_train_sums", "rank_train_samples", ...},
  the loss sums and sample counts of every rank so far). ``epid.training.run_state`` writes and reads
  the training state in it.

Format 1 (written before model configs named their family) is read as format 2: its
model_config {"forward": kwargs, "inverse": kwargs} is a legacy pair with those configs, the
base rate of its LambdaLR ``scheduler`` state is the schedule's, and an interrupted epoch's
summed loss sums are carried on by rank 0.

Writes go to a temporary file in the same folder, are fsynced, renamed over the target and
the folder is fsynced, so a crash at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from epid.core.errors import InputError
from epid.core.files import fsync_directory, temporary_path
from epid.models.families import LEGACY, PairConfig

FORMAT_VERSION = 2
REQUIRED_KEYS = ("format_version", "epoch", "forward_model", "inverse_model", "model_config")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class CheckpointError(InputError):
    """A checkpoint file that is missing, unreadable or does not fit the request."""


def best_path(path: str | Path) -> Path:
    """The best-validation checkpoint beside ``path``: ``run.pth`` -> ``run_best.pth``."""
    path = Path(path)
    return path.with_name(f"{path.stem}_best{path.suffix or '.pth'}")


def save_checkpoint(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (temporary file, fsync, rename, fsync folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as handle:
            torch.save(dict(payload), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(path.parent)


def strip_wrapper_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict without DistributedDataParallel (``module.``) / torch.compile (``_orig_mod.``) prefixes."""
    stripped = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        stripped[key] = value
    return stripped


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True`` and check its layout.

    Model state dicts come back without wrapper prefixes. Raises CheckpointError naming the
    file and the reason (missing, not a checkpoint, unsafe content, newer format, missing keys).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: no such file")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint {str(path)!r}: not a torch.save file (truncated or another format)")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: holds objects that torch.load(weights_only=True) refuses "
            f"({_unsafe_reason(error)})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable or truncated ({reason})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: holds a {type(payload).__name__}, expected a dict")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: missing {', '.join(missing)}; not an epid training checkpoint"
        )
    if not isinstance(payload["format_version"], int) or payload["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: format version {payload['format_version']!r} is newer than "
            f"this code reads ({FORMAT_VERSION}); update epid"
        )
    for key in ("forward_model", "inverse_model"):
        payload[key] = strip_wrapper_prefixes(payload[key])
    if payload["format_version"] == 1:
        _read_format_1(payload)
    return payload


def _read_format_1(payload: dict[str, Any]) -> None:
    """Turn a format-1 checkpoint into format 2, in place."""
    payload["model_config"] = {"family": LEGACY, **payload["model_config"]}
    scheduler = payload.pop("scheduler", None) or {}  # torch's LambdaLR state: its base rate is all that stays
    payload["schedule"] = {"base_lr": float(scheduler["base_lrs"][0])} if scheduler.get("base_lrs") else {}
    interrupted = payload.get("interrupted")
    if interrupted and "train_sums" in interrupted:  # the sums of all ranks added up: rank 0 carries them on
        others = int(payload.get("world_size", 1)) - 1
        sums = interrupted.pop("train_sums")
        interrupted["rank_train_sums"] = [sums] + [[0.0] * len(sums)] * others
        interrupted["rank_train_samples"] = [interrupted.pop("train_samples")] + [0.0] * others
    payload["format_version"] = 2


def _unsafe_reason(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line]
    return (named or lines or ["unknown content"])[0].split(" was not an allowed")[0]


def load_weights(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Load a state dict strictly, except that parameters the model lists in ``ADDED_PARAMETERS``
    (added after the checkpoint was written, neutral at their initial values) may be absent."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    absent = [name for name in missing if name not in getattr(model, "ADDED_PARAMETERS", ())]
    if absent or unexpected:
        raise RuntimeError(f"missing keys {absent}, unexpected keys {list(unexpected)}")


def build_models_from_checkpoint(
    checkpoint: Mapping[str, Any], device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The (forward, inverse) models a checkpoint (from ``load_checkpoint``) describes, of any
    family and size, weights loaded, in eval mode on ``device``."""
    try:
        forward_model, inverse_model = PairConfig.from_dict(checkpoint["model_config"]).build()
        load_weights(forward_model, checkpoint["forward_model"])
        load_weights(inverse_model, checkpoint["inverse_model"])
    except (TypeError, KeyError, RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0]
        raise CheckpointError(f"checkpoint model does not match its model_config ({reason})") from None
    return forward_model.to(device).eval(), inverse_model.to(device).eval()
