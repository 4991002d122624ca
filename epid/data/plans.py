"""Training arcs from RT Plan files (EPID_PLANS): a clinic's own deliveries in place of the
synthetic dataset IDs.

Every regular file in the folder (hidden files aside), in name order, must be an RT Plan;
each of its treatment beams with at least 2 control points is one arc (``epid.dicom.plan``),
and arc i of that order stands where dataset ID i stands otherwise: it is sharded over the
ranks, split into training and validation samples, synthesised and cached like a dataset ID,
its frame noise drawn from (noise seed, i, frame). Each arc keeps its own number of control
points. Its frame cache is keyed by the SHA-256 of the plan file and the beam number, so an
edited plan never reads another's frames.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epid.core.errors import InputError

if TYPE_CHECKING:
    from epid.synthesis.sequences import ControlPoints


@dataclass(frozen=True)
class PlanArc:
    """One treatment beam of an RT Plan file used as a training arc.

    control_points: the beam's number of control points N (N - 1 frames, N - 2 samples).
    sha256: of the plan file's bytes when it was scanned.
    """

    path: str
    beam_number: int
    beam_name: str
    control_points: int
    sha256: str

    def describe(self) -> str:
        """``plans/a.dcm beam 1 (ARC), 178 control points``."""
        name = f" ({self.beam_name})" if self.beam_name else ""
        return f"{self.path} beam {self.beam_number}{name}, {self.control_points} control points"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "beam_number": self.beam_number, "beam_name": self.beam_name,
                "control_points": self.control_points, "sha256": self.sha256}


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def scan_plans(directory: str | Path, min_control_points: int) -> tuple[PlanArc, ...]:
    """The arcs of the RT Plan files in ``directory`` (see the module docstring).

    InputError (one line) for a folder that is missing or holds no file; ``PlanError`` naming the
    file and the beam for a file that is not a readable RT Plan, a beam that
    ``epid.dicom.plan.read_plan`` refuses, an arc of fewer than ``min_control_points``, or a beam
    whose MLC is not the first beam's.
    """
    from epid.dicom.plan import PlanError, read_plan

    folder = Path(directory)
    if not folder.is_dir():
        raise InputError(f"{directory}: no such folder (expected a folder of RT Plan files)")
    files = sorted(path for path in folder.iterdir() if path.is_file() and not path.name.startswith("."))
    if not files:
        raise InputError(f"{directory}: no files (expected RT Plan files)")
    arcs = []
    first = None
    for path in files:
        digest = file_sha256(path)
        for beam in read_plan(path):
            first = first or beam
            if beam.geometry != first.geometry:
                raise PlanError(f"{path}: beam {beam.beam_number} ({beam.beam_name}): MLC {beam.mlc}, but "
                                f"{first.path} beam {first.beam_number} has {first.mlc}; the plans of one run must "
                                "share one MLC")
            if len(beam) < min_control_points:
                raise PlanError(f"{path}: beam {beam.beam_number} ({beam.beam_name}): {len(beam)} control points; "
                                f"a training arc needs at least {min_control_points} (a training and a validation "
                                "sample)")
            arcs.append(PlanArc(str(path), beam.beam_number, beam.beam_name, len(beam), digest))
    return tuple(arcs)


def arc_control_points(arc: PlanArc, dataset_id: int) -> ControlPoints:
    """The control points of ``arc`` as dataset ``dataset_id``; InputError when the file changed
    since it was scanned (its frames would no longer match its cache key)."""
    from epid.dicom.plan import read_plan

    if file_sha256(arc.path) != arc.sha256:
        raise InputError(f"{arc.path}: the plan file changed after the run read it (EPID_PLANS); start the run again")
    (beam,) = read_plan(arc.path, arc.beam_number, dataset_id=dataset_id)
    return beam.control_points
