"""DICOM RT Plans and RT Images: round trips, real MLC geometries, geometry of measured images,
the validator's verdict, and a one-line error for each kind of bad file."""

import dataclasses
import shutil
import subprocess
import warnings

import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence
from pydicom.uid import generate_uid

from epid.core.errors import InputError
from epid.dicom import files as files_module
from epid.dicom.files import save_dataset
from epid.dicom.image import RT_IMAGE_STORAGE, ImageError, read_frames, write_frames
from epid.dicom.plan import RT_PLAN_STORAGE, Arc, PlanError, read_plan, write_arcs, write_plan
from epid.evaluation import timeline
from epid.synthesis.frames import render_frames
from epid.synthesis.kernel import default_kernel
from epid.synthesis.sequences import generate_control_points, leaf_weights

ROUND_TRIP_IDS = (0, 100, 200)  # regular, semiregular, irregular
CONTROL_POINTS = 40
FIELDS = ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "leaf_weight")


# --------------------------------------------------------------------------- hand-built files


def tenths(values) -> list[str]:
    return [f"{value:.1f}" for value in np.asarray(values, dtype=np.float64).ravel()]


def hand_plan(boundaries, leaf_a, leaf_b, *, jaws_y=None, jaws_x=None, weights=None, beam_mu=250.0,
              y_type="ASYMY", x_type="ASYMX", mlc_type="MLCX") -> Dataset:
    """An RT Plan as a planning system might write it: one VMAT beam, leaves (N, pairs) of an MLC
    with ``boundaries``, optional jaws (N, 2), cumulative meterset weights from 0 to 1."""
    count, pairs = leaf_a.shape
    plan = Dataset()
    plan.SOPClassUID = RT_PLAN_STORAGE
    plan.SOPInstanceUID = generate_uid()
    plan.Modality = "RTPLAN"
    plan.RTPlanLabel = "hand"
    devices = []
    for device_type, count_of_pairs, present in ((x_type, 1, jaws_x is not None), (y_type, 1, jaws_y is not None),
                                                 (mlc_type, pairs, True)):
        if present:
            device = Dataset()
            device.RTBeamLimitingDeviceType = device_type
            device.NumberOfLeafJawPairs = count_of_pairs
            if device_type == mlc_type:
                device.LeafPositionBoundaries = [f"{b:g}" for b in boundaries]
            devices.append(device)
    if weights is None:
        weights = np.linspace(0.0, 1.0, count)
    points = []
    for index in range(count):
        point = Dataset()
        point.ControlPointIndex = index
        point.CumulativeMetersetWeight = f"{weights[index]:.6f}"
        point.GantryAngle = f"{(180.0 + 2 * index) % 360:g}"
        if index == 0:
            point.BeamLimitingDeviceAngle = "0"
        positions = []
        for device_type, values in ((x_type, jaws_x), (y_type, jaws_y)):
            if values is not None:
                position = Dataset()
                position.RTBeamLimitingDeviceType = device_type
                position.LeafJawPositions = tenths(values[index])
                positions.append(position)
        position = Dataset()
        position.RTBeamLimitingDeviceType = mlc_type
        position.LeafJawPositions = tenths(np.concatenate([leaf_a[index], leaf_b[index]]))
        positions.append(position)
        point.BeamLimitingDevicePositionSequence = Sequence(positions)
        points.append(point)
    beam = Dataset()
    beam.BeamNumber = 1
    beam.BeamName = "VMAT"
    beam.TreatmentMachineName = "LINAC"
    beam.TreatmentDeliveryType = "TREATMENT"
    beam.BeamLimitingDeviceSequence = Sequence(devices)
    beam.NumberOfControlPoints = count
    beam.FinalCumulativeMetersetWeight = f"{weights[-1]:.6f}"
    beam.ControlPointSequence = Sequence(points)
    plan.BeamSequence = Sequence([beam])
    reference = Dataset()
    reference.ReferencedBeamNumber = 1
    reference.BeamMeterset = f"{beam_mu:g}"
    group = Dataset()
    group.FractionGroupNumber = 1
    group.ReferencedBeamSequence = Sequence([reference])
    plan.FractionGroupSequence = Sequence([group])
    return plan


def random_leaves(rng, count, pairs):
    leaf_a = rng.integers(-1000, 1, size=(count, pairs)) / 10
    leaf_b = rng.integers(0, 1001, size=(count, pairs)) / 10
    return leaf_a, leaf_b


def agility_boundaries():
    return np.linspace(-200, 200, 81)


def millennium_boundaries():
    return np.concatenate([np.arange(-200, -100, 10), np.arange(-100, 100, 5), np.arange(100, 201, 10)])


def hd120_boundaries():
    return np.concatenate([np.arange(-110, -40, 5), np.arange(-40, 40, 2.5), np.arange(40, 111, 5)])


def saved(tmp_path, dataset, name="plan.dcm"):
    path = tmp_path / name
    save_dataset(path, dataset)
    return path


def assert_one_line(error, *parts):
    message = str(error.value)
    assert isinstance(error.value, InputError)
    assert "\n" not in message
    for part in parts:
        assert part in message, (part, message)


# --------------------------------------------------------------------------- synthetic arcs


@pytest.mark.parametrize("dataset_id", ROUND_TRIP_IDS)
def test_synthetic_arc_round_trips_through_an_rt_plan(tmp_path, dataset_id):
    arc = generate_control_points(dataset_id, CONTROL_POINTS)
    path = tmp_path / "arc.dcm"
    write_plan(path, arc, machine="Agility")
    (beam,) = read_plan(path, dataset_id=dataset_id)
    read = beam.control_points
    assert len(read) == CONTROL_POINTS and read.dataset_id == dataset_id and read.pattern == "plan"
    for name in FIELDS:
        np.testing.assert_allclose(getattr(read, name), getattr(arc, name), atol=1e-4, err_msg=name)
    np.testing.assert_allclose(read.mu[1:], arc.mu[1:], atol=1e-4)
    assert read.mu[0] == 0
    assert beam.beam_number == 1 and beam.machine == "Agility" and beam.mlc == "MLCX (agility) 80 leaf pairs: 80 x 5 mm"
    assert beam.beam_mu == pytest.approx(float(np.sum(arc.mu[1:])), abs=0.05)
    assert beam.collimator_deg == 0
    turned = np.unwrap(np.radians(beam.gantry_deg))
    assert np.degrees(turned[0]) == pytest.approx(181) and np.degrees(turned[-1] - turned[0]) == pytest.approx(358)
    assert np.all(np.diff(turned) > 0)  # clockwise


def test_pymedphys_reads_the_same_mu_jaws_and_leaves(tmp_path):
    pymedphys = pytest.importorskip("pymedphys")
    arc = generate_control_points(200, CONTROL_POINTS)
    path = tmp_path / "arc.dcm"
    write_plan(path, arc)
    delivery = pymedphys.Delivery.from_dicom(path)
    np.testing.assert_allclose(delivery.monitor_units, np.concatenate([[0], np.cumsum(arc.mu[1:])]), atol=1e-3)
    jaw = np.asarray(delivery.jaw)  # pymedphys: [y2, -y1]
    np.testing.assert_allclose(jaw[:, 0], arc.jaw_2, atol=1e-4)
    np.testing.assert_allclose(-jaw[:, 1], arc.jaw_1, atol=1e-4)
    mlc = np.asarray(delivery.mlc)[:, ::-1]  # pymedphys: (N, pairs from the top, [bank B, -bank A])
    np.testing.assert_allclose(mlc[:, 14:66, 0], arc.leaf_b, atol=1e-4)
    np.testing.assert_allclose(-mlc[:, 14:66, 1], arc.leaf_a, atol=1e-4)


@pytest.mark.parametrize("name", ["millennium120", "mlci2"])
def test_pymedphys_reads_an_arc_written_on_a_clinical_mlcs_own_leaves(tmp_path, name):
    pymedphys = pytest.importorskip("pymedphys")
    from epid.synthesis.mlc import MLC_GEOMETRIES

    geometry = MLC_GEOMETRIES[name]
    arc = dataclasses.replace(generate_control_points(300, CONTROL_POINTS, geometry), x_jaws=None)  # MLCX, ASYMY only
    path = tmp_path / f"{name}.dcm"
    write_plan(path, arc, mlc=geometry)
    mlc = np.asarray(pymedphys.Delivery.from_dicom(path).mlc)[:, ::-1]
    assert mlc.shape[1] == geometry.pairs[0]
    leaf = geometry.strip_leaves[0]  # the leaf over each strip: the strip's edges are that leaf's position
    np.testing.assert_allclose(mlc[:, leaf, 0], arc.leaf_b, atol=1e-4)
    np.testing.assert_allclose(-mlc[:, leaf, 1], arc.leaf_a, atol=1e-4)


def test_beam_mu_scales_the_frames_mu(tmp_path):
    arc = generate_control_points(100, 10)
    path = tmp_path / "arc.dcm"
    write_plan(path, arc, beam_mu=2 * float(np.sum(arc.mu[1:])), gantry_start_deg=30, gantry_stop_deg=330,
               gantry_direction="CC")
    (beam,) = read_plan(path)
    np.testing.assert_allclose(beam.control_points.mu[1:], 2 * arc.mu[1:], atol=1e-3)
    turned = np.degrees(np.unwrap(np.radians(beam.gantry_deg)))
    assert turned[0] == pytest.approx(30) and turned[-1] - turned[0] == pytest.approx(-60)


def test_two_arcs_are_written_as_two_beams_each_read_back_as_it_was(tmp_path):
    """A two-arc plan: arc 1 clockwise with its own MU, arc 2 counter-clockwise back with 150 MU;
    each beam's number, name, MU, angles and positions come back; pymedphys reads each beam."""
    first, second = generate_control_points(100, 12), generate_control_points(300, CONTROL_POINTS)
    path = tmp_path / "two_arcs.dcm"
    write_arcs(path, [Arc(first), Arc(second, 150.0, 179.0, 181.0, "CC")], label="two arcs")
    beams = read_plan(path)
    assert [(beam.beam_number, beam.beam_name) for beam in beams] == [(1, "ARC 1"), (2, "ARC 2")]
    assert beams[0].beam_mu == pytest.approx(float(np.sum(first.mu[1:])), abs=0.05) and beams[1].beam_mu == 150.0
    for beam, arc, (start, span) in zip(beams, (first, second), ((181.0, 358.0), (179.0, -358.0)), strict=True):
        for field in ("leaf_a", "leaf_b", "jaw_1", "jaw_2"):
            np.testing.assert_allclose(getattr(beam.control_points, field), getattr(arc, field), atol=1e-4)
        turned = np.degrees(np.unwrap(np.radians(beam.gantry_deg.astype(np.float64))))
        assert turned[0] == pytest.approx(start) and turned[-1] - turned[0] == pytest.approx(span)
    np.testing.assert_allclose(beams[1].control_points.mu[1:], 150.0 * second.mu[1:] / np.sum(second.mu[1:]),
                               atol=1e-3)
    assert read_plan(path, 2)[0].beam_name == "ARC 2"
    pymedphys = pytest.importorskip("pymedphys")
    delivery = pymedphys.Delivery.from_dicom(path)  # the plan's beams one after the other
    mlc = np.asarray(delivery.mlc)[:, ::-1]
    np.testing.assert_allclose(mlc[:, 14:66, 0], np.concatenate([first.leaf_b, second.leaf_b]), atol=1e-4)
    np.testing.assert_allclose(np.diff(delivery.monitor_units)[len(first):].sum(), 150.0, atol=1e-3)


# --------------------------------------------------------------------------- real MLC geometries


def test_agility_like_plan_takes_the_central_52_pairs_and_folds_x_jaws(tmp_path):
    rng = np.random.default_rng(1)
    count = 6
    leaf_a, leaf_b = random_leaves(rng, count, 80)
    jaws_y = np.array([[-140.0, 135.0]] * 3 + [[-20.0, 30.5]] * 3)
    jaws_x = np.array([[-50.0, 60.0]] * count)
    weights = np.concatenate([[0.0], np.cumsum(rng.random(count - 1))])
    path = saved(tmp_path, hand_plan(agility_boundaries(), leaf_a, leaf_b, jaws_y=jaws_y, jaws_x=jaws_x,
                                     weights=weights / weights[-1], beam_mu=250.0))
    (beam,) = read_plan(path)
    read = beam.control_points
    rows = np.arange(14, 66)
    expected_a = np.clip(leaf_a[:, rows], -50, 60)
    expected_b = np.maximum(np.clip(leaf_b[:, rows], -50, 60), expected_a)
    np.testing.assert_allclose(read.leaf_a, expected_a, atol=1e-4)
    np.testing.assert_allclose(read.leaf_b, expected_b, atol=1e-4)
    np.testing.assert_allclose(read.jaw_1, np.maximum(jaws_y[:, 0], -130), atol=1e-4)
    np.testing.assert_allclose(read.jaw_2, np.minimum(jaws_y[:, 1], 130), atol=1e-4)
    written = np.array([float(f"{w:.6f}") for w in weights / weights[-1]])
    np.testing.assert_allclose(read.mu, np.concatenate([[0], 250 * np.diff(written)]), rtol=1e-6, atol=1e-5)  # exact
    np.testing.assert_array_equal(read.leaf_weight, leaf_weights(read.jaw_1, read.jaw_2))
    assert beam.machine == "LINAC" and beam.beam_name == "VMAT" and beam.beam_mu == 250


def test_millennium_like_plan_maps_5_mm_leaves_one_to_one_and_10_mm_leaves_to_two_rows(tmp_path):
    rng = np.random.default_rng(2)
    count = 4
    leaf_a, leaf_b = random_leaves(rng, count, 60)
    jaws_x = np.array([[-70.0, 80.0], [-70.0, 80.0], [-30.0, 20.0], [-30.0, 20.0]])
    path = saved(tmp_path, hand_plan(millennium_boundaries(), leaf_a, leaf_b, jaws_y=np.array([[-100.0, 100.0]] * 4),
                                     jaws_x=jaws_x, x_type="X", y_type="Y"))
    (beam,) = read_plan(path)
    rows = np.array([7, 7, 8, 8, 9, 9, *range(10, 50), 50, 50, 51, 51, 52, 52])
    expected_a = np.clip(leaf_a[:, rows], jaws_x[:, :1], jaws_x[:, 1:])
    expected_b = np.maximum(np.clip(leaf_b[:, rows], jaws_x[:, :1], jaws_x[:, 1:]), expected_a)
    np.testing.assert_allclose(beam.control_points.leaf_a, expected_a, atol=1e-4)
    np.testing.assert_allclose(beam.control_points.leaf_b, expected_b, atol=1e-4)
    assert beam.mlc == "MLCX (millennium120) 60 leaf pairs: 10 x 10 mm, 40 x 5 mm, 10 x 10 mm"
    # the X jaws kept, and which of them hides each leaf (its planned position at or behind the jaw)
    np.testing.assert_array_equal(beam.x_jaws, jaws_x)
    hidden = beam.behind_x_jaws()
    for bank, planned in enumerate((leaf_a[:, rows], leaf_b[:, rows])):
        np.testing.assert_array_equal(hidden[bank], np.where(planned <= jaws_x[:, :1], 1,
                                                             np.where(planned >= jaws_x[:, 1:], 2, 0)))
    assert 0 < (hidden > 0).mean() < 1
    # on a timeline whose control point 1 lies halfway between the plan's 1 and 2, the X jaws lie halfway too
    cumulative = timeline.cumulative_mu(beam)
    resampled = timeline.resample(beam, np.array([0.0, (cumulative[1] + cumulative[2]) / 2, cumulative[-1]]))
    np.testing.assert_allclose(resampled.x_jaws, [jaws_x[0], [-50.0, 50.0], jaws_x[-1]], atol=1e-4)
    # and the forward model is given them: [X1, X2] at each piece's start and end after the Y jaws
    _, _, scalars = timeline.piece_inputs(beam, cumulative[[1, 2]], cumulative[[2, 3]])
    np.testing.assert_allclose(scalars[:, 5:].numpy(), [[-70.0, -30.0, 80.0, 20.0], [-30.0, -30.0, 20.0, 20.0]])
    assert read_plan(saved(tmp_path, hand_plan(millennium_boundaries(), leaf_a, leaf_b),
                           "no_jaws.dcm"))[0].behind_x_jaws() is None


def test_hd120_plan_maps_each_2_5_mm_leaf_to_a_fine_strip_and_is_written_back(tmp_path):
    """HD120 on the 104 strips of 2.5 mm: a 2.5 mm leaf is one strip, a 5 mm leaf two, the strips
    beyond its leaves (|y| > 110 mm) open; written and read back unchanged, pymedphys reads it."""
    from epid.synthesis.mlc import MLC_GEOMETRIES

    leaf_a, leaf_b = random_leaves(np.random.default_rng(3), 3, 60)
    path = saved(tmp_path, hand_plan(hd120_boundaries(), leaf_a, leaf_b, jaws_y=np.array([[-50.0, 50.0]] * 3)))
    (beam,) = read_plan(path)
    assert beam.geometry is MLC_GEOMETRIES["hd120"]
    assert beam.mlc == "MLCX (hd120) 60 leaf pairs: 14 x 5 mm, 32 x 2.5 mm, 14 x 5 mm"
    strips = np.concatenate([np.repeat(np.arange(14), 2), np.arange(14, 46), np.repeat(np.arange(46, 60), 2)])
    inside = slice(8, 96)  # y in [-110, 110) mm
    np.testing.assert_allclose(beam.control_points.leaf_a[:, inside], leaf_a[:, strips], atol=1e-4)
    np.testing.assert_allclose(beam.control_points.leaf_b[:, inside], leaf_b[:, strips], atol=1e-4)
    assert np.all(beam.control_points.leaf_a[:, :8] == -200) and np.all(beam.control_points.leaf_b[:, 96:] == 200)
    assert beam.control_points.leaf_weight.shape == (3, 104) and np.all(beam.control_points.leaf_weight[:, :8] == 0)
    written = tmp_path / "written.dcm"
    write_plan(written, beam.control_points, mlc=beam.geometry)
    (again,) = read_plan(written)
    np.testing.assert_array_equal(again.control_points.leaf_a, beam.control_points.leaf_a)
    np.testing.assert_array_equal(again.control_points.leaf_b, beam.control_points.leaf_b)
    pymedphys = pytest.importorskip("pymedphys")
    mlc = np.asarray(pymedphys.Delivery.from_dicom(written).mlc)[:, ::-1]
    np.testing.assert_allclose(-mlc[:, strips, 1], beam.control_points.leaf_a[:, inside], atol=1e-4)


def test_an_mlc_finer_than_every_strip_grid_is_refused_naming_the_device_and_its_boundaries(tmp_path):
    boundaries = np.concatenate([np.arange(-100, -20, 5), np.arange(-20, 20, 1.25), np.arange(20, 101, 5)])
    leaf_a, leaf_b = random_leaves(np.random.default_rng(3), 3, len(boundaries) - 1)
    path = saved(tmp_path, hand_plan(boundaries, leaf_a, leaf_b, jaws_y=np.array([[-50.0, 50.0]] * 3)))
    with pytest.raises(PlanError) as error:
        read_plan(path)
    assert_one_line(error, str(path), "beam 1", "unsupported MLC", "MLCX", "32 x 1.25 mm",
                    "finer than the models' 2.5 mm strips", "-18.75")


def test_mlci2_plan_maps_each_10_mm_leaf_to_two_rows(tmp_path):
    leaf_a, leaf_b = random_leaves(np.random.default_rng(4), 3, 40)
    path = saved(tmp_path, hand_plan(np.linspace(-200, 200, 41), leaf_a, leaf_b, jaws_y=np.array([[-60.0, 60.0]] * 3)))
    (beam,) = read_plan(path)
    rows = np.repeat(np.arange(7, 33), 2)  # rows over [-130, 130): leaves 7..32, two 5 mm rows each
    np.testing.assert_allclose(beam.control_points.leaf_a, leaf_a[:, rows], atol=1e-4)
    assert beam.mlc == "MLCX (mlci2) 40 leaf pairs: 40 x 10 mm"


def halcyon_plan(rng, count, proximal_first=True):
    """A Halcyon plan (no jaws): distal MLCX1 28 x 10 mm over [-140, 140], proximal MLCX2 29 x 10 mm
    over [-145, 145], random leaves; the layers' devices in either order. Returns the plan and
    each layer's (boundaries, leaf_a, leaf_b)."""
    layers = {"MLCX1": np.linspace(-140, 140, 29), "MLCX2": np.linspace(-145, 145, 30)}
    leaves = {name: random_leaves(rng, count, len(edges) - 1) for name, edges in layers.items()}
    order = ["MLCX2", "MLCX1"] if proximal_first else ["MLCX1", "MLCX2"]
    first = order[0]
    plan = hand_plan(layers[first], *leaves[first], mlc_type=first)
    beam = plan.BeamSequence[0]
    second = order[1]
    device = Dataset()
    device.RTBeamLimitingDeviceType = second
    device.NumberOfLeafJawPairs = len(layers[second]) - 1
    device.LeafPositionBoundaries = [f"{b:g}" for b in layers[second]]
    beam.BeamLimitingDeviceSequence.append(device)
    for index, point in enumerate(beam.ControlPointSequence):
        position = Dataset()
        position.RTBeamLimitingDeviceType = second
        position.LeafJawPositions = tenths(np.concatenate([leaves[second][0][index], leaves[second][1][index]]))
        point.BeamLimitingDevicePositionSequence.append(position)
    return plan, {name: (layers[name], *leaves[name]) for name in layers}


@pytest.mark.parametrize("proximal_first", [True, False])
def test_halcyon_plan_gives_each_strip_the_edges_where_both_layers_are_open(tmp_path, proximal_first):
    count = 3
    plan, layers = halcyon_plan(np.random.default_rng(5), count, proximal_first)
    (beam,) = read_plan(saved(tmp_path, plan))
    assert beam.geometry.name == "halcyon"
    assert beam.mlc == "halcyon: MLCX1 28 leaf pairs: 28 x 10 mm; MLCX2 29 leaf pairs: 29 x 10 mm"
    expected = np.zeros((2, count, 52))
    for strip in range(52):  # independent: the leaf of each layer over the strip's centre
        centre = -127.5 + 5 * strip
        edges = []
        for boundaries, leaf_a, leaf_b in layers.values():
            leaf = next(k for k in range(len(boundaries) - 1) if boundaries[k] < centre < boundaries[k + 1])
            edges.append((leaf_a[:, leaf], leaf_b[:, leaf]))
        expected[0, :, strip] = np.maximum(edges[0][0], edges[1][0])
        expected[1, :, strip] = np.maximum(np.minimum(edges[0][1], edges[1][1]), expected[0, :, strip])
    np.testing.assert_allclose(beam.control_points.leaf_a, expected[0], atol=1e-4)
    np.testing.assert_allclose(beam.control_points.leaf_b, expected[1], atol=1e-4)
    np.testing.assert_allclose(beam.control_points.jaw_1, -130.0)  # no jaws: the strips' whole span open
    np.testing.assert_allclose(beam.control_points.jaw_2, 130.0)


def test_positions_a_control_point_omits_carry_over(tmp_path):
    rng = np.random.default_rng(4)
    leaf_a, leaf_b = random_leaves(rng, 4, 80)
    jaws_y = np.array([[-60.0, 70.0], [-50.0, 65.0], [-40.0, 60.0], [-30.0, 55.0]])
    plan = hand_plan(agility_boundaries(), leaf_a, leaf_b, jaws_y=jaws_y)
    points = plan.BeamSequence[0].ControlPointSequence
    del points[1].BeamLimitingDevicePositionSequence[0]  # CP 1: MLC only
    del points[2].BeamLimitingDevicePositionSequence  # CP 2: nothing
    del points[3].BeamLimitingDevicePositionSequence[1]  # CP 3: jaws only
    for point in points[1:]:
        del point.GantryAngle
    (beam,) = read_plan(saved(tmp_path, plan))
    read = beam.control_points
    np.testing.assert_allclose(read.jaw_1, [-60, -60, -60, -30], atol=1e-4)
    np.testing.assert_allclose(read.jaw_2, [70, 70, 70, 55], atol=1e-4)
    rows = np.arange(14, 66)
    np.testing.assert_allclose(read.leaf_a, leaf_a[[0, 1, 1, 1]][:, rows], atol=1e-4)
    np.testing.assert_allclose(read.leaf_b, leaf_b[[0, 1, 1, 1]][:, rows], atol=1e-4)
    np.testing.assert_allclose(beam.gantry_deg, [180, 180, 180, 180])


@pytest.mark.parametrize("system", ["raystation", "pinnacle"])
def test_raystation_and_pinnacle_shaped_plans_read_as_their_positions_say(tmp_path, system, monkeypatch):
    """RayStation: every device at every control point, positions with four decimals (and -0.0000),
    a dose rate and a rotation direction at each point, the manufacturer named. Pinnacle: symmetric
    X / Y jaw types, the MLC first in every sequence, cumulative meterset weights in MU (the final
    one 250, not 1), a bare data set (implicit VR, no preamble)."""
    monkeypatch.setattr(files_module, "_PREAMBLE_NOTED", [])
    rng = np.random.default_rng(9)
    count = 5
    leaf_a, leaf_b = random_leaves(rng, count, 80)
    leaf_a[:, 40] = 0.0
    jaws_y = np.array([[-45.0, 45.0]] * count) if system == "pinnacle" else np.array([[-61.3, 47.5]] * count)
    jaws_x = np.array([[-70.0, 70.0]] * count)
    weights = np.concatenate([[0.0], np.cumsum(rng.random(count - 1))])
    weights = weights / weights[-1] * (250.0 if system == "pinnacle" else 1.0)
    plan = hand_plan(agility_boundaries(), leaf_a, leaf_b, jaws_y=jaws_y, jaws_x=jaws_x, weights=weights,
                     x_type="X" if system == "pinnacle" else "ASYMX", y_type="Y" if system == "pinnacle" else "ASYMY")
    beam = plan.BeamSequence[0]
    if system == "raystation":
        plan.Manufacturer = "RaySearch Laboratories"
        for index, point in enumerate(beam.ControlPointSequence):
            point.DoseRateSet = "600"
            point.GantryRotationDirection = "CW" if index < count - 1 else "NONE"
            values = {"ASYMX": jaws_x[index], "ASYMY": jaws_y[index],
                      "MLCX": np.concatenate([leaf_a[index], leaf_b[index]])}
            for position in point.BeamLimitingDevicePositionSequence:
                position.LeafJawPositions = ["-0.0000" if v == 0 else f"{v:.4f}"
                                             for v in values[position.RTBeamLimitingDeviceType]]
        path = saved(tmp_path, plan)
    else:
        plan.Manufacturer = "Philips Radiation Oncology Systems"
        beam.BeamLimitingDeviceSequence = Sequence(list(beam.BeamLimitingDeviceSequence)[::-1])
        for point in beam.ControlPointSequence:
            point.BeamLimitingDevicePositionSequence = Sequence(list(point.BeamLimitingDevicePositionSequence)[::-1])
        path = tmp_path / "pinnacle.dcm"
        plan.save_as(path, implicit_vr=True, little_endian=True, enforce_file_format=False)
    (read,) = read_plan(path)
    points = read.control_points
    rows = np.arange(14, 66)
    expected_a = np.clip(leaf_a[:, rows], -70, 70)
    np.testing.assert_allclose(points.leaf_a, expected_a, atol=1e-4)
    np.testing.assert_allclose(points.leaf_b, np.maximum(np.clip(leaf_b[:, rows], -70, 70), expected_a), atol=1e-4)
    np.testing.assert_allclose(points.jaw_1, jaws_y[:, 0], atol=1e-4)
    np.testing.assert_allclose(points.jaw_2, jaws_y[:, 1], atol=1e-4)
    written = np.array([float(f"{w:.6f}") for w in weights])
    np.testing.assert_allclose(points.mu, np.concatenate([[0], 250 * np.diff(written) / written[-1]]), rtol=1e-6)
    assert read.beam_mu == 250 and np.all(np.isfinite(points.leaf_a))


# --------------------------------------------------------------------------- bad plans


def good_plan():
    leaf_a, leaf_b = random_leaves(np.random.default_rng(5), 3, 80)
    return hand_plan(agility_boundaries(), leaf_a, leaf_b, jaws_y=np.array([[-50.0, 50.0]] * 3))


def no_control_points(plan):
    plan.BeamSequence[0].ControlPointSequence = Sequence([])


def no_mlc(plan):
    beam = plan.BeamSequence[0]
    beam.BeamLimitingDeviceSequence = Sequence([d for d in beam.BeamLimitingDeviceSequence
                                                if d.RTBeamLimitingDeviceType != "MLCX"])


def mlcy(plan):
    for device in plan.BeamSequence[0].BeamLimitingDeviceSequence:
        if device.RTBeamLimitingDeviceType == "MLCX":
            device.RTBeamLimitingDeviceType = "MLCY"


def short_positions(plan):
    position = plan.BeamSequence[0].ControlPointSequence[1].BeamLimitingDevicePositionSequence[1]
    position.LeafJawPositions = position.LeafJawPositions[:-2]


def pairs_against_boundaries(plan):
    plan.BeamSequence[0].BeamLimitingDeviceSequence[1].NumberOfLeafJawPairs = 60


def decreasing_weight(plan):
    plan.BeamSequence[0].ControlPointSequence[2].CumulativeMetersetWeight = "0.2"


def no_meterset(plan):
    del plan.FractionGroupSequence[0].ReferencedBeamSequence[0].BeamMeterset


def mlc_position(plan, index):
    return plan.BeamSequence[0].ControlPointSequence[index].BeamLimitingDevicePositionSequence[-1]


def zero_meterset(plan):
    plan.FractionGroupSequence[0].ReferencedBeamSequence[0].BeamMeterset = "0"


def negative_meterset(plan):
    plan.FractionGroupSequence[0].ReferencedBeamSequence[0].BeamMeterset = "-120"


def no_mu_delivered(plan):
    for point in plan.BeamSequence[0].ControlPointSequence:
        point.CumulativeMetersetWeight = "0"
    plan.BeamSequence[0].FinalCumulativeMetersetWeight = "0"


def crossed_leaves(plan):
    position = mlc_position(plan, 1)
    values = [float(v) for v in position.LeafJawPositions]
    values[20], values[100] = 12.0, 3.5  # pair 21: bank A at 12 mm, bank B at 3.5 mm
    position.LeafJawPositions = tenths(values)


def leaf_far_out(plan):
    position = mlc_position(plan, 2)
    values = [float(v) for v in position.LeafJawPositions]
    values[5] = -5000.0
    position.LeafJawPositions = tenths(values)


def leaf_not_a_number(plan):
    position = mlc_position(plan, 1)
    values = [str(v) for v in position.LeafJawPositions]
    values[90] = "NaN"  # not a valid DS, as some exports write it anyway
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        position.LeafJawPositions = values


def collimator_turns(plan):
    plan.BeamSequence[0].ControlPointSequence[2].BeamLimitingDeviceAngle = "15"


@pytest.mark.parametrize(("spoil", "problem"), [
    (zero_meterset, "BeamMeterset 0 (expected a positive number of MU)"),
    (negative_meterset, "BeamMeterset -120 (expected a positive number of MU)"),
    (no_mu_delivered, "final cumulative meterset weight is 0"),
    (crossed_leaves, "control point 1: leaf pair 21 crossed: bank A at 12 mm is past bank B at 3.5 mm"),
    (leaf_far_out, "control point 2: leaf pair 6 bank A at -5000 mm (expected finite, within +-200 mm)"),
    (leaf_not_a_number, "control point 1: leaf pair 11 bank B at nan mm"),
    (collimator_turns, "control point 2: collimator angle 15 deg after 0 deg"),
    (no_control_points, "no control points"),
    (no_mlc, "no MLC"),
    (mlcy, "unsupported MLC MLCY"),
    (short_positions, "inconsistent leaf counts: control point 1 gives 158 MLCX positions"),
    (pairs_against_boundaries, "inconsistent leaf counts: MLCX has 60 leaf pairs but 81 LeafPositionBoundaries"),
    (decreasing_weight, "CumulativeMetersetWeight decreases at control point 2"),
    (no_meterset, "no BeamMeterset"),
])
def test_bad_beams_give_one_line_naming_file_beam_and_problem(tmp_path, spoil, problem):
    plan = good_plan()
    spoil(plan)
    path = saved(tmp_path, plan)
    with pytest.raises(PlanError) as error:
        read_plan(path, beam=1)
    assert_one_line(error, str(path), "beam 1 (VMAT)", problem)


def test_a_plan_without_preamble_or_file_meta_is_read_and_said_so_once(tmp_path, capsys, monkeypatch):
    """Monaco writes plans as a bare data set: no 128-byte preamble, no file meta, implicit VR."""
    monkeypatch.setattr(files_module, "_PREAMBLE_NOTED", [])
    with_preamble = saved(tmp_path, good_plan(), "with.dcm")
    bare = []
    for name in ("bare.dcm", "bare2.dcm"):
        path = tmp_path / name
        good_plan().save_as(path, implicit_vr=True, little_endian=True, enforce_file_format=False)
        assert path.read_bytes()[128:132] != b"DICM"
        bare.append(path)
    (expected,) = read_plan(with_preamble)
    for path in bare:
        (read,) = read_plan(path)
        for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "mu"):
            np.testing.assert_array_equal(getattr(read.control_points, name), getattr(expected.control_points, name))
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and str(bare[0]) in notes[0] and "no DICOM preamble" in notes[0]


def test_unknown_beam_lists_the_beams_there(tmp_path):
    path = saved(tmp_path, good_plan())
    with pytest.raises(PlanError) as error:
        read_plan(path, beam=7)
    assert_one_line(error, str(path), "no beam 7", "1 (VMAT, TREATMENT, 3 control points)")


def test_bad_files_give_one_line(tmp_path):
    text = tmp_path / "notes.dcm"
    text.write_text("not a plan\n")
    with pytest.raises(PlanError) as error:
        read_plan(text)
    assert_one_line(error, str(text), "not a DICOM file")
    whole = saved(tmp_path, good_plan())
    truncated = tmp_path / "truncated.dcm"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(PlanError) as error:
        read_plan(truncated)
    assert_one_line(error, str(truncated), "truncated")
    image = tmp_path / "image.dcm"
    write_frames(image, np.zeros((1, 256, 256)))
    with pytest.raises(PlanError) as error:
        read_plan(image)
    assert_one_line(error, str(image), "not an RT Plan", RT_IMAGE_STORAGE)


# --------------------------------------------------------------------------- RT Images


def test_frames_round_trip_through_a_multi_frame_rt_image(tmp_path):
    arc = generate_control_points(200, 8)
    predicted = render_frames(arc, [1, 2, 3, 4, 5], default_kernel(), dataset_id=200)
    frames = predicted.numpy()
    plan, path = tmp_path / "arc.dcm", tmp_path / "frames.dcm"
    write_plan(plan, arc)
    write_frames(path, predicted, control_point_index=[5, 1, 2, 3, 4], plan_path=plan)
    read = read_frames(path)
    np.testing.assert_array_equal(read.control_point_index, [1, 2, 3, 4, 5])
    step = (frames.max() - min(0.0, frames.min())) / 65535
    assert np.abs(read.frames - frames[[1, 2, 3, 4, 0]]).max() <= step / 2 + 1e-6 * frames.max()
    assert read.sid_mm == 1000 and read.frames.dtype == np.float32
    image, reference = pydicom.dcmread(path), pydicom.dcmread(plan)
    assert image.ReferencedRTPlanSequence[0].ReferencedSOPInstanceUID == reference.SOPInstanceUID
    assert image.ReferencedBeamNumber == 1 and image.StudyInstanceUID == reference.StudyInstanceUID


def test_single_frame_files_are_sorted_by_their_control_point(tmp_path):
    frames = np.stack([np.full((256, 256), value) for value in (3.0, 1.0, 2.0)])
    paths = []
    for index, frame in zip((30, 10, 20), frames, strict=True):
        paths.append(tmp_path / f"frame_{index}.dcm")
        write_frames(paths[-1], frame[None], control_point_index=[index])
    read = read_frames(paths)
    np.testing.assert_array_equal(read.control_point_index, [10, 20, 30])
    np.testing.assert_allclose(read.frames[:, 128, 128], [1.0, 2.0, 3.0], atol=1e-4)
    with pytest.raises(ImageError) as error:
        read_frames([paths[0], paths[0]])
    assert_one_line(error, str(paths[0]), "control point 30")


def field_image(x_mm, y_mm, *, rows=768, columns=1024, pitch_mm=0.392, sid_mm=1600.0, collimator_deg=0.0,
                control_points=(1,)) -> Dataset:
    """A measured-like RT Image (frames of uint16) of a rectangular field x_mm x y_mm (collimator
    frame, isocentre; collimator turned by a multiple of 90 degrees), each pixel the share of its
    area inside the field x 1000."""
    scale = sid_mm / 1000.0
    first = (-(columns - 1) / 2 * pitch_mm, (rows - 1) / 2 * pitch_mm)
    centres_x = first[0] + np.arange(columns) * pitch_mm
    centres_y = first[1] - np.arange(rows) * pitch_mm
    # receptor axes = gantry axes; the collimator turns the rectangle counterclockwise (seen from the
    # source) by a multiple of 90 degrees, which keeps it a rectangle
    cos, sin = np.rint(np.cos(np.radians(collimator_deg))), np.rint(np.sin(np.radians(collimator_deg)))
    corners = np.array([(x, y) for x in x_mm for y in y_mm])
    turned = np.stack([cos * corners[:, 0] - sin * corners[:, 1], sin * corners[:, 0] + cos * corners[:, 1]], 1)
    x_mm, y_mm = (turned[:, 0].min(), turned[:, 0].max()), (turned[:, 1].min(), turned[:, 1].max())

    def share(centres, edges):
        low = np.maximum(centres - pitch_mm / 2, edges[0] * scale)
        high = np.minimum(centres + pitch_mm / 2, edges[1] * scale)
        return np.clip(high - low, 0, None) / pitch_mm

    image = np.rint(1000 * np.outer(share(centres_y, y_mm), share(centres_x, x_mm))).astype(np.uint16)
    dataset = Dataset()
    dataset.SOPClassUID = RT_IMAGE_STORAGE
    dataset.SOPInstanceUID = generate_uid()
    dataset.Modality = "RTIMAGE"
    dataset.SamplesPerPixel = 1
    dataset.PhotometricInterpretation = "MONOCHROME2"
    dataset.Rows, dataset.Columns = rows, columns
    dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit, dataset.PixelRepresentation = 16, 16, 15, 0
    dataset.RTImagePlane = "NORMAL"
    dataset.ImagePlanePixelSpacing = [f"{pitch_mm:g}", f"{pitch_mm:g}"]
    dataset.RTImagePosition = [f"{first[0]:.4f}", f"{first[1]:.4f}"]
    dataset.RTImageSID = f"{sid_mm:g}"
    dataset.RadiationMachineSAD = "1000"
    dataset.BeamLimitingDeviceAngle = f"{collimator_deg:g}"
    dataset.XRayImageReceptorAngle = "0"
    dataset.NumberOfFrames = len(control_points)
    items = []
    for frame, index in enumerate(control_points, start=1):
        item = Dataset()
        if len(control_points) > 1:
            item.ReferencedFrameNumber = frame
        item.ReferencedControlPointIndex = index
        items.append(item)
    dataset.ExposureSequence = Sequence(items)
    dataset.PixelData = np.repeat(image[None], len(control_points), axis=0).tobytes()
    return dataset


def field_edges(frame: np.ndarray) -> tuple[float, float, float, float]:
    """(x low, x high, y low, y high) mm where the profiles through the field's middle cross half
    its maximum (linear interpolation between pixel centres)."""
    def crossings(profile, centres):
        level = profile.max() / 2
        inside = np.flatnonzero(profile >= level)
        first, last = inside[0], inside[-1]
        low = centres[first - 1] + (level - profile[first - 1]) / (profile[first] - profile[first - 1]) * (
            centres[first] - centres[first - 1])
        high = centres[last] + (profile[last] - level) / (profile[last] - profile[last + 1]) * (
            centres[last + 1] - centres[last])
        return low, high

    row, column = np.unravel_index(np.argmax(frame), frame.shape)
    x_centres = np.arange(256) - 127.5
    y_centres = 127.5 - np.arange(256)
    x_low, x_high = crossings(frame[row], x_centres)
    y_high, y_low = crossings(frame[:, column], y_centres)
    return x_low, x_high, y_low, y_high


@pytest.mark.parametrize("collimator_deg", [0.0, 90.0, 180.0, 270.0])
def test_fine_image_at_1600_mm_puts_field_edges_within_half_a_millimetre(tmp_path, collimator_deg):
    x_mm, y_mm = (-40.3, 55.7), (-30.2, 45.6)
    path = saved(tmp_path, field_image(x_mm, y_mm, collimator_deg=collimator_deg, control_points=(7, 8)),
                 "field.dcm")
    read = read_frames(path)
    np.testing.assert_array_equal(read.control_point_index, [7, 8])
    assert read.sid_mm == 1600 and read.frames.shape == (2, 256, 256)
    edges = field_edges(read.frames[0])
    np.testing.assert_allclose(edges, [*x_mm, *y_mm], atol=0.5)
    assert read.frames[0].max() == pytest.approx(1000, rel=1e-3)


def test_turned_and_shifted_receptor_still_puts_field_edges_within_half_a_millimetre(tmp_path):
    """Collimator at 30 degrees, receptor at 25 degrees and shifted: pixels are the field's share
    of 4 x 4 points each, the points placed with the RT Image geometry independently of the reader."""
    x_mm, y_mm = (-40.3, 55.7), (-30.2, 45.6)
    collimator, receptor, shift = 30.0, 25.0, (32.0, -16.0)
    dataset = field_image((0, 0), (0, 0))
    rows, columns, pitch, scale = dataset.Rows, dataset.Columns, 0.392, 1.6
    first = [float(value) for value in dataset.RTImagePosition]
    sub = (np.arange(4) + 0.5) / 4 - 0.5
    receptor_x, receptor_y = np.meshgrid(first[0] + (np.arange(columns)[:, None] + sub).ravel() * pitch,
                                         first[1] - (np.arange(rows)[:, None] + sub).ravel() * pitch)
    turn = np.radians(receptor)  # receptor -> gantry axes at the imager, then to the isocentre
    gantry_x = (np.cos(turn) * receptor_x - np.sin(turn) * receptor_y + shift[0]) / scale
    gantry_y = (np.sin(turn) * receptor_x + np.cos(turn) * receptor_y + shift[1]) / scale
    turn = np.radians(-collimator)  # gantry -> collimator axes
    x = np.cos(turn) * gantry_x - np.sin(turn) * gantry_y
    y = np.sin(turn) * gantry_x + np.cos(turn) * gantry_y
    inside = (x >= x_mm[0]) & (x < x_mm[1]) & (y >= y_mm[0]) & (y < y_mm[1])
    share = inside.reshape(rows, 4, columns, 4).mean(axis=(1, 3))
    dataset.PixelData = np.rint(1000 * share).astype(np.uint16).tobytes()
    dataset.BeamLimitingDeviceAngle, dataset.XRayImageReceptorAngle = f"{collimator:g}", f"{receptor:g}"
    dataset.XRayImageReceptorTranslation = [f"{shift[0]:g}", f"{shift[1]:g}", "-600"]
    read = read_frames(saved(tmp_path, dataset, "turned.dcm"))
    np.testing.assert_allclose(field_edges(read.frames[0]), [*x_mm, *y_mm], atol=0.5)


def test_bad_images_give_one_line(tmp_path):
    field = field_image((-10, 10), (-10, 10), rows=64, columns=64, pitch_mm=1.6)
    cases = []
    unreferenced = field_image((-10, 10), (-10, 10), rows=64, columns=64, pitch_mm=1.6)
    del unreferenced.ExposureSequence
    cases.append((unreferenced, "no control-point reference"))
    for keyword in ("ImagePlanePixelSpacing", "RTImageSID"):
        spoiled = field_image((-10, 10), (-10, 10), rows=64, columns=64, pitch_mm=1.6)
        delattr(spoiled, keyword)
        cases.append((spoiled, f"no {keyword}"))
    for number, (dataset, problem) in enumerate(cases):
        path = saved(tmp_path, dataset, f"bad_{number}.dcm")
        with pytest.raises(ImageError) as error:
            read_frames(path)
        assert_one_line(error, str(path), problem)
    whole = saved(tmp_path, field, "whole.dcm")
    truncated = tmp_path / "truncated.dcm"
    truncated.write_bytes(whole.read_bytes()[:-100])
    plan = tmp_path / "plan.dcm"
    write_plan(plan, generate_control_points(0, 3))
    text = tmp_path / "notes.txt"
    text.write_text("not an image\n")
    for path, problem in ((truncated, "truncated"), (plan, "not an RT Image"), (text, "not a DICOM file")):
        with pytest.raises(ImageError) as error:
            read_frames(path)
        assert_one_line(error, str(path), problem)


# --------------------------------------------------------------------------- validator


def dciodvfy(path) -> list[str]:
    result = subprocess.run(["dciodvfy", str(path)], capture_output=True, text=True, timeout=60, check=False)
    return (result.stdout + result.stderr).splitlines()


@pytest.mark.skipif(shutil.which("dciodvfy") is None, reason="dciodvfy (dicom3tools) is not installed")
def test_dciodvfy_finds_no_errors_in_written_plan_and_image(tmp_path):
    """The plan draws no message at all; the image only the warning that dciodvfy does not know
    the private element holding each frame's control point."""
    plan, image = tmp_path / "arc.dcm", tmp_path / "frames.dcm"
    write_plan(plan, generate_control_points(100, 12))
    write_frames(image, np.random.default_rng(0).random((3, 256, 256)), plan_path=plan)
    plan_lines, image_lines = dciodvfy(plan), dciodvfy(image)
    assert not [line for line in plan_lines if "Error" in line or "Warning" in line], plan_lines
    assert not [line for line in image_lines if "Error" in line], image_lines
    assert all("0x0011,0x1001" in line for line in image_lines if "Warning" in line), image_lines


def test_an_arc_with_x_jaws_is_written_with_asymx_jaws_and_read_back_folded_into_them(tmp_path):
    from epid.synthesis.mlc import MLC_GEOMETRIES

    geometry = MLC_GEOMETRIES["millennium120"]
    arc = generate_control_points(300, CONTROL_POINTS, geometry)
    x_jaws = np.stack([arc.leaf_a.min(1) + 3.0, arc.leaf_b.max(1) - 3.0], 1).round(1)
    path = tmp_path / "x_jaws.dcm"
    write_plan(path, arc, mlc=geometry, x_jaws=x_jaws)
    (beam,) = read_plan(path)
    np.testing.assert_allclose(beam.x_jaws, x_jaws, atol=1e-4)
    expected_a = np.clip(beam.geometry.shown(arc.leaf_a, arc.leaf_b)[0], x_jaws[:, :1], x_jaws[:, 1:])
    np.testing.assert_allclose(beam.control_points.leaf_a, expected_a, atol=1e-4)
    assert 0 < (beam.behind_x_jaws() == 1).mean() < 1
    point = pydicom.dcmread(path).BeamSequence[0].ControlPointSequence[5]
    types = [str(item.RTBeamLimitingDeviceType) for item in point.BeamLimitingDevicePositionSequence]
    assert types == ["ASYMX", "ASYMY", "MLCX"]
    with pytest.raises(ValueError, match=r"x_jaws of shape \(3, 2\): expected \(40, 2\)"):
        write_plan(tmp_path / "bad.dcm", arc, mlc=geometry, x_jaws=x_jaws[:3])
    with pytest.raises(ValueError, match="halcyon: without"):
        write_plan(tmp_path / "bad.dcm", generate_control_points(300, CONTROL_POINTS, MLC_GEOMETRIES["halcyon"]),
                   mlc=MLC_GEOMETRIES["halcyon"], x_jaws=x_jaws)
    with pytest.raises(ValueError, match="agility: without"):  # Y diaphragms only
        write_plan(tmp_path / "bad.dcm", generate_control_points(300, CONTROL_POINTS, MLC_GEOMETRIES["agility"]),
                   mlc=MLC_GEOMETRIES["agility"], x_jaws=x_jaws)
    if shutil.which("dciodvfy"):
        lines = [line for line in dciodvfy(path) if "Error" in line or "Warning" in line]
        assert not lines, lines


@pytest.mark.parametrize("name", ["agility", "millennium120", "mlci2", "halcyon", "hd120"])
def test_an_arc_on_each_mlc_is_written_on_its_own_leaves_and_read_back_the_same(tmp_path, name):
    from epid.synthesis.mlc import MLC_GEOMETRIES

    geometry = MLC_GEOMETRIES[name]
    arc = generate_control_points(300, CONTROL_POINTS, geometry)
    path = tmp_path / f"{name}.dcm"
    write_plan(path, arc, mlc=geometry)
    (beam,) = read_plan(path)
    assert beam.geometry is geometry
    shown = arc.folded_into_x_jaws()  # the reader folds the leaves into the X jaws it reads back
    for field in ("leaf_a", "leaf_b", "jaw_1", "jaw_2"):
        np.testing.assert_allclose(getattr(beam.control_points, field), getattr(shown, field), atol=1e-4)
    assert (beam.x_jaws is None) == (arc.x_jaws is None) == (name in ("halcyon", "agility"))
    if arc.x_jaws is not None:
        np.testing.assert_allclose(beam.x_jaws, arc.x_jaws, atol=1e-4)
    devices = {str(item.RTBeamLimitingDeviceType): int(item.NumberOfLeafJawPairs)
               for item in pydicom.dcmread(path).BeamSequence[0].BeamLimitingDeviceSequence}
    expected = ({"MLCX1": 28, "MLCX2": 29} if name == "halcyon"
                else {"ASYMY": 1, "MLCX": geometry.pairs[0]} if name == "agility"
                else {"ASYMX": 1, "ASYMY": 1, "MLCX": geometry.pairs[0]})
    assert devices == expected
    if shutil.which("dciodvfy"):
        # the standard enumerates MLCX and MLCY only; MLCX1 and MLCX2 are the names Halcyon plans use
        vendor = "Unrecognized enumerated value <MLCX"
        lines = [line for line in dciodvfy(path) if ("Error" in line or "Warning" in line) and vendor not in line]
        assert not lines, lines
