"""The gamma search: every point of every image searched together, shell by shell.

Around each reference point the evaluated image is sampled, with bilinear interpolation, on
circles ("shells") of increasing radius, as pymedphys' ``gamma_shell`` does. The shells are
walked in order of radius; the evaluated doses at the integer-pixel shifts around each point are
gathered once into a (shift, point) matrix, one shell's interpolated samples are one matrix
product of that shell's bilinear weights with a slice of it, and points whose search is over are
dropped from the working set as the radius grows. On a CPU with several torch threads, workers
of one thread each share the work: a stack of images in blocks, one per worker, the points of a
single image in chunks. The large buffers (inputs converted to float32, padded images, sample
matrices) come from workspaces that are reused, and on the CPU kept between calls up to 512 MiB:
memory mapped afresh costs a page fault per 4 KiB on first touch, and on a virtual machine those
faults took a fifth of a call.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

_FAR = 1.0e15
"""Evaluated dose (units of the dose criterion) standing for samples off the image."""


_INTEGER_TOLERANCE = 1.0e-9
"""Offsets closer than this (pixels) to a whole number of pixels are taken as whole."""


_SAMPLES_BUDGET = {"cpu": 1 << 26, "cuda": 1 << 28}
"""Largest (shift, point) sample matrix, in float32 elements, per device type."""


_CHUNK_POINTS = {"cpu": 1 << 16, "cuda": 1 << 20}
"""Reference points searched together, per device type."""


def search_distances(
    distance_mm: float, interp_fraction: float, max_gamma: float, stop_at_mm: float
) -> tuple[tuple[float, float], ...]:
    """Shell radii (mm) and the spacing (mm) of the points on each, in search order.

    Reproduces pymedphys' ``gamma_loop`` float arithmetic exactly, including the
    radius set to ``distance_mm`` when the running sum passes it. The list ends at
    ``distance_mm * max_gamma``, or at the first radius >= ``stop_at_mm`` when no
    point can still be searching beyond it.
    """
    max_test_distance = distance_mm * max_gamma
    step = distance_mm / interp_fraction
    forced = [distance_mm]
    distance = 0.0
    shells = []
    while distance <= max_test_distance:
        shells.append((distance, step))
        if distance >= stop_at_mm:
            break
        step = max(distance / interp_fraction / max_gamma, distance_mm / interp_fraction)
        distance += step
        if forced and distance >= forced[0]:
            distance = forced.pop(0)
    return tuple(shells)


def _circle_offsets(distance_mm: float, step_mm: float) -> np.ndarray:
    """Offsets (n, 2) in mm on one circle, as pymedphys' 2-D coordinate shell.

    Column 0 is along the first image axis (rows), column 1 along the second.
    """
    count = np.ceil(2 * np.pi * distance_mm / step_mm).astype(int) + 1
    theta = np.linspace(0, 2 * np.pi, count + 1)[:-1:]
    return np.stack([distance_mm * np.cos(theta), distance_mm * np.sin(theta)], axis=1)


def _bilinear_corners(offsets_px: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer corner shifts (n, 4, 2) and bilinear weights (n, 4) of pixel offsets."""
    nearest = np.round(offsets_px)
    offsets_px = np.where(np.abs(offsets_px - nearest) < _INTEGER_TOLERANCE, nearest, offsets_px)
    base = np.floor(offsets_px)
    fraction = offsets_px - base
    corners = np.stack([base, base + [0, 1], base + [1, 0], base + [1, 1]], axis=1)
    along_row, along_column = fraction[:, 0], fraction[:, 1]
    weights = np.stack(
        [
            (1 - along_row) * (1 - along_column),
            (1 - along_row) * along_column,
            along_row * (1 - along_column),
            along_row * along_column,
        ],
        axis=1,
    )
    return corners.astype(np.int64), weights


@dataclass(frozen=True)
class _Shell:
    """One circle of search points.

    ``weights`` (points on the circle, shift_stop - shift_start): bilinear weight of
    the evaluated dose at each shift of the sorted shift list from ``shift_start``.
    ``distance_term``: (radius / distance criterion) squared.
    """

    weights: torch.Tensor
    shift_start: int
    shift_stop: int
    distance_term: float


@functools.lru_cache(maxsize=16)
def _build_shells(
    distances: tuple[tuple[float, float], ...], distance_mm: float, pixel_mm: float
) -> tuple[list[tuple[np.ndarray, int, int, float]], np.ndarray]:
    """Shells over one list of integer shifts, sorted by length.

    With the shifts sorted by length, the corners that one circle needs form a
    contiguous range of the list, so a shell's samples are one matrix product with
    a slice of the (shift, point) sample matrix.

    Returns (weights, shift_start, shift_stop, distance_term) per shell, and the
    shifts (m, 2) as (row, column) pixel offsets.
    """
    per_shell = []
    for distance, step in distances:
        corners, weights = _bilinear_corners(_circle_offsets(distance, step) / pixel_mm)
        used = weights != 0
        per_shell.append((distance, corners[used], weights[used], np.nonzero(used)[0]))
    shifts = np.unique(np.concatenate([corners for _, corners, _, _ in per_shell]), axis=0)
    shifts = shifts[np.lexsort((shifts[:, 1], shifts[:, 0], np.hypot(*shifts.T)))]
    span = int(np.abs(shifts).max())
    position = np.zeros((2 * span + 1, 2 * span + 1), dtype=np.int64)
    position[shifts[:, 0] + span, shifts[:, 1] + span] = np.arange(len(shifts))
    shells = []
    for distance, corners, weights, sample in per_shell:
        column = position[corners[:, 0] + span, corners[:, 1] + span]
        start, stop = int(column.min()), int(column.max()) + 1
        matrix = np.zeros((int(sample.max()) + 1, stop - start))
        np.add.at(matrix, (sample, column - start), weights)
        shells.append((matrix.astype(np.float32), start, stop, (distance / distance_mm) ** 2))
    return shells, shifts


BLOCKS_PER_WORKER = 1
"""Blocks of images per worker thread when a stack holds enough images. More blocks even out
the workers' loads but each costs its own set-up: on 64 EPID-like maps and 2 workers, 1 block
each was the fastest of 1, 2, 4 and 8 (61, 66, 69, 71 ms in interleaved runs), and 5-6 % faster
than one block searched by both workers chunk by chunk, side by side."""


@contextlib.contextmanager
def one_thread_workers(workers: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """Worker threads of one torch thread each: the gathers run on one thread anyway, and two
    levels of threads would oversubscribe the cores. torch.set_num_threads also sets the count
    that threads starting later inherit; it is restored after."""
    threads = torch.get_num_threads()
    try:
        with concurrent.futures.ThreadPoolExecutor(workers, initializer=torch.set_num_threads,
                                                   initargs=(1,)) as pool:
            yield pool
    finally:
        torch.set_num_threads(threads)


class Workspace:
    """Reused float32 buffers, flat, by name, each grown to the largest size asked of it.

    Memory mapped afresh costs a page fault per 4 KiB page on first touch; on a virtual
    machine that is ~1.5 us each, as long as the whole search of a small stack. Reusing
    the buffers (within a call, and across calls on the CPU) spares it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def matrix(self, name: str, rows: int, columns: int) -> torch.Tensor:
        """The first rows x columns elements of buffer ``name`` as a matrix."""
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < rows * columns:
            buffer = self.buffers[name] = torch.empty(rows * columns, device=self.device)
        return buffer[: rows * columns].view(rows, columns)

    def swap(self, name: str, other: str) -> None:
        """Exchanges buffers ``name`` and ``other``."""
        self.buffers[name], self.buffers[other] = self.buffers[other], self.buffers[name]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())


class _WorkspacePool:
    """Workspaces for one use, each lent to one worker at a time; a new one when none is free.

    A pool that ``keeps`` holds its returned workspaces for later calls, as long as all kept
    pools together hold at most ``_KEPT_BYTES``; others are freed when returned.
    """

    def __init__(self, device: torch.device, keeps: bool) -> None:
        self.device = device
        self.keeps = keeps
        self.free: list[Workspace] = []

    @contextlib.contextmanager
    def lent(self) -> Iterator[Workspace]:
        with _KEPT_LOCK:
            workspace = self.free.pop() if self.free else Workspace(self.device)
        try:
            yield workspace
        finally:
            with _KEPT_LOCK:
                if self.keeps and kept_bytes() + workspace.nbytes <= _KEPT_BYTES:
                    self.free.append(workspace)

    @property
    def nbytes(self) -> int:
        return sum(workspace.nbytes for workspace in self.free)

    def clear(self) -> None:
        with _KEPT_LOCK:
            self.free.clear()


@dataclass(frozen=True)
class _Workspaces:
    """The pools of one call: converted inputs, padded image stacks (``images``) and
    the working sets of chunks of points (``points``). Kept apart, each kind of
    workspace grows only the buffers of its own use."""

    inputs: _WorkspacePool
    images: _WorkspacePool
    points: _WorkspacePool

    def pools(self) -> tuple[_WorkspacePool, ...]:
        return self.inputs, self.images, self.points


_KEPT_BYTES = 1 << 29
"""Most memory (bytes) that the CPU pools keep between calls."""


_KEPT_LOCK = threading.Lock()
"""Guards the kept pools' lists of free workspaces (calls may come from several threads)."""


CPU_WORKSPACES = _Workspaces(*(_WorkspacePool(torch.device("cpu"), keeps=True) for _ in range(3)))


def kept_bytes() -> int:
    return sum(pool.nbytes for pool in CPU_WORKSPACES.pools())


def workspaces_for(device: torch.device) -> _Workspaces:
    """The CPU's kept pools, or pools for one call on other devices (whose caching allocator
    already reuses memory)."""
    if device.type == "cpu":
        return CPU_WORKSPACES
    return _Workspaces(*(_WorkspacePool(device, keeps=False) for _ in range(3)))


@dataclass
class _WorkingSet:
    """The points of one chunk still searching.

    ``samples`` (buffer ``samples`` of ``workspace``) holds, from shift ``first_row`` of the sorted
    shift list on, the evaluated dose at point + shift minus the reference dose at the
    point, filled up to shift ``gathered``. ``position`` is each point's index in the
    chunk and ``best`` its squared gamma so far.
    """

    padded_index: torch.Tensor
    reference: torch.Tensor
    local_factor: torch.Tensor | None
    position: torch.Tensor
    best: torch.Tensor
    workspace: Workspace
    shift_count: int
    first_row: int = 0
    gathered: int = 0

    def __post_init__(self) -> None:
        self.samples = self.workspace.matrix("samples", self.shift_count, self.best.numel())

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Samples of the shifts ``start:stop``, (stop - start, points)."""
        return self.samples[start - self.first_row : stop - self.first_row]

    def keep(self, keep: torch.Tensor, first_row: int) -> None:
        """Keeps the points ``keep`` and the samples of shifts from ``first_row`` on."""
        workspace = self.workspace
        samples = workspace.matrix("spare", self.shift_count - first_row, keep.numel())
        torch.index_select(
            self.rows(first_row, self.gathered), 1, keep, out=samples[: self.gathered - first_row]
        )
        workspace.swap("samples", "spare")
        self.samples, self.first_row = samples, first_row
        self.padded_index, self.reference, self.position, self.best = (
            t.index_select(0, keep) for t in (self.padded_index, self.reference, self.position, self.best)
        )
        if self.local_factor is not None:
            self.local_factor = self.local_factor.index_select(0, keep)


class ShellSearch:
    """Gamma search around the counted points of (images, H, W) image stacks.

    Doses are in units of the global dose criterion. The squared gamma at each point
    itself (radius 0) is computed for whole images; the points it does not settle are
    searched in chunks, side by side on a multi-threaded CPU: for each chunk, a working
    set gathers the evaluated doses at the integer shifts that the shells need, shell by
    shell, and drops the points whose gamma is settled.
    """

    def __init__(
        self,
        reference: torch.Tensor,
        evaluation: torch.Tensor,
        counted: torch.Tensor,
        dose_criterion: torch.Tensor,
        local_dose_percent: float | None,
        workspaces: _Workspaces,
        workers: int,
    ) -> None:
        """Search around the points where ``counted`` (images, H, W) is true.

        ``dose_criterion`` is each image's global dose criterion (images,) in the units
        of the images. For local gamma, ``local_dose_percent`` is the dose criterion in
        percent of the reference dose at each point; None for global gamma. The padded
        images and the chunks borrow ``workspaces``; up to ``workers`` threads search the
        chunks side by side.
        """
        self.workspaces = workspaces
        self.workers = workers
        self.reference = reference.contiguous()
        self.evaluation = evaluation
        self.counted = counted
        self.scale = dose_criterion.reciprocal()
        self.local_dose_percent = local_dose_percent
        self.device = evaluation.device

    def run(
        self, gamma: torch.Tensor, *, distance_mm: float, interp_fraction: float, max_gamma: float,
        pixel_mm: float,
    ) -> None:
        """Writes gamma into ``gamma`` (images, H, W, contiguous), capped at ``max_gamma``,
        NaN where not counted."""
        self._gamma_at_point(gamma)
        first = search_distances(distance_mm, interp_fraction, max_gamma, stop_at_mm=sys.float_info.min)
        if len(first) == 1:
            gamma.clamp_(max=max_gamma)
            return
        # A first shell within the search radius means max_gamma >= its distance term: the points
        # not searched need no cap. NaN (not counted, a non-finite dose) compares false.
        points = torch.nonzero(torch.gt(gamma, first[1][0] / distance_mm).view(-1)).squeeze(1)
        if points.numel() == 0:
            return
        self.max_gamma = max_gamma
        at_points = gamma.take(points).square_()
        # the search is over once the distance term alone passes the largest gamma at a point
        largest = at_points.nan_to_num(posinf=0.0).max().item()
        stop_at_mm = distance_mm * math.sqrt(min(largest, _FAR))
        distances = search_distances(distance_mm, interp_fraction, max_gamma, stop_at_mm)
        shells, shifts = _build_shells(distances[1:], distance_mm, pixel_mm)
        self.shells = [
            _Shell(torch.as_tensor(w, device=self.device), a, b, d)
            for w, a, b, d in shells
        ]
        later_starts = [shell.shift_start for shell in self.shells[1:]] + [len(shifts)]
        self.first_shift_after = np.minimum.accumulate(later_starts[::-1])[::-1].tolist()
        self.shift_count = len(shifts)
        with self.workspaces.images.lent() as workspace:
            self.padded, self.padded_row_start, self.shift_offsets = self._pad(shifts, workspace)
            self._search(points, at_points, gamma)

    def _search(self, points: torch.Tensor, at_points: torch.Tensor, gamma: torch.Tensor) -> None:
        """Searches around ``points`` (flat indices, (n,)) in chunks, side by side on a CPU with
        several torch threads, and writes their gamma into ``gamma``."""
        device_type = self.device.type if self.device.type in _CHUNK_POINTS else "cpu"
        largest_chunk = max(1024, min(_CHUNK_POINTS[device_type], _SAMPLES_BUDGET[device_type] // self.shift_count))
        workers = min(self.workers, -(-points.numel() // largest_chunk))
        # as many chunks for each worker, of about one size
        chunk_count = workers * -(-points.numel() // (workers * largest_chunk))
        chunk = -(-points.numel() // chunk_count)
        starts = range(0, points.numel(), chunk)

        def search_chunk(start: int) -> None:
            part = slice(start, start + chunk)
            with self.workspaces.points.lent() as workspace:
                self._search_chunk(points[part], at_points[part], gamma, workspace)

        if workers > 1:
            with one_thread_workers(workers) as pool:
                list(pool.map(search_chunk, starts))
        else:
            for start in starts:
                search_chunk(start)

    def _search_chunk(
        self, flat_index: torch.Tensor, at_point: torch.Tensor, gamma: torch.Tensor, workspace: Workspace
    ) -> None:
        """Searches around the points ``flat_index`` (n,) of the flattened image stacks,
        whose squared gamma at the point itself is ``at_point`` (n,), and writes their
        gamma, capped, into ``gamma``."""
        _, height, width = gamma.shape
        image_row = torch.div(flat_index, width, rounding_mode="floor")
        column = flat_index - image_row * width
        image = torch.div(image_row, height, rounding_mode="floor")
        padded_index = self.padded_row_start.index_select(0, image_row).add_(column)
        if self.padded.numel() < 2**31:
            padded_index = padded_index.int()
        reference_dose = self.reference.view(-1).index_select(0, flat_index).mul_(self.scale.index_select(0, image))
        chunk = _WorkingSet(
            padded_index,
            reference_dose,
            None if self.local_dose_percent is None else self._local_factor(reference_dose),
            torch.arange(flat_index.numel(), device=self.device),
            at_point,
            workspace,
            self.shift_count,
        )
        gamma.view(-1).index_copy_(0, flat_index, self._run_chunk(chunk).sqrt_().clamp_(max=self.max_gamma))

    def _local_factor(self, reference_dose: torch.Tensor) -> torch.Tensor:
        """(global criterion / local criterion)^2 at reference doses: it converts squared
        differences. The finite cap keeps exact agreement at 0 where the reference is
        tiny, and the other points there above any max_gamma."""
        return ((100 / self.local_dose_percent) / reference_dose).square_().clamp_(max=1e30)

    def _gamma_at_point(self, gamma: torch.Tensor) -> None:
        """Writes into ``gamma`` (images, H, W) the gamma from the evaluated dose at the points
        themselves (radius 0), NaN where not counted."""
        scale = self.scale[:, None, None]
        torch.sub(self.evaluation, self.reference, out=gamma).mul_(scale).abs_()
        if self.local_dose_percent is not None:
            gamma.mul_(self._local_factor(self.reference * scale).sqrt_())
        gamma.masked_fill_(self.counted.logical_not(), math.nan)

    def _pad(self, shifts: np.ndarray, workspace: Workspace) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Flattened evaluated images, in units of the dose criterion, padded to hold
        every shift around every point.

        Each shift's samples are read through a view of the padded images that
        starts at that shift, with one index per point shared by all shifts: the
        index of the point's row start plus its column. Returns the padded images (a
        buffer of ``workspace``), the row starts (one per row of all images) and the start
        of each shift's view.
        """
        images, height, width = self.evaluation.shape
        margin = int(np.abs(shifts).max())
        padded_height, padded_width = height + 2 * margin, width + 2 * margin
        padded = workspace.matrix("padded", images * padded_height, padded_width).view(images, padded_height, -1)
        padded[:, :margin].fill_(_FAR)
        padded[:, margin + height :].fill_(_FAR)
        padded[:, margin : margin + height, :margin].fill_(_FAR)
        padded[:, margin : margin + height, margin + width :].fill_(_FAR)
        interior = padded[:, margin : margin + height, margin : margin + width]
        torch.mul(self.evaluation, self.scale[:, None, None], out=interior)
        shift_offsets = shifts[:, 0] * padded_width + shifts[:, 1]
        padded_rows = torch.arange(images * padded_height, device=self.device).view(images, padded_height)
        row_start = padded_rows[:, margin : margin + height].reshape(-1) * padded_width
        row_start += margin + int(shift_offsets.min())
        return padded.view(-1), row_start, (shift_offsets - shift_offsets.min()).tolist()

    def _run_chunk(self, points: _WorkingSet) -> torch.Tensor:
        """Squared gamma of a chunk of points, walking the shells in order."""
        result = torch.empty_like(points.best)
        for number, shell in enumerate(self.shells):
            self._gather(points, shell.shift_stop)
            window = points.rows(shell.shift_start, shell.shift_stop)
            products = points.workspace.matrix("products", len(shell.weights), window.shape[1])
            closest = torch.mm(shell.weights, window, out=products).square_().amin(dim=0)
            if points.local_factor is not None:
                closest.mul_(points.local_factor)
            torch.minimum(points.best, closest.add_(shell.distance_term), out=points.best)
            if number + 1 < len(self.shells) and self._drop_settled(points, number, result) == 0:
                return result
        result.index_copy_(0, points.position, points.best)
        return result

    def _gather(self, points: _WorkingSet, stop: int) -> None:
        """Fills the samples of the working set up to shift ``stop``."""
        if stop <= points.gathered:
            return
        rows = points.rows(points.gathered, stop)
        for row, start in zip(rows, self.shift_offsets[points.gathered : stop], strict=True):
            torch.index_select(self.padded[start:], 0, points.padded_index, out=row)
        rows.sub_(points.reference)
        points.gathered = stop

    def _drop_settled(self, points: _WorkingSet, number: int, result: torch.Tensor) -> int:
        """Drops the points that shells after ``number`` cannot improve, when worth it.

        Points are dropped (their gamma written to ``result``) when copying the
        others costs less than carrying them through the next shell alone.
        Returns how many points are still searching.
        """
        following = self.shells[number + 1]
        # Samples on later shells are at least their distance term from the point.
        searching = points.best > following.distance_term
        remaining = int(searching.sum())
        settled = points.best.numel() - remaining
        next_row = self.first_shift_after[number]
        next_shell_work = len(following.weights) + max(following.shift_stop - points.gathered, 0)
        if settled * (next_shell_work + 4) > remaining * (points.gathered - next_row + 4):
            result.index_copy_(0, points.position, points.best)
            points.keep(torch.nonzero(searching).squeeze(1), next_row)
        return remaining
