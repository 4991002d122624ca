"""File-system helpers for crash-safe writes.

Files are written to a temporary file beside them, ``.<name>.<pid>.tmp`` (``temporary_path``),
and renamed over the target. A writer killed in between leaves the temporary file behind;
``remove_stale_temporaries`` removes those whose writer is gone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

GLOB_CHARACTERS = re.compile(r"[*?[]")
"""A path holding one of these is a glob pattern."""


def fsync_directory(directory: Path) -> None:
    """Flush a directory entry (after a rename) to disk; a no-op where directories cannot be opened."""
    if os.name != "posix":
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def temporary_path(path: Path) -> Path:
    """Where this process writes ``path`` before renaming it: ``.<name>.<pid>.tmp`` beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (outside POSIX: assumed to)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(paths: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """Remove the temporary files of ``paths`` (``temporary_path`` of any process) whose writer
    process is gone; (removed, kept because their writer still runs)."""
    removed, kept = [], []
    for path in paths:
        pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.tmp$")
        if not path.parent.is_dir():
            continue
        for candidate in sorted(path.parent.iterdir()):
            match = pattern.match(candidate.name)
            if not match:
                continue
            if process_alive(int(match.group(1))):
                kept.append(candidate)
            else:
                candidate.unlink(missing_ok=True)
                removed.append(candidate)
    return removed, kept
