"""Every benchmark runs the one way the README states, ``python -m bench.<name>`` from the
repository root: its --help exits 0 and describes its options."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT, clean_environment

BENCHES = sorted(path.stem for path in (ROOT / "bench").glob("bench_*.py"))


def test_every_bench_answers_help_as_a_module():
    assert BENCHES == ["bench_dicom", "bench_error_detection", "bench_gamma", "bench_memory", "bench_models",
                       "bench_plan_qa", "bench_quality", "bench_reconstruct", "bench_synthesis", "bench_train"]
    processes = {
        name: subprocess.Popen([sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, env=clean_environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in BENCHES
    }
    for name, process in processes.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, f"{name}: {err[-2000:]}"
        assert out.startswith("usage: python -m bench.") and "--" in out, (name, out[:300])


def test_clinic_panel_integrates_leaf_motion_exactly_and_records_the_delivered_mu(tmp_path):
    """bench.clinic_delivery: the share of a piece's time each point lies between two moving banks
    against a 20,000-step count, and a delivery's frames covering the beam's MU, its signal
    scaled with an MU error."""
    import dataclasses

    import numpy as np

    from bench.clinic_delivery import ClinicPanel, DeliveryErrors, PanelPhysics, _open_share
    from epid.dicom.plan import read_plan, write_plan
    from epid.synthesis.sequences import generate_control_points

    rng = np.random.default_rng(1)
    x = np.linspace(-50, 50, 401)[None, :]
    a0, a1, b0, b1 = (rng.uniform(-40, 40, (6, 1)) for _ in range(4))
    b0, b1 = np.maximum(b0, a0), np.maximum(b1, a1)
    steps = (np.arange(20000) + 0.5) / 20000
    counted = np.mean([(a0 + (a1 - a0) * t < x) & (b0 + (b1 - b0) * t > x) for t in steps], axis=0)
    np.testing.assert_allclose(_open_share(x, a0, a1, b0, b1), counted, atol=1e-4)
    write_plan(tmp_path / "arc.dcm", generate_control_points(86, 6), beam_mu=40.0, gantry_start_deg=181.0,
               gantry_stop_deg=211.0, label="arc 86")
    (beam,) = read_plan(tmp_path / "arc.dcm")
    physics = dataclasses.replace(PanelPhysics(), noise_per_sqrt_unit=0.0, lag=(), nonlinearity=0.0)
    panel = ClinicPanel(physics)
    delivered = panel.deliver(beam)
    assert delivered.spans_mu[0, 0] == 0.0 and np.all(np.diff(delivered.spans_mu, axis=1) > 0)
    assert delivered.spans_mu[-1, 1] <= 40.0 + 1e-6 and delivered.spans_mu[-1, 1] > 40.0 - 40.0 / len(delivered.frames)
    more = panel.deliver(beam, DeliveryErrors(mu_scale=1.03))
    ratio = more.frames.sum() / delivered.frames.sum()
    assert abs(ratio - 1.03) < 0.01, ratio
    # the linac's counter counts planned MU: it ends at the beam's 40 MU while 3 % more were delivered
    assert abs(more.counter_mu[-1, 1] - 40.0) < 40.0 / len(more.frames) < abs(more.spans_mu[-1, 1] - 40.0)
    np.testing.assert_allclose(more.counter_mu, more.spans_mu / 1.03)


def test_clinic_renders_a_plans_x_jaws_as_jaws_and_shifts_x1_by_its_error(tmp_path):
    """A static field, leaves open over [-50, 50] mm behind X jaws at -20 and 30 mm and Y jaws at
    +-40 mm: the fluence is open between the jaws, the jaws' 0.2 % beyond them (over open leaves),
    0.2 % squared beyond both, and an X1 closed 1 mm opens at -19 mm."""
    import dataclasses

    import numpy as np

    from bench.clinic_delivery import ClinicPanel, DeliveryErrors, PanelPhysics, delivered_plan
    from epid.dicom.plan import read_plan, write_plan
    from epid.synthesis.sequences import generate_control_points

    arc = generate_control_points(86, 2)
    field = dataclasses.replace(arc, leaf_a=np.full_like(arc.leaf_a, -50.0), leaf_b=np.full_like(arc.leaf_b, 50.0),
                                jaw_1=np.full_like(arc.jaw_1, -40.0), jaw_2=np.full_like(arc.jaw_2, 40.0))
    write_plan(tmp_path / "field.dcm", field, beam_mu=10.0, x_jaws=np.array([[-20.0, 30.0]] * 2))
    (beam,) = read_plan(tmp_path / "field.dcm")
    np.testing.assert_allclose(beam.x_jaws, [[-20.0, 30.0]] * 2)
    # the leaves where they stand, not folded into the jaws as the plan reading gives them
    beam = dataclasses.replace(beam, control_points=dataclasses.replace(
        beam.control_points, leaf_a=np.full_like(beam.control_points.leaf_a, -50.0),
        leaf_b=np.full_like(beam.control_points.leaf_b, 50.0)))
    physics = PanelPhysics(horn_per_100mm=0.0)
    panel = ClinicPanel(physics)
    row = np.argmin(np.abs(panel.y - 2.5))  # inside a leaf, away from its boundaries
    for x1_error, opening in ((0.0, -20.0), (1.0, -19.0)):
        plan = delivered_plan(beam, DeliveryErrors(x_jaw_1_mm=x1_error))
        profile = panel.fluence(plan, 0.0, 10.0)[row] / 10.0
        inside = (panel.x > opening) & (panel.x < 30.0)
        np.testing.assert_allclose(profile[inside], 1.0)
        np.testing.assert_allclose(profile[(panel.x > -50.0) & (panel.x < opening)], physics.jaw_transmission)
        beyond = panel.x > 50.0 + physics.leaf_end_offset_mm  # a leaf end shows its edge that much more open
        np.testing.assert_allclose(profile[beyond], physics.jaw_transmission * physics.leaf_transmission)
        # outside the Y jaws too, both jaws transmit
        corner = panel.fluence(plan, 0.0, 10.0)[np.argmin(np.abs(panel.y - 60.0))] / 10.0
        np.testing.assert_allclose(corner[(panel.x > -50.0) & (panel.x < opening)], physics.jaw_transmission ** 2)
        np.testing.assert_allclose(corner[inside], physics.jaw_transmission)


def test_clinic_cine_frames_read_alike_as_rt_images_and_as_xim_placed_by_the_mu_counter(tmp_path):
    import numpy as np
    import pytest

    pytest.importorskip("pylinac.core.image", reason="pylinac (requirements-xim.txt) reads XIM files")
    from bench.clinic_delivery import ClinicPanel, PanelPhysics, write_cine, write_xim_cine
    from epid.dicom.plan import read_plan, write_plan
    from epid.dicom.series import read_series
    from epid.evaluation import timeline
    from epid.synthesis.sequences import generate_control_points

    write_plan(tmp_path / "arc.dcm", generate_control_points(86, 4), beam_mu=12.0, gantry_start_deg=181.0,
               gantry_stop_deg=191.0, label="arc 86")
    (beam,) = read_plan(tmp_path / "arc.dcm")
    physics = PanelPhysics()
    delivered = ClinicPanel(physics).deliver(beam)
    as_images = read_series(write_cine(delivered, tmp_path / "dicom", physics))
    as_xim = read_series(write_xim_cine(delivered, tmp_path / "xim", physics))
    np.testing.assert_allclose(as_xim.gantry_deg, as_images.gantry_deg, atol=0.006)  # the RT Images' 2 decimals
    np.testing.assert_allclose(as_xim.frames, as_images.frames, atol=0.5)  # rounded to whole panel units
    placement = timeline.place_frames(beam, as_xim)
    assert placement.placed_by.startswith("the linac's MU counter")
    np.testing.assert_allclose(placement.boundaries_mu[1:], delivered.spans_mu[:, 1], atol=1e-9)


def test_clinic_panel_lays_its_rows_on_the_plans_own_leaves():
    """bench.clinic_delivery renders each fluence row with the strip a plan read gives it and leaks
    between leaves only at the MLC's own leaf boundaries, worked by hand: HD120's 5 mm leaf from -110
    to -105 mm is strips 8 and 9 of 2.5 mm with no boundary between them, its 2.5 mm leaves from -40 mm;
    Millennium 120's 10 mm leaves (-200 to -100 mm and 100 to 200 mm) leak only every 10 mm, not at
    the 5 mm strips' boundary -115 mm."""
    import numpy as np

    from bench.clinic_delivery import ClinicPanel
    from epid.synthesis.mlc import MLC_GEOMETRIES

    panel = ClinicPanel()

    def at(y: float) -> tuple[int, int, bool]:
        index = int(np.argmin(np.abs(panel.y - y)))
        return int(panel.row[index]), int(panel.neighbour[index]), bool(panel.interleaf[index])

    legacy = [at(y) for y in (-125.125, -124.875, -122.625)]
    assert legacy == [(0, 1, True), (1, 0, True), (1, 0, False)]  # 5 mm rows, a boundary every 5 mm
    panel.leaf_rows(MLC_GEOMETRIES["hd120"])
    assert [at(y) for y in (-109.875, -107.625, -105.125, -104.875, -40.125, -39.875, 41.125)] == [
        (8, 7, True), (8, 7, False), (9, 10, True), (10, 9, True), (35, 36, True), (36, 35, True), (68, 67, False)]
    assert at(-107.5 + 0.125)[2] is False  # between strips 8 and 9: inside one 5 mm leaf
    panel.leaf_rows(MLC_GEOMETRIES["millennium120"])
    assert at(-115.125)[2] is False and at(-114.875)[2] is False and at(-110.125)[2] is True


def test_a_stuck_leaf_sticks_every_strip_of_its_mlc_leaf(tmp_path):
    """From half way through the arc bank A's leaf over the named strip stands still (closed no further
    than bank B): on HD120 the 5 mm leaf over strip 26 is strips 26 and 27, and both stick; the 2.5 mm
    leaf over strip 41 is strip 41 alone; the other strips move as planned."""
    import dataclasses

    import numpy as np

    from bench.clinic_delivery import DeliveryErrors, delivered_plan
    from epid.dicom.plan import read_plan, write_plan
    from epid.synthesis.mlc import MLC_GEOMETRIES
    from epid.synthesis.sequences import generate_control_points

    hd120 = MLC_GEOMETRIES["hd120"]
    arc = dataclasses.replace(generate_control_points(14, 9, hd120), x_jaws=None)  # no X jaw hides the two leaves
    write_plan(tmp_path / "arc.dcm", arc, beam_mu=20.0, label="arc 14", mlc=hd120)
    (beam,) = read_plan(tmp_path / "arc.dcm")
    planned = beam.control_points
    for strip, stuck in ((26, [26, 27]), (41, [41])):
        delivered = delivered_plan(beam, DeliveryErrors(stuck_leaf=(strip, 0.5)))["leaf_a"]
        expected = planned.leaf_a.astype(np.float64)
        expected[4:, stuck] = np.minimum(expected[4, stuck], planned.leaf_b[4:, stuck])
        np.testing.assert_allclose(delivered, expected)
        assert not np.allclose(planned.leaf_a[4:, stuck], planned.leaf_a[4, stuck])  # the plan moves them


def test_the_benchs_stuck_leaf_lies_over_the_same_y_on_every_mlc():
    """``leaf_26_stuck`` sticks the leaf over y = 0 to 5 mm of the 52 strips (strip 26); on HD120 the 2.5
    mm leaf over y = 2.5 to 5 mm (strip 53), in the field where strip 26 (y -65 to -62.5 mm) rarely is."""
    from bench.bench_error_detection import ERRORS, stuck_at
    from epid.synthesis.mlc import MLC_GEOMETRIES

    stuck = {name: stuck_at(ERRORS["leaf_26_stuck"], mlc).stuck_leaf for name, mlc in MLC_GEOMETRIES.items()}
    assert stuck["legacy"] == stuck["halcyon"] == (26, 0.5) and stuck["hd120"] == (53, 0.5)
    assert stuck_at(ERRORS["none"], MLC_GEOMETRIES["hd120"]) == ERRORS["none"]
