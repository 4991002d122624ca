"""DICOM RT Plans: the control points of a plan's beams, and synthetic arcs written as plans.

Reading (``read_plan``), per treatment beam:

- MU: frame f integrates the motion from control point f - 1 to f, so its MU is the beam's
  ``BeamMeterset`` (fraction group) x (CMW_f - CMW_f-1) / final CMW, where CMW is the
  ``CumulativeMetersetWeight`` of each control point; ``mu[0] = 0``.
- Positions a control point omits carry over from the last control point that gave them.
- MLC (``epid.dicom.mlc_devices``): an ``MLCX`` device, or the two layers of a dual-layer MLC
  (Halcyon's ``MLCX1``, ``MLCX2``), bank A the first N of its ``LeafJawPositions``, bank B the
  next N, leaf pair i spanning y in [``LeafPositionBoundaries[i]``, ``LeafPositionBoundaries[i + 1]``).
  Its geometry (``PlanBeam.geometry``: a built-in MLC, or the plan's own) gives each of its
  strips over y in [-130, 130) its edges (``MlcGeometry.strips``): the project's 52 strips of 5 mm
  (Agility's central 52 pairs, Millennium 120's 10 mm leaves two strips each, a dual layer's edges
  where both layers are open), or for leaves of 2.5 mm (HD120) 104 strips of 2.5 mm, those beyond
  its leaves open. An MLC whose leaves are finer than 2.5 mm is refused.
- Jaws: ``ASYMY`` or ``Y`` give jaw_1, jaw_2 (clipped to [-130, 130] mm); ``ASYMX`` or ``X``
  are folded into the leaves (no leaf opens past an X jaw).
- Positions are rounded to 0.1 mm, as the synthetic arcs are; MU are kept as the plan gives
  them (a 0.3 MU interval rounded to 0.1 MU would be off by up to 17 %).
- Refused, one line naming file, beam, control point and value: a BeamMeterset that is not a
  positive number, a final cumulative meterset weight of 0, a leaf or jaw position that is not
  finite or beyond ``MAX_TRAVEL_MM``, crossed leaves, a collimator angle that changes within the
  beam. A file without the DICOM preamble and file meta (as Monaco writes) is read as a bare
  data set, and said so once.

The frames of a plan are in the collimator's frame (IEC BEAM LIMITING DEVICE coordinates): x
along the leaves' travel, y across the leaf pairs. Gantry and collimator angles, the beam and
machine names are kept as metadata only.

Writing (``write_plan``, ``write_arcs``): arcs as a VMAT plan of one beam per arc on the MLC they
were made for: each leaf at its strips' position (``MlcGeometry.leaves``), a leaf beyond the strips closed at the
middle of the nearest strip's opening, ``ASYMY`` jaws where the MLC has Y jaws and ``ASYMX`` jaws
where an arc is given X jaws. The legacy grid is written as Agility (80 pairs of 5 mm, the strips
its central 52), which like every single-layer MLC written here has exactly the devices {MLCX,
ASYMY} that ``pymedphys.Delivery.from_dicom`` reads (it refuses {MLCX, ASYMX, ASYMY}, a plan with
X jaws, as a jaw system it does not support); a dual-layer MLC is written as MLCX1 and MLCX2.
The cumulative meterset weight is the cumulative MU (CMW_0 = 0, final CMW = sum of
``mu[1:]``), so the MU of every frame is exact in the file.

Every problem with an input file is a ``PlanError``: one line naming the file, the beam and
the problem.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydicom.charset import default_encoding
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.tag import Tag

from epid.core.errors import InputError
from epid.dicom.files import check_sop_class, new_dataset, read_dataset, save_dataset
from epid.dicom.mlc_devices import MAX_TRAVEL_MM, MLC_TYPE, read_mlc
from epid.synthesis.geometry import LEAF_WIDTH_MM, MLC_Y_MIN_MM, NUM_LEAF_PAIRS, TENTHS_PER_MM
from epid.synthesis.mlc import LEGACY_GRID, MLC_GEOMETRIES, ROUNDING_SLACK, MlcGeometry
from epid.synthesis.sequences import ControlPoints, behind_x_jaws, fold_into_x_jaws, mlc_leaf_weights

RT_PLAN_STORAGE = "1.2.840.10008.5.1.4.1.1.481.5"
MLC_Y_MAX_MM = MLC_Y_MIN_MM + NUM_LEAF_PAIRS * LEAF_WIDTH_MM
SAD_MM = 1000.0
JAW_TYPES = {"ASYMY": "y", "Y": "y", "ASYMX": "x", "X": "x"}
LEAF_JAW_POSITIONS = Tag("LeafJawPositions")
CROSSED_TOLERANCE_MM = 0.01
"""How far a bank A leaf may lie past its bank B leaf (a closed pair written with rounding), mm."""
ANGLE_TOLERANCE_DEG = 1e-3
"""Change of the collimator angle within a beam taken as none, degrees."""


class PlanError(InputError):
    """An RT Plan file that cannot be read into control points; one line naming the file, the
    beam and the problem."""


@dataclass(frozen=True)
class PlanBeam:
    """One treatment beam of an RT Plan as the project's control points.

    gantry_deg: (N,) gantry angle of each control point, degrees (IEC 61217).
    collimator_deg: the collimator angle of the beam, degrees (one per arc beam: a change is refused);
    frames are in the collimator's frame whatever it is.
    control_points: positions in mm rounded to 0.1, MU as the plan gives them (``mu[f]`` the MU of frame f,
    ``mu[0] = 0``), ``pattern = "plan"``.
    """

    path: str
    beam_number: int
    beam_name: str
    machine: str
    mlc: str
    """The MLC device read, e.g. "MLCX 80 leaf pairs: 80 x 5 mm"."""
    beam_mu: float
    gantry_deg: np.ndarray
    collimator_deg: float
    control_points: ControlPoints
    final_meterset_weight: float = 1.0
    """The beam's final cumulative meterset weight: a weight w lies at beam_mu x w / it MU."""
    geometry: MlcGeometry = LEGACY_GRID
    """The beam's MLC (``epid.dicom.mlc_devices``)."""

    def __len__(self) -> int:
        return len(self.control_points)

    @property
    def x_jaws(self) -> np.ndarray | None:
        """(N, 2) the X jaws' positions [X1, X2] at each control point, mm along x (the control
        points' own); None for a beam without X jaws. The leaves are folded into them (no leaf opens
        past an X jaw)."""
        return self.control_points.x_jaws

    def behind_x_jaws(self) -> np.ndarray | None:
        """(2, N, 52) int8 for bank A's and bank B's leaves: 1 where the leaf lies at or behind the X1
        jaw, 2 where at or behind X2 (``epid.synthesis.sequences.behind_x_jaws``), so that an image shows
        that jaw's edge, not the leaf's; 0 elsewhere. None without X jaws."""
        if self.x_jaws is None:
            return None
        return behind_x_jaws(self.control_points.leaf_a, self.control_points.leaf_b, self.x_jaws)


# --------------------------------------------------------------------------- reading


def read_plan(path: str | Path, beam: int | None = None, dataset_id: int = 0) -> list[PlanBeam]:
    """The treatment beams of the RT Plan in ``path`` with at least 2 control points, or only the
    beam whose BeamNumber is ``beam``. ``dataset_id`` becomes the control points' ``dataset_id``.

    PlanError (one line: file, beam, problem) for a file that is not a readable RT Plan, an
    unknown beam, or a beam without control points, MLC, meterset or with inconsistent values.
    """
    path = str(path)
    dataset = read_dataset(path, PlanError, "an RT Plan")
    check_sop_class(path, dataset, RT_PLAN_STORAGE, "RTPLAN", "an RT Plan", PlanError)
    try:
        return _read_beams(path, dataset, beam, dataset_id)
    except PlanError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as problem:
        reason = (str(problem).strip().splitlines() or [type(problem).__name__])[0]
        raise PlanError(f"{path}: malformed RT Plan ({reason})") from None


def _read_beams(path: str, dataset: Dataset, beam: int | None, dataset_id: int) -> list[PlanBeam]:
    beams = list(dataset.get("BeamSequence", []))
    numbers = [_beam_number(item) for item in beams]
    if beam is not None:
        if beam not in numbers:
            raise PlanError(f"{path}: no beam {beam}; beams here: {_beam_list(beams)}")
        chosen = [beams[numbers.index(beam)]]
    else:
        chosen = [item for item in beams if _is_treatment_arc(item)]
        if not chosen:
            raise PlanError(f"{path}: no treatment beam with at least 2 control points; beams here: "
                            f"{_beam_list(beams)}")
    metersets = _beam_metersets(dataset)
    return [_read_beam(path, item, metersets, dataset_id) for item in chosen]


def _beam_number(beam: Dataset) -> int | None:
    value = beam.get("BeamNumber")
    return int(value) if value not in (None, "") else None


def _beam_list(beams: Iterable[Dataset]) -> str:
    described = [f"{_beam_number(item)} ({item.get('BeamName', '')!s}, {item.get('TreatmentDeliveryType', '')!s}, "
                 f"{len(item.get('ControlPointSequence', []))} control points)" for item in beams]
    return ", ".join(described) or "none"


def _is_treatment_arc(beam: Dataset) -> bool:
    return (beam.get("TreatmentDeliveryType", "TREATMENT") in ("TREATMENT", "")
            and len(beam.get("ControlPointSequence", [])) >= 2)


def _beam_metersets(dataset: Dataset) -> dict[int, float]:
    """BeamMeterset of each referenced beam number, from the first fraction group that gives one."""
    metersets: dict[int, float] = {}
    for group in dataset.get("FractionGroupSequence", []):
        for reference in group.get("ReferencedBeamSequence", []):
            number, meterset = reference.get("ReferencedBeamNumber"), reference.get("BeamMeterset")
            if number not in (None, "") and meterset not in (None, ""):
                metersets.setdefault(int(number), float(meterset))
    return metersets


def _numbers(item: Dataset, keyword: str) -> np.ndarray | None:
    """The values of a numeric string element as float64, parsed straight from the file's bytes
    when still raw (much faster than one Python object per value); None when absent or empty."""
    if keyword not in item:
        return None
    value = item.get_item(keyword).value
    if isinstance(value, bytes):
        return np.array(value.split(b"\\"), dtype=np.float64) if value.strip() else None
    if value is None or value == "" or (isinstance(value, list) and not value):
        return None
    return np.atleast_1d(np.asarray(value, dtype=np.float64))


def _read_beam(path: str, beam: Dataset, metersets: dict[int, float], dataset_id: int) -> PlanBeam:
    number = _beam_number(beam)
    name = str(beam.get("BeamName", ""))
    where = f"{path}: beam {number}" + (f" ({name})" if name else "")
    control_points = list(beam.get("ControlPointSequence", []))
    if not control_points:
        raise PlanError(f"{where}: no control points")
    if len(control_points) < 2:
        raise PlanError(f"{where}: only 1 control point; an arc needs at least 2")
    if number not in metersets:
        raise PlanError(f"{where}: no BeamMeterset for this beam in the fraction group")
    if not np.isfinite(metersets[number]) or metersets[number] <= 0:
        raise PlanError(f"{where}: BeamMeterset {metersets[number]:g} (expected a positive number of MU)")
    devices = {str(item.get("RTBeamLimitingDeviceType", "")): item
               for item in beam.get("BeamLimitingDeviceSequence", [])}
    mlc = read_mlc(where, devices, _numbers, PlanError)
    geometry = mlc.geometry
    n = len(control_points)
    layers = [np.empty((n, 2, pairs)) for pairs in geometry.pairs]
    jaws = {"x": np.tile([-np.inf, np.inf], (n, 1)), "y": np.tile([MLC_Y_MIN_MM, MLC_Y_MAX_MM], (n, 1))}
    cumulative = np.empty(n)
    gantry = np.empty(n)
    collimator = _numbers(control_points[0], "BeamLimitingDeviceAngle")
    if collimator is None:
        raise PlanError(f"{where}: control point 0 has no BeamLimitingDeviceAngle")
    latest: dict[str, np.ndarray] = {}
    for index, point in enumerate(control_points):
        weight = _numbers(point, "CumulativeMetersetWeight")
        if weight is None:
            raise PlanError(f"{where}: control point {index} has no CumulativeMetersetWeight")
        if not np.isfinite(weight[0]):
            raise PlanError(f"{where}: control point {index}: CumulativeMetersetWeight {weight[0]:g} "
                            "(expected a finite weight)")
        cumulative[index] = weight[0]
        angle = _numbers(point, "BeamLimitingDeviceAngle")
        if angle is not None and abs(angle[0] - collimator[0]) > ANGLE_TOLERANCE_DEG:
            raise PlanError(f"{where}: control point {index}: collimator angle {angle[0]:g} deg after "
                            f"{collimator[0]:g} deg at control point 0 (expected one angle per arc beam)")
        gantry[index] = _gantry_angle(where, index, point, gantry)
        for item in point.get("BeamLimitingDevicePositionSequence", []):
            device = str(item.get("RTBeamLimitingDeviceType", ""))
            positions = _numbers(item, "LeafJawPositions")
            if positions is not None:
                latest[device] = positions
        for layer, device, pairs in zip(layers, mlc.devices, geometry.pairs, strict=True):
            if device not in latest:
                raise PlanError(f"{where}: control point {index} gives no {device} positions and no earlier one did")
            positions = latest[device]
            if len(positions) != 2 * pairs:
                raise PlanError(f"{where}: inconsistent leaf counts: control point {index} gives {len(positions)} "
                                f"{device} positions for {pairs} leaf pairs (expected {2 * pairs})")
            named = f" {device}" if len(layers) > 1 else ""
            layer[index] = _checked_leaves(f"{where}: control point {index}{named}", positions.reshape(2, pairs),
                                           geometry.travel_mm)
        for device, axis in JAW_TYPES.items():
            if device in latest and device in devices:
                values = latest[device]
                if len(values) != 2:
                    raise PlanError(f"{where}: control point {index} gives {len(values)} {device} positions "
                                    "(expected 2)")
                if not np.all(np.isfinite(values)) or np.any(np.abs(values) > MAX_TRAVEL_MM):
                    raise PlanError(f"{where}: control point {index}: {device} positions "
                                    f"{values[0]:g}, {values[1]:g} mm (expected finite, within "
                                    f"+-{MAX_TRAVEL_MM:g} mm)")
                jaws[axis][index] = [max(jaws[axis][index, 0], values[0]), min(jaws[axis][index, 1], values[1])]
    final = beam.get("FinalCumulativeMetersetWeight")
    final_weight = float(final) if final not in (None, "") else float(cumulative[-1])
    mu = _frame_mu(where, cumulative, metersets[number], final_weight)
    leaf_a, leaf_b = geometry.strips([(layer[:, 0], layer[:, 1]) for layer in layers])
    x_jaws = jaws["x"]
    has_x_jaws = bool(np.isfinite(x_jaws).all())
    leaf_a, leaf_b = fold_into_x_jaws(leaf_a, leaf_b, x_jaws)
    jaw_1, jaw_2 = (_tenth(np.clip(jaws["y"][:, side], MLC_Y_MIN_MM, MLC_Y_MAX_MM)) for side in (0, 1))
    control = ControlPoints(
        leaf_a=_tenth(leaf_a), leaf_b=_tenth(leaf_b), jaw_1=jaw_1, jaw_2=jaw_2, mu=_read_only(mu.astype(np.float32)),
        leaf_weight=_read_only(mlc_leaf_weights(jaw_1, jaw_2, geometry)), dataset_id=int(dataset_id), pattern="plan",
        mlc=geometry, x_jaws=_tenth(x_jaws) if has_x_jaws else None,
    )
    return PlanBeam(
        path=path, beam_number=int(number), beam_name=name,
        machine=str(beam.get("TreatmentMachineName", "")), mlc=mlc.description, beam_mu=float(metersets[number]),
        gantry_deg=_read_only(gantry.astype(np.float32)), collimator_deg=float(collimator[0]), control_points=control,
        final_meterset_weight=final_weight, geometry=geometry,
    )


def _checked_leaves(where: str, leaves: np.ndarray, travel_mm: float) -> np.ndarray:
    """A control point's leaf positions (2, pairs) [bank A, bank B] mm; PlanError naming the pair
    and the value for a position that is not finite, beyond the MLC's ``travel_mm``, or a pair whose
    bank A leaf is past its bank B leaf by more than ``CROSSED_TOLERANCE_MM``."""
    bad = ~np.isfinite(leaves) | (np.abs(leaves) > travel_mm)
    if np.any(bad):
        bank, pair = (int(v) for v in np.argwhere(bad)[0])
        raise PlanError(f"{where}: leaf pair {pair + 1} bank {'AB'[bank]} at {leaves[bank, pair]:g} mm "
                        f"(expected finite, within +-{travel_mm:g} mm)")
    crossed = leaves[0] - leaves[1] > CROSSED_TOLERANCE_MM
    if np.any(crossed):
        pair = int(np.argmax(crossed))
        raise PlanError(f"{where}: leaf pair {pair + 1} crossed: bank A at {leaves[0, pair]:g} mm is past bank B "
                        f"at {leaves[1, pair]:g} mm")
    return leaves


def _gantry_angle(where: str, index: int, point: Dataset, earlier: np.ndarray) -> float:
    """A control point's gantry angle, or the previous control point's when it omits it."""
    value = _numbers(point, "GantryAngle")
    if value is not None:
        return float(value[0])
    if index == 0:
        raise PlanError(f"{where}: control point 0 has no GantryAngle")
    return float(earlier[index - 1])


def _frame_mu(where: str, cumulative: np.ndarray, beam_mu: float, final_weight: float) -> np.ndarray:
    """MU (N,) of each frame: beam MU x the rise of the cumulative meterset weight; 0 at CP 0."""
    steps = np.diff(cumulative)
    if np.any(steps < 0):
        index = int(np.argmax(steps < 0)) + 1
        raise PlanError(f"{where}: CumulativeMetersetWeight decreases at control point {index} "
                        f"({cumulative[index - 1]:g} -> {cumulative[index]:g})")
    if final_weight <= 0:
        raise PlanError(f"{where}: final cumulative meterset weight is {final_weight:g}; the beam delivers no MU")
    return np.concatenate([[0.0], beam_mu * steps / final_weight])


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def _tenth(values: np.ndarray) -> np.ndarray:
    """Values rounded to 0.1 as read-only float32."""
    return _read_only((np.round(np.asarray(values, dtype=np.float64) * 10.0) / 10.0).astype(np.float32))


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class Arc:
    """One arc beam of a plan to write: its control points, MU (``beam_mu``, default the sum of
    ``mu[1:]``) and the gantry's turn ``gantry_direction`` ("CW" or "CC") from
    ``gantry_start_deg`` to ``gantry_stop_deg`` in equal steps; ``x_jaws`` (N, 2) [X1, X2] mm: ASYMX
    jaws at each control point (an MLC with X jaws only), None for none."""

    control_points: ControlPoints
    beam_mu: float | None = None
    gantry_start_deg: float = 181.0
    gantry_stop_deg: float = 179.0
    gantry_direction: str = "CW"
    x_jaws: np.ndarray | None = None


def write_plan(
    path: str | Path,
    control_points: ControlPoints,
    *,
    beam_mu: float | None = None,
    machine: str = "EPID",
    gantry_start_deg: float = 181.0,
    gantry_stop_deg: float = 179.0,
    gantry_direction: str = "CW",
    label: str = "EPID arc",
    mlc: MlcGeometry = LEGACY_GRID,
    x_jaws: np.ndarray | None = None,
) -> None:
    """Write ``control_points`` as a single-arc VMAT RT Plan (RT Plan Storage) to ``path``: beam 1,
    "ARC" (``write_arcs`` with one ``Arc`` of these settings; ``x_jaws`` default the control points' own)."""
    x_jaws = control_points.x_jaws if x_jaws is None else x_jaws
    write_arcs(path, [Arc(control_points, beam_mu, gantry_start_deg, gantry_stop_deg, gantry_direction, x_jaws)],
               machine=machine, label=label, mlc=mlc)


def write_arcs(path: str | Path, arcs: Sequence[Arc], *, machine: str = "EPID", label: str = "EPID arc",
               mlc: MlcGeometry = LEGACY_GRID) -> None:
    """Write ``arcs`` as a VMAT RT Plan (RT Plan Storage) of one beam per arc to ``path``.

    Beam k + 1 is arc k ("ARC" for a single arc, else "ARC 1", "ARC 2", ...), on ``mlc``
    (``MlcGeometry.leaves`` of the strips; the legacy grid written as Agility, whose central 52
    pairs are the strips, with the legacy grid's X jaws): an MLCX, or a dual-layer MLC's MLCX1 and MLCX2,
    ASYMY jaws where the MLC has Y jaws and ASYMX jaws where an arc has ``x_jaws``, at every control point. The
    cumulative meterset weight of control point k is the sum of ``mu[1..k]``; ``BeamMeterset`` is
    the arc's ``beam_mu`` (default that sum), so ``read_plan`` gives back ``mu[1:]`` scaled by
    beam_mu / sum. Positions are written in mm to 0.1, ``label`` is the RT Plan Label (at most 16
    characters).
    """
    if not arcs:
        raise ValueError("a plan needs at least one arc")
    if len(label) > 16:
        raise ValueError(f"label={label!r}: an RT Plan Label has at most 16 characters")
    written = MLC_GEOMETRIES["agility"] if mlc == LEGACY_GRID else mlc
    beams, meterset = [], []
    for number, arc in enumerate(arcs, start=1):
        if arc.gantry_direction not in ("CW", "CC"):
            raise ValueError(f"arc {number}: gantry_direction={arc.gantry_direction!r}: expected 'CW' or 'CC'")
        n = len(arc.control_points)
        if n < 2:
            raise ValueError(f"arc {number}: an arc needs at least 2 control points, got {n}")
        if arc.x_jaws is not None and (not mlc.x_jaws or np.shape(arc.x_jaws) != (n, 2)):
            raise ValueError(f"arc {number}: x_jaws of shape {np.shape(arc.x_jaws)}: expected ({n}, 2) on an MLC "
                             f"with X jaws ({mlc.name}: {'with' if mlc.x_jaws else 'without'})")
        mu_tenths = np.rint(np.asarray(arc.control_points.mu, dtype=np.float64) * 10).astype(np.int64)
        cumulative = np.concatenate([[0], np.cumsum(mu_tenths[1:])])
        if cumulative[-1] <= 0:
            raise ValueError(f"arc {number}: the arc delivers no MU (mu[1:] sums to 0)")
        meterset.append(cumulative[-1] / 10.0 if arc.beam_mu is None else float(arc.beam_mu))
        gantry = _gantry_angles(n, arc.gantry_start_deg, arc.gantry_stop_deg, arc.gantry_direction)
        beams.append(_arc_beam(arc.control_points, cumulative, machine, gantry, arc.gantry_direction, written,
                               number, "ARC" if len(arcs) == 1 else f"ARC {number}", arc.x_jaws))

    first = arcs[0].control_points
    dataset = new_dataset(RT_PLAN_STORAGE, "RTPLAN", f"{label}: dataset {first.dataset_id}")
    now = datetime.datetime.now()
    dataset.RTPlanLabel = label
    datasets = ", ".join(str(arc.control_points.dataset_id) for arc in arcs)
    dataset.RTPlanName = f"dataset{'s' if len(arcs) > 1 else ''} {datasets} ({first.pattern})"[:64]
    dataset.RTPlanDate = now.strftime("%Y%m%d")
    dataset.RTPlanTime = now.strftime("%H%M%S")
    dataset.RTPlanGeometry = "TREATMENT_DEVICE"
    dataset.PlanIntent = "VERIFICATION"
    setup = Dataset()
    setup.PatientSetupNumber = 1
    setup.PatientPosition = "HFS"
    dataset.PatientSetupSequence = DicomSequence([setup])
    dataset.FractionGroupSequence = DicomSequence([_fraction_group(meterset)])
    dataset.BeamSequence = DicomSequence(beams)
    _as_explicit_little_endian(dataset)
    save_dataset(path, dataset)


def _fraction_group(meterset: Sequence[float]) -> Dataset:
    """Fraction group 1: beam k + 1 delivers ``meterset[k]`` MU."""
    references = []
    for number, value in enumerate(meterset, start=1):
        reference = Dataset()
        reference.ReferencedBeamNumber = number
        reference.BeamMeterset = _decimal(value)
        references.append(reference)
    group = Dataset()
    group.FractionGroupNumber = 1
    group.NumberOfFractionsPlanned = 1
    group.NumberOfBeams = len(references)
    group.NumberOfBrachyApplicationSetups = 0
    group.ReferencedBeamSequence = DicomSequence(references)
    return group


def _decimal(value: float) -> str:
    """A decimal string of at most 16 characters (DS) for ``value``."""
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text if len(text) <= 16 else f"{value:.10g}"


def _gantry_angles(n: int, start: float, stop: float, direction: str) -> np.ndarray:
    """(n,) angles in [0, 360) from ``start`` to ``stop`` turning CW (increasing) or CC."""
    span = (stop - start) % 360.0 if direction == "CW" else -((start - stop) % 360.0)
    return np.round((start + span * np.arange(n) / (n - 1)) % 360.0, 4) % 360.0


def _tenths_text(tenths: np.ndarray) -> list[str]:
    """Positions given in whole tenths of a mm as decimal strings "-12.3"."""
    return [f"{'-' if value < 0 else ''}{abs(value) // 10}.{abs(value) % 10}" for value in tenths.tolist()]


def _written_layers(control_points: ControlPoints, mlc: MlcGeometry) -> list[np.ndarray]:
    """Per layer of ``mlc``, banks A and B (N, 2 x pairs) in whole tenths of a mm (``MlcGeometry.leaves``)."""
    layers = mlc.leaves(control_points.leaf_a, control_points.leaf_b)
    return [np.floor(np.concatenate([bank_a, bank_b], axis=-1) * TENTHS_PER_MM + ROUNDING_SLACK).astype(np.int64)
            for bank_a, bank_b in layers]


def _device(device_type: str, pairs: int, boundaries: np.ndarray | None = None) -> Dataset:
    device = Dataset()
    device.RTBeamLimitingDeviceType = device_type
    device.NumberOfLeafJawPairs = pairs
    if boundaries is not None:
        device.LeafPositionBoundaries = [f"{value:g}" for value in boundaries]
    return device


def _position(device_type: str, values: list[str]) -> Dataset:
    """A BeamLimitingDevicePositionSequence item. Its LeafJawPositions go in as the bytes of the
    file, a raw element (see ``_as_explicit_little_endian``): one Python object per value would
    make writing a long arc several times slower."""
    position = Dataset()
    position.RTBeamLimitingDeviceType = device_type
    text = "\\".join(values).encode("ascii")
    text += b" " * (len(text) % 2)
    position[LEAF_JAW_POSITIONS] = RawDataElement(LEAF_JAW_POSITIONS, "DS", len(text), text, 0, False, True)
    return position


def _as_explicit_little_endian(dataset: Dataset) -> None:
    """Mark ``dataset`` and every item in it as encoded in explicit VR little endian with the
    default character set, as ``save_dataset`` writes them, so that pydicom writes their raw
    elements as they are instead of decoding them first. Only for datasets built here, whose raw
    elements are in that encoding."""
    dataset.set_original_encoding(False, True, default_encoding)
    for element in dataset.elements():
        if element.VR == "SQ" and not element.is_raw:
            for item in element.value:
                _as_explicit_little_endian(item)


def _arc_beam(control_points: ControlPoints, cumulative: np.ndarray, machine: str, gantry: np.ndarray,
              direction: str, mlc: MlcGeometry, number: int, name: str, x_jaws: np.ndarray | None = None) -> Dataset:
    n = len(control_points)
    beam = Dataset()
    beam.BeamNumber = number
    beam.BeamName = name
    beam.BeamDescription = f"synthetic arc, dataset {control_points.dataset_id} ({control_points.pattern})"
    beam.BeamType = "DYNAMIC"
    beam.RadiationType = "PHOTON"
    beam.TreatmentMachineName = machine
    beam.PrimaryDosimeterUnit = "MU"
    beam.SourceAxisDistance = f"{SAD_MM:g}"
    names = [MLC_TYPE] if len(mlc.layers) == 1 else [f"{MLC_TYPE}{k + 1}" for k in range(len(mlc.layers))]
    jaws_device = ([_device("ASYMX", 1)] if x_jaws is not None else []) + ([_device("ASYMY", 1)] if mlc.y_jaws else [])
    beam.BeamLimitingDeviceSequence = DicomSequence(jaws_device + [
        _device(name, pairs, np.asarray(boundaries)) for name, pairs, boundaries in zip(names, mlc.pairs, mlc.layers,
                                                                                         strict=True)])
    beam.ReferencedPatientSetupNumber = 1
    beam.TreatmentDeliveryType = "TREATMENT"
    beam.NumberOfWedges = 0
    beam.NumberOfCompensators = 0
    beam.NumberOfBoli = 0
    beam.NumberOfBlocks = 0
    beam.FinalCumulativeMetersetWeight = _tenths_text(cumulative[-1:])[0]
    beam.NumberOfControlPoints = n
    layers = _written_layers(control_points, mlc)
    jaws = np.rint(np.stack([control_points.jaw_1, control_points.jaw_2], axis=1).astype(np.float64) * 10)
    jaws = jaws.astype(np.int64)
    x_tenths = None if x_jaws is None else np.rint(np.asarray(x_jaws, dtype=np.float64) * 10).astype(np.int64)
    weights = _tenths_text(cumulative)
    points = []
    for index in range(n):
        point = Dataset()
        point.ControlPointIndex = index
        point.CumulativeMetersetWeight = weights[index]
        point.BeamLimitingDevicePositionSequence = DicomSequence(
            ([_position("ASYMX", _tenths_text(x_tenths[index]))] if x_tenths is not None else [])
            + ([_position("ASYMY", _tenths_text(jaws[index]))] if mlc.y_jaws else [])
            + [_position(name, _tenths_text(layer[index])) for name, layer in zip(names, layers, strict=True)])
        point.GantryAngle = _decimal(gantry[index])
        point.GantryRotationDirection = direction if index < n - 1 else "NONE"
        if index == 0:
            _first_control_point(point)
        points.append(point)
    beam.ControlPointSequence = DicomSequence(points)
    return beam


def _first_control_point(point: Dataset) -> None:
    """The settings a first control point states once: energy, collimator, couch, isocentre."""
    point.NominalBeamEnergy = 6
    point.BeamLimitingDeviceAngle = 0
    point.BeamLimitingDeviceRotationDirection = "NONE"
    point.PatientSupportAngle = 0
    point.PatientSupportRotationDirection = "NONE"
    point.TableTopEccentricAngle = 0
    point.TableTopEccentricRotationDirection = "NONE"
    point.TableTopVerticalPosition = ""
    point.TableTopLongitudinalPosition = ""
    point.TableTopLateralPosition = ""
    point.IsocenterPosition = [0, 0, 0]
