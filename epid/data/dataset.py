"""Training samples, splits, batch windows and the frame source of the training data path.

Sample ``s`` of a dataset (``0 <= s < N - 2`` for ``N`` control points) pairs control
point ``s + 1`` ("prev") with control point ``s + 2`` ("curr"); its EPID frames are
frame ``s + 1`` and frame ``s + 2``. The first ``floor(0.8125 * (N - 2))`` samples of
each dataset are for training, the rest for validation (1664 / 384 for N = 2050).

A batch is a ``Window``: consecutive samples ``start .. stop - 1`` of one split of one
dataset. It needs frames ``start + 1 .. stop + 1`` only; they are rendered once (or read
from the frame cache) and sliced into ``epid_prev`` and ``epid_curr``, so frame ``f``
of dataset ``d`` is the same tensor values wherever it appears.

Only control points are kept in memory (packed losslessly, 0.65 MB per dataset of 2050
control points); frames are synthesised for the batch at hand on the device that trains
on them. With a cache directory, each dataset's frames are written once as float16 and read
back window by window through ``np.memmap`` (``epid.data.cache``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epid.core.devices import Device
from epid.data.cache import CACHE_CHUNK_FRAMES, FrameCache, cache_key, engine_digest, plan_cache_key
from epid.data.plans import PlanArc, arc_control_points
from epid.data.windows import Window, dataset_windows, num_samples
from epid.synthesis import frames as frames_module
from epid.synthesis import sequences
from epid.synthesis.geometry import FRAME_SHAPE
from epid.synthesis.kernel import default_kernel
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry
from epid.synthesis.physics import Physics
from epid.synthesis.sequences import X_JAW_OPEN_MM, ControlPoints, generate_control_points

FrameRender = Callable[[ControlPoints, int, np.ndarray, torch.device], torch.Tensor]


# --------------------------------------------------------------------------- batches


@dataclass(eq=False, repr=False)
class Batch:
    """A window of consecutive samples of one dataset (tensors in mm and MU).

    leaf_a, leaf_b: (B, 104), [prev 52, curr 52] leaf positions, mm (as delivered, also behind an X
        jaw: the edges the frames show are ``epid.models.losses.shown_leaves``).
    scalars: (B, 5), [mu_curr (MU), jaw_1 prev, jaw_1 curr, jaw_2 prev, jaw_2 curr (mm)]; (B, 9) on an
        MLC with X jaws other than the legacy grid, [X1 prev, X1 curr, X2 prev, X2 curr (mm)] appended
        (open at +-``X_JAW_OPEN_MM`` where the control points have none).
    leaf_weight_a, leaf_weight_b: (B, 104), loss weights in the leaf layout.
    epid_prev, epid_curr: (B, 1, 256, 256), frames ``s + 1`` and ``s + 2``.
    dataset_id, first_sample: where the window starts (-1 when not from a dataset).
    frames: (B + 1, 1, 256, 256) when epid_prev / epid_curr are its views ``[:-1]`` and
        ``[1:]``; ``to`` and ``pin_memory`` then move the shared frames once.
    """

    leaf_a: torch.Tensor
    leaf_b: torch.Tensor
    scalars: torch.Tensor
    leaf_weight_a: torch.Tensor
    leaf_weight_b: torch.Tensor
    epid_prev: torch.Tensor
    epid_curr: torch.Tensor
    dataset_id: int = -1
    first_sample: int = -1
    frames: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.leaf_a.shape[0]

    def __repr__(self) -> str:
        return (
            f"Batch(dataset_id={self.dataset_id}, first_sample={self.first_sample}, "
            f"samples={len(self)}, device={self.leaf_a.device})"
        )

    def to(self, device: Device, non_blocking: bool = False) -> Batch:
        """The batch on ``device`` (non-blocking copies need pinned source memory)."""
        return self._apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory (needs an accelerator)."""
        return self._apply(lambda t: t.pin_memory())

    def _apply(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        if self.frames is not None:
            frames = move(self.frames)
            epid_prev, epid_curr = frames[:-1], frames[1:]
        else:
            frames, epid_prev, epid_curr = None, move(self.epid_prev), move(self.epid_curr)
        return Batch(
            leaf_a=move(self.leaf_a),
            leaf_b=move(self.leaf_b),
            scalars=move(self.scalars),
            leaf_weight_a=move(self.leaf_weight_a),
            leaf_weight_b=move(self.leaf_weight_b),
            epid_prev=epid_prev,
            epid_curr=epid_curr,
            dataset_id=self.dataset_id,
            first_sample=self.first_sample,
            frames=frames,
        )


def assemble_batch(control_points: ControlPoints, window: Window, frames: torch.Tensor) -> Batch:
    """The samples of ``window`` from the dataset's control points and its frames.

    ``frames``: (len(window) + 1, 256, 256), frames ``window.start + 1 .. window.stop + 1``.
    Parameter tensors are float32 on the frames' device.
    """
    if frames.shape != (len(window) + 1, *FRAME_SHAPE):
        raise ValueError(f"frames of shape {tuple(frames.shape)} do not fit {window}")
    prev = np.arange(window.start + 1, window.stop + 1)
    curr = prev + 1

    def pair(values: np.ndarray) -> torch.Tensor:
        both = np.concatenate([values[prev], values[curr]], axis=1)
        return torch.from_numpy(both.astype(np.float32)).to(frames.device)

    cp = control_points
    columns = [cp.mu[curr], cp.jaw_1[prev], cp.jaw_1[curr], cp.jaw_2[prev], cp.jaw_2[curr]]
    if cp.mlc.arcs_have_x_jaws:
        x_jaws = cp.x_jaws if cp.x_jaws is not None else np.tile(np.float32([-X_JAW_OPEN_MM, X_JAW_OPEN_MM]),
                                                                  (len(cp), 1))
        columns += [x_jaws[prev, 0], x_jaws[curr, 0], x_jaws[prev, 1], x_jaws[curr, 1]]
    scalars = np.stack(columns, axis=1)
    stacked = frames.unsqueeze(1)
    return Batch(
        leaf_a=pair(cp.leaf_a),
        leaf_b=pair(cp.leaf_b),
        scalars=torch.from_numpy(scalars.astype(np.float32)).to(frames.device),
        leaf_weight_a=pair(cp.leaf_weight),
        leaf_weight_b=pair(cp.leaf_weight),
        epid_prev=stacked[:-1],
        epid_curr=stacked[1:],
        dataset_id=window.dataset_id,
        first_sample=window.start,
        frames=stacked,
    )


# --------------------------------------------------------------------------- data source


class EngineRender:
    """Renders frames with ``epid.synthesis.frames`` for one kernel, noise setting and physics.

    Keeps the kernel prepared once per device (``frames_module.renderer_for``).
    """

    def __init__(self, kernel: np.ndarray | torch.Tensor, noise_std: float, noise_seed: int,
                 physics: Physics | None = None) -> None:
        self.kernel = kernel
        self.noise_std = noise_std
        self.noise_seed = noise_seed
        self.physics = physics or Physics()
        self._renderers: dict[torch.device, frames_module.FrameRenderer] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_renderers"] = {}
        return state

    def __call__(
        self,
        control_points: ControlPoints,
        dataset_id: int,
        frame_indices: np.ndarray,
        device: torch.device,
    ) -> torch.Tensor:
        renderer = self._renderers.get(device)
        if renderer is None:
            renderer = self._renderers[device] = frames_module.renderer_for(self.kernel, device)
        return renderer.render(
            control_points,
            frame_indices,
            dataset_id=dataset_id,
            noise_std=self.noise_std,
            noise_seed=self.noise_seed,
            physics=self.physics,
        )


class PackedControlPoints:
    """One dataset's control points stored in half the bytes, losslessly.

    Each array whose values are whole tenths (mm, MU, leaf weights) within int16 range
    is stored as int16 tenths and decoded with the same float division the generator
    used; the decoded array is checked to be bit-identical when packing, and an array
    that would not be is kept as it is.
    """

    def __init__(self, control_points: ControlPoints) -> None:
        self._type = type(control_points)
        self._arrays: dict[str, tuple[np.ndarray, np.dtype | None]] = {}
        self._others: dict[str, Any] = {}
        for item in fields(control_points):
            value = getattr(control_points, item.name)
            if isinstance(value, np.ndarray):
                self._arrays[item.name] = _pack_tenths(value)
            else:
                self._others[item.name] = value

    @property
    def nbytes(self) -> int:
        return sum(stored.nbytes for stored, _ in self._arrays.values())

    def unpack(self) -> ControlPoints:
        arrays = {name: _unpack_tenths(*packed) for name, packed in self._arrays.items()}
        return self._type(**arrays, **self._others)


def _pack_tenths(values: np.ndarray) -> tuple[np.ndarray, np.dtype | None]:
    """(int16 tenths, float dtype) when that round-trips exactly, else (values, None)."""
    if values.dtype.kind != "f" or not np.isfinite(values).all():
        return values, None
    tenths = np.rint(values.astype(np.float64) * 10)
    if np.abs(tenths).max(initial=0) > np.iinfo(np.int16).max:
        return values, None
    packed = tenths.astype(np.int16)
    if not np.array_equal(_unpack_tenths(packed, values.dtype), values):
        return values, None
    return packed, values.dtype


def _unpack_tenths(stored: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    if dtype is None:
        return stored
    return stored.astype(dtype) / dtype.type(10)


class EpidData:
    """The training data of a rank: control points of its datasets, frames on demand.

    Holds the control points of ``dataset_ids`` only (generated on first use of each
    dataset and kept, or all at once with ``prepare``), the kernel and the renderer.
    ``make_batch`` renders a window's frames on the device that trains on them, or
    reads them from the frame cache when ``cache_dir`` is set.

    With ``plan_arcs`` (EPID_PLANS), dataset ``i`` is the arc ``plan_arcs[i]`` of an RT Plan
    (``epid.data.plans``) with its own number of control points instead of a synthetic arc of
    ``control_points``; its frame cache key adds the plan file's digest and the beam number.

    ``render(control_points, dataset_id, frame_indices, device) -> (F, 256, 256)``
    replaces the frame engine; ``render_id`` then names it in the frame cache key.
    """

    def __init__(
        self,
        dataset_ids: Sequence[int],
        *,
        control_points: int = sequences.DEFAULT_CONTROL_POINTS,
        kernel: np.ndarray | torch.Tensor | None = None,
        noise_std: float = 0.005,
        noise_seed: int = 0,
        cache_dir: str | Path | None = None,
        render: FrameRender | None = None,
        render_id: str | None = None,
        physics: Physics | None = None,
        plan_arcs: Sequence[PlanArc] = (),
        mlc: MlcGeometry = LEGACY_GRID,
    ) -> None:
        if not dataset_ids:
            raise ValueError("no dataset IDs given")
        self.dataset_ids = tuple(int(i) for i in dataset_ids)
        self.n_control_points = control_points
        self.plan_arcs = tuple(plan_arcs)
        for dataset_id in self.dataset_ids:
            num_samples(self.arc_control_points(dataset_id))
        self.kernel = default_kernel() if kernel is None else kernel
        self.noise_std = noise_std
        self.noise_seed = noise_seed
        self.physics = physics or Physics()
        self.mlc = mlc
        if render is None:
            render, render_id = EngineRender(self.kernel, noise_std, noise_seed, self.physics), engine_digest()
        elif cache_dir and render_id is None:
            raise ValueError("a custom render needs a render_id to key its frame cache")
        self.render = render
        self.cache = None
        self._plan_caches: dict[int, FrameCache] = {}
        if cache_dir and self.plan_arcs:
            self._plan_caches = {
                dataset_id: FrameCache(cache_dir, plan_cache_key(
                    self.plan_arcs[dataset_id], self.kernel, noise_std, noise_seed, render_id, self.physics))
                for dataset_id in self.dataset_ids
            }
        elif cache_dir:
            self.cache = FrameCache(
                cache_dir, cache_key(control_points, self.kernel, noise_std, noise_seed, render_id, self.physics,
                                     self.mlc)
            )
        self._control_points: dict[int, PackedControlPoints] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_control_points"] = {}
        return state

    def arc_control_points(self, dataset_id: int) -> int:
        """Control points of the arc of ``dataset_id`` (its plan arc's own, or ``n_control_points``)."""
        return self.plan_arcs[dataset_id].control_points if self.plan_arcs else self.n_control_points

    def control_points_for(self, dataset_id: int) -> ControlPoints:
        """The control points of one selected dataset (generated or read from its plan once, then
        kept packed)."""
        packed = self._control_points.get(dataset_id)
        if packed is None:
            if dataset_id not in self.dataset_ids:
                raise KeyError(f"dataset {dataset_id} is not among the selected datasets")
            if self.plan_arcs:
                control_points = arc_control_points(self.plan_arcs[dataset_id], dataset_id)
            else:
                control_points = generate_control_points(dataset_id, self.n_control_points, self.mlc)
            self._control_points[dataset_id] = PackedControlPoints(control_points)
            return control_points
        return packed.unpack()

    def prepare(self) -> None:
        """Generate the control points of every selected dataset now (else on first use).

        Before starting loader workers this lets forked workers share them instead of
        each generating its own copy; it costs the generation time of every dataset.
        """
        for dataset_id in self.dataset_ids:
            if dataset_id not in self._control_points:
                self.control_points_for(dataset_id)

    def control_point_bytes(self) -> int:
        """Bytes of the control-point arrays held now."""
        return sum(packed.nbytes for packed in self._control_points.values())

    def windows(self, split: str, batch_size: int) -> list[Window]:
        """Windows of ``split`` of every dataset, datasets in the given order."""
        return [
            window
            for dataset_id in self.dataset_ids
            for window in dataset_windows(dataset_id, self.arc_control_points(dataset_id), split, batch_size)
        ]

    def make_batch(self, window: Window, device: Device) -> Batch:
        """The samples of ``window`` with their frames on ``device``."""
        control_points = self.control_points_for(window.dataset_id)
        frames = self._frames(control_points, window.dataset_id, window.start + 1, window.stop + 2, device)
        return assemble_batch(control_points, window, frames)

    def _frames(
        self,
        control_points: ControlPoints,
        dataset_id: int,
        first_frame: int,
        stop_frame: int,
        device: Device,
    ) -> torch.Tensor:
        device = torch.device(device)
        cache = self._plan_caches.get(dataset_id, self.cache)
        if cache is None:
            indices = np.arange(first_frame, stop_frame, dtype=np.int64)
            return self.render(control_points, dataset_id, indices, device).to(torch.float32)
        n_control_points = len(control_points)

        def render_all() -> Iterator[np.ndarray]:
            for start in range(1, n_control_points, CACHE_CHUNK_FRAMES):
                stop = min(start + CACHE_CHUNK_FRAMES, n_control_points)
                indices = np.arange(start, stop, dtype=np.int64)
                yield self.render(control_points, dataset_id, indices, device).cpu().numpy()

        stored = cache.read(dataset_id, first_frame, stop_frame, render_all)
        return torch.from_numpy(stored).to(device).to(torch.float32)


# --------------------------------------------------------------------------- loading


class WindowDataset(torch.utils.data.Dataset):
    """Map-style dataset keyed by ``Window``: ``dataset[window]`` is a CPU ``Batch``."""

    def __init__(self, data: EpidData) -> None:
        self.data = data

    def __getitem__(self, window: Window) -> Batch:
        return self.data.make_batch(window, "cpu")


class WindowSampler(torch.utils.data.Sampler):
    """Yields the windows set for the current epoch (runs in the main process)."""

    def __init__(self) -> None:
        self.windows: list[Window] = []

    def __iter__(self) -> Iterator[Window]:
        return iter(list(self.windows))

    def __len__(self) -> int:
        return len(self.windows)


def _keep(batch: Batch) -> Batch:
    return batch


class BatchLoader:
    """Batches for lists of windows, synthesised directly or by DataLoader workers.

    ``num_workers == 0``: each batch is made on ``device`` in this process (frames
    rendered on the GPU when ``device`` is one). ``num_workers > 0``: persistent
    workers synthesise batches on the CPU ahead of time (``prefetch_factor`` each),
    pinned when ``pin_memory`` and ``device`` is CUDA; move them with
    ``batch.to(device, non_blocking=True)``. Both paths give the same batches in
    the same order on the same kind of device (frame noise drawn on a CUDA device
    differs from the CPU's, see ``epid.synthesis.frames``).

    Workers generate the control points of the datasets they meet and keep them for the
    run; call ``data.prepare()`` before building the loader to generate them once in
    this process and share them with the forked workers instead. Iterate one
    ``batches`` call to its end (or drop it) before starting the next.
    """

    def __init__(
        self,
        data: EpidData,
        device: Device,
        *,
        num_workers: int = 0,
        pin_memory: bool = True,
        prefetch_factor: int = 2,
    ) -> None:
        self.data = data
        self.device = torch.device(device)
        self.num_workers = num_workers
        self.pin_memory = pin_memory and self.device.type == "cuda"
        self._sampler = WindowSampler()
        self._loader = None
        if num_workers > 0:
            self._loader = torch.utils.data.DataLoader(
                WindowDataset(data),
                batch_size=None,
                sampler=self._sampler,
                collate_fn=_keep,
                num_workers=num_workers,
                pin_memory=self.pin_memory,
                prefetch_factor=prefetch_factor,
                persistent_workers=True,
            )

    def batches(self, windows: Sequence[Window]) -> Iterator[Batch]:
        """The batches of ``windows``, in order."""
        if self._loader is None:
            return (self.data.make_batch(window, self.device) for window in windows)
        self._sampler.windows = list(windows)
        return iter(self._loader)
