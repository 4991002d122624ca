"""The float16 frame cache (EPID_CACHE_DIR): each dataset's frames written once, read back by window.

A cache file belongs to one key: everything that changes the frames (the number of control
points, a digest of the kernel, the noise settings, the cache format and a digest of the
frame engine's sources; for an arc of an RT Plan also the plan file's and the plan reader's
digests and the beam number), so a changed setting never reads stale frames.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epid.core.files import fsync_directory
from epid.data.plans import PlanArc
from epid.synthesis import fluence, frames, geometry, sequences
from epid.synthesis import mlc as mlc_module
from epid.synthesis import physics as physics_module
from epid.synthesis.geometry import FRAME_SHAPE
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry
from epid.synthesis.physics import Physics

try:
    import fcntl
except ImportError:  # Windows: concurrent cache writers both write; the atomic rename keeps one.
    fcntl = None

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
CACHE_MAGIC = b"EPIDF16\n"
CACHE_HEADER_BYTES = 4096
CACHE_CHUNK_FRAMES = 64
MLC_FLUENCE = "each layer's transmission, interleaf leakage between leaves only"
"""How a real MLC whose strips are not its leaves is rendered (``epid.synthesis.fluence.frame_positions``);
the frames cached before it (every strip boundary leaking, one layer) have keys without it."""


def cache_key(n_control_points: int, kernel: np.ndarray | torch.Tensor, noise_std: float, noise_seed: int,
              render_id: str | None, physics: Physics | None = None, mlc: MlcGeometry = LEGACY_GRID) -> dict[str, Any]:
    """The key of the frames of one setting: control points per arc, kernel, noise, physics, frame
    engine and, for an MLC other than the legacy grid (whose keys are as before), the MLC; for one
    whose strips are not its leaves, also how its layers are rendered (``MLC_FLUENCE``)."""
    mlc_key = {} if mlc == LEGACY_GRID else {"mlc": mlc.to_dict()}
    if not mlc.identity:
        mlc_key["mlc_fluence"] = MLC_FLUENCE
    return mlc_key | {
        "physics": (physics or Physics()).to_dict(),
        "format_version": CACHE_FORMAT_VERSION,
        "n_control_points": n_control_points,
        "kernel_sha256": kernel_digest(kernel),
        "noise_std": float(noise_std),
        "noise_seed": int(noise_seed),
        "render_id": render_id,
    }


def plan_cache_key(arc: PlanArc, kernel: np.ndarray | torch.Tensor, noise_std: float, noise_seed: int,
                   render_id: str | None, physics: Physics | None = None) -> dict[str, Any]:
    """The key of the frames of one RT Plan arc (EPID_PLANS): ``cache_key`` of its number of
    control points, with the SHA-256 of the plan file and of the plan reader's source, and the beam."""
    from epid.dicom import mlc_devices, plan
    from epid.synthesis import mlc


    return {
        **cache_key(arc.control_points, kernel, noise_std, noise_seed, render_id, physics),
        "plan_sha256": arc.sha256,
        "beam_number": arc.beam_number,
        "plan_reader_sha256": hashlib.sha256(b"".join(Path(module.__file__).read_bytes()
                                                      for module in (plan, mlc_devices, mlc))).hexdigest(),
    }


def kernel_digest(kernel: np.ndarray | torch.Tensor) -> str:
    """SHA-256 of a kernel's shape and float64 values."""
    values = kernel.detach().cpu().numpy() if isinstance(kernel, torch.Tensor) else kernel
    values = np.ascontiguousarray(values, dtype=np.float64)
    digest = hashlib.sha256(str(values.shape).encode())
    digest.update(values.tobytes())
    return digest.hexdigest()


def engine_digest() -> str:
    """SHA-256 of the sources that turn an ID into frames (geometry, MLCs, control points, physics,
    fluence and frames)."""
    digest = hashlib.sha256()
    for module in (geometry, mlc_module, sequences, physics_module, fluence, frames):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


class FrameCache:
    """One float16 file of frames 1 .. N - 1 per dataset under ``directory``.

    File layout: a 4096-byte header (magic, JSON with the cache key, shape and the
    CRC-32 of the frame bytes) followed by (N - 1, 256, 256) float16 frames, frame ``f``
    at index ``f - 1``. The file name carries a digest of the key, which holds
    everything that changes the frames (N, kernel digest, noise, a format version and
    the frame engine's source digest), so a changed setting never reads stale frames.

    Files are written once, atomically (temporary file, fsync, rename), under an
    advisory lock where the platform has one. The first open of a file in a process
    checks its size, header and checksum; a bad file is reported with a one-line
    warning naming it, rewritten and never read. Later opens check the size only.
    """

    def __init__(self, directory: str | Path, key: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.key = dict(key)
        text = json.dumps(self.key, sort_keys=True)
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.n_frames = int(self.key["n_control_points"]) - 1
        self._verified: set[Path] = set()
        self._verified_pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_verified"] = set()
        return state

    @property
    def data_bytes(self) -> int:
        return self.n_frames * FRAME_SHAPE[0] * FRAME_SHAPE[1] * 2

    def path(self, dataset_id: int) -> Path:
        return self.directory / f"frames_{dataset_id:03d}_{self.digest}.f16"

    def read(
        self,
        dataset_id: int,
        first_frame: int,
        stop_frame: int,
        render_all: Callable[[], Iterator[np.ndarray]],
    ) -> np.ndarray:
        """Frames ``first_frame .. stop_frame - 1`` of a dataset, float16 (F, 256, 256).

        ``render_all`` yields the dataset's frames 1 .. N - 1 in order, in float32
        chunks of shape (F, 256, 256); it is called only when the file must be written.
        """
        if not 1 <= first_frame < stop_frame <= self.n_frames + 1:
            raise ValueError(f"frames {first_frame}..{stop_frame - 1} outside 1..{self.n_frames}")
        path = self._ensure(dataset_id, render_all)
        frames = np.memmap(
            path,
            dtype=np.float16,
            mode="r",
            offset=CACHE_HEADER_BYTES,
            shape=(self.n_frames, *FRAME_SHAPE),
        )
        window = np.array(frames[first_frame - 1 : stop_frame - 1])
        del frames
        return window

    def _ensure(self, dataset_id: int, render_all: Callable[[], Iterator[np.ndarray]]) -> Path:
        if self._verified_pid != os.getpid():
            self._verified, self._verified_pid = set(), os.getpid()
        path = self.path(dataset_id)
        expected_size = CACHE_HEADER_BYTES + self.data_bytes
        if path in self._verified and _file_size(path) == expected_size:
            return path
        self._verified.discard(path)
        self.directory.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(path.with_name(path.name + ".lock")):
            problem = self._problem(dataset_id, path)
            if problem is not None:
                if problem != "missing":
                    log.warning("frame cache %s is %s; regenerating it", path, problem)
                self._write(dataset_id, path, render_all())
        self._verified.add(path)
        return path

    def _header(self, dataset_id: int, crc32: int) -> bytes:
        content = dict(
            self.key,
            dataset_id=dataset_id,
            shape=[self.n_frames, *FRAME_SHAPE],
            dtype="float16",
            crc32=crc32,
        )
        text = json.dumps(content, sort_keys=True).encode()
        header = CACHE_MAGIC + struct.pack("<I", len(text)) + text
        if len(header) > CACHE_HEADER_BYTES:
            raise ValueError("frame cache header does not fit in its block")
        return header.ljust(CACHE_HEADER_BYTES, b"\0")

    def _problem(self, dataset_id: int, path: Path) -> str | None:
        """None for a good file, else what is wrong with it ("missing", ...)."""
        size = _file_size(path)
        if size is None:
            return "missing"
        expected_size = CACHE_HEADER_BYTES + self.data_bytes
        if size != expected_size:
            return f"of the wrong size ({size} bytes, expected {expected_size})"
        with open(path, "rb") as handle:
            block = handle.read(CACHE_HEADER_BYTES)
            stored = _parse_header(block)
            if stored is None:
                return "unreadable (bad header)"
            if block != self._header(dataset_id, stored["crc32"]):
                return "for other settings (header does not match)"
            crc32 = 0
            while chunk := handle.read(1 << 24):
                crc32 = zlib.crc32(chunk, crc32)
        if crc32 != stored["crc32"]:
            return "corrupt (checksum mismatch)"
        return None

    def _write(self, dataset_id: int, path: Path, chunks: Iterator[np.ndarray]) -> None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temporary, "wb") as handle:
                handle.write(bytes(CACHE_HEADER_BYTES))
                crc32, written = 0, 0
                for chunk in chunks:
                    data = np.ascontiguousarray(chunk, dtype=np.float16).tobytes()
                    crc32 = zlib.crc32(data, crc32)
                    written += len(data)
                    handle.write(data)
                if written != self.data_bytes:
                    raise RuntimeError(f"rendered {written} bytes of frames, expected {self.data_bytes}")
                handle.seek(0)
                handle.write(self._header(dataset_id, crc32))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
            fsync_directory(path.parent)
        finally:
            temporary.unlink(missing_ok=True)


def _parse_header(block: bytes) -> dict[str, Any] | None:
    start = len(CACHE_MAGIC) + 4
    if len(block) < start or not block.startswith(CACHE_MAGIC):
        return None
    (length,) = struct.unpack("<I", block[len(CACHE_MAGIC) : start])
    try:
        content = json.loads(block[start : start + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(content, dict) or not isinstance(content.get("crc32"), int):
        return None
    return content


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
