"""Varian XIM cine frames (epid.dicom.xim, read through pylinac): the same field lands on the grid as
from the equivalent RT Image, angles come from Varian's Standard scale, frames are ordered and placed
by the linac's MU counter (dropped frames included), and bad files get one line naming them."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from bench.xim_files import write_xim
from epid.dicom.image import ImageError
from epid.dicom.series import read_series
from epid.evaluation import timeline
from tests.dicom.test_plan_and_image import assert_one_line, field_edges
from tests.dicom.test_series import FIELD, panel_image, save
from tests.evaluation.test_timeline import arc_80

pytest.importorskip("pylinac.core.image", reason="pylinac (requirements-xim.txt) reads XIM files")


def xim_of(dataset, **properties) -> tuple[np.ndarray, dict]:
    """The pixels and header of the XIM file a TrueBeam would write for the RT Image ``dataset`` of
    ``panel_image`` (unit slope): sizes in cm, the panel's height below the isocentre negative,
    angles on Varian's Standard scale (IEC 61217's g is 180 - g there)."""
    pitch_cm = float(dataset.ImagePlanePixelSpacing[0]) / 10
    translation = [float(v) / 10 for v in dataset.XRayImageReceptorTranslation]
    header = {"PixelWidth": pitch_cm, "PixelHeight": pitch_cm, "MVSourceVrt": 100.0,
              "MVDetectorVrt": 100.0 - float(dataset.RTImageSID) / 10, "MVDetectorLat": translation[0],
              "MVDetectorLng": translation[1], "MVCollimatorRtn": 180.0}
    if "GantryAngle" in dataset:
        header["GantryRtn"] = (180.0 - float(dataset.GantryAngle)) % 360.0
    pixels = np.frombuffer(dataset.PixelData, dtype=np.uint16).reshape(dataset.Rows, dataset.Columns)
    return pixels.astype(np.int32), {**header, **properties}


def test_written_xim_files_read_back_pixel_for_pixel_through_pylinac(tmp_path):
    from pylinac.core.image import XIM

    rng = np.random.default_rng(3)
    pixels = (rng.integers(-90_000, 90_000, (31, 47)) * (rng.random((31, 47)) < 0.6)).astype(np.int32)
    pixels[4:9, 10:30] = rng.integers(0, 100, (5, 20))  # runs of one-byte differences beside two- and four-byte ones
    header = {"GantryRtn": 181.5, "PixelWidth": 0.0336, "ImageMode": "Cine", "MVDoseRate": [600.0, 400.0],
              "MLCModel": 2}
    image = XIM(write_xim(tmp_path / "frame.xim", pixels, header))
    np.testing.assert_array_equal(image.array, pixels)
    assert image.properties == {**header, "MVDoseRate": (600.0, 400.0)}


@pytest.mark.parametrize("sid_mm, translation, gantry_deg", [(1500.0, (6.0, -4.0), 185.5), (1000.0, (0.0, 0.0), 0.0)])
def test_an_xim_frame_lands_on_the_grid_as_its_rt_image_does(tmp_path, sid_mm, translation, gantry_deg):
    # an aS1000-like panel (0.392 mm) at its SID, shifted, at a gantry angle: read from the XIM and
    # from the RT Image holding the same pixels and geometry
    image = panel_image(*FIELD, rows=640, columns=512, pitch_mm=0.392, sid_mm=sid_mm, translation=translation,
                        gantry_deg=gantry_deg)
    from_dicom = read_series(save(image, tmp_path / "frame.dcm"))
    from_xim = read_series(write_xim(tmp_path / "frame.xim", *xim_of(image)))
    np.testing.assert_allclose(from_xim.frames, from_dicom.frames, rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(field_edges(from_xim.frames[0]), [*FIELD[0], *FIELD[1]], atol=0.5)
    np.testing.assert_allclose(from_xim.gantry_deg, [gantry_deg], atol=1e-9)
    assert (from_xim.sid_mm, from_xim.pixel_mm) == pytest.approx((sid_mm, 0.392 * 1000 / sid_mm))
    assert from_xim.integrated and np.isnan(from_xim.delivered_mu).all() and from_xim.beam_number is None


@pytest.fixture(scope="module")
def beam(tmp_path_factory):
    return arc_80(tmp_path_factory.mktemp("plan"))


def cine_frames(folder, beam, ends, starts=None, *, order=None):
    """XIM frames of ``beam`` ending at cumulative MU ``ends`` (MVDoseDelivered; with ``starts``,
    MVDoseStart / MVDoseStop), at Varian Standard angles; file k holds frame ``order[k]``."""
    small = panel_image(*FIELD, rows=64, columns=64, pitch_mm=4.0, sid_mm=1000.0)
    cumulative = np.concatenate([[0.0], np.cumsum(beam.control_points.mu[1:].astype(np.float64))])
    unwrapped = np.rad2deg(np.unwrap(np.deg2rad(beam.gantry_deg.astype(np.float64))))
    for name, index in enumerate(range(len(ends)) if order is None else order):
        counter = ({"MVDoseDelivered": float(ends[index])} if starts is None else
                   {"MVDoseStart": float(starts[index]), "MVDoseStop": float(ends[index])})
        iec = np.interp(ends[index], cumulative, unwrapped) % 360.0
        write_xim(folder / f"frame_{name:04d}.xim", *xim_of(small, GantryRtn=(180.0 - iec) % 360.0, **counter))
    return folder


def test_xim_frames_are_placed_by_the_linacs_mu_counter_with_dropped_frames(tmp_path, beam):
    total = float(np.sum(beam.control_points.mu[1:], dtype=np.float64))
    edges = np.linspace(0.0, total, 11)
    kept = np.array([0, 1, 2, 3, 5, 6, 7, 8, 9])  # the fifth frame dropped
    folder = tmp_path / "counted"
    folder.mkdir()
    series = read_series(cine_frames(folder, beam, edges[1:][kept], edges[:-1][kept]))
    placement = timeline.place_frames(beam, series)
    assert placement.placed_by.startswith("the linac's MU counter")
    assert placement.dropped == 1
    np.testing.assert_allclose(placement.boundaries_mu, edges, atol=1e-9)
    np.testing.assert_array_equal(placement.frame_of, [1, 2, 3, 4, 6, 7, 8, 9, 10])


def test_xim_frames_with_only_their_end_are_ordered_by_it_and_laid_end_to_end(tmp_path, beam):
    total = float(np.sum(beam.control_points.mu[1:], dtype=np.float64))
    ends = np.linspace(0.0, total, 8)[1:]
    folder = tmp_path / "ends"
    folder.mkdir()
    order = [3, 0, 6, 1, 5, 2, 4]
    series = read_series(cine_frames(folder, beam, ends, order=order))
    assert series.sources == tuple(str(folder / f"frame_{order.index(index):04d}.xim") for index in range(7))
    np.testing.assert_allclose(series.delivered_mu, np.stack([np.concatenate([[0.0], ends[:-1]]), ends], 1))
    placement = timeline.place_frames(beam, series)
    assert placement.dropped == 0
    np.testing.assert_allclose(placement.boundaries_mu, np.concatenate([[0.0], ends]), atol=1e-9)
    # the angles agree with the counter: the same frames without it are placed by angle at the same MU
    np.testing.assert_allclose(series.gantry_deg % 360.0, [
        np.interp(end, np.concatenate([[0.0], np.cumsum(beam.control_points.mu[1:].astype(np.float64))]),
                  np.rad2deg(np.unwrap(np.deg2rad(beam.gantry_deg.astype(np.float64))))) % 360.0 for end in ends],
        atol=1e-9)


@pytest.mark.parametrize("case", ["no pixel size", "no panel height", "text angle", "truncated"])
def test_bad_xim_files_give_one_line_naming_the_file(tmp_path, case):
    pixels, header = xim_of(panel_image(*FIELD, rows=32, columns=32, pitch_mm=8.0, sid_mm=1000.0, gantry_deg=0.0))
    if case == "no pixel size":
        del header["PixelWidth"]
    elif case == "no panel height":
        del header["MVDetectorVrt"]
    elif case == "text angle":
        header["GantryRtn"] = "up"
    path = write_xim(tmp_path / "bad.xim", pixels, header)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ImageError) as raised:
        read_series(path)
    assert_one_line(raised, "bad.xim")
    expected = {"no pixel size": "PixelWidth", "no panel height": "MVDetectorVrt", "text angle": "GantryRtn",
                "truncated": "malformed XIM"}[case]
    assert expected in str(raised.value)


def test_without_pylinac_an_xim_file_is_refused_in_one_line_saying_how_to_install_it(tmp_path, monkeypatch):
    pixels, header = xim_of(panel_image(*FIELD, rows=32, columns=32, pitch_mm=8.0, sid_mm=1000.0))
    path = write_xim(tmp_path / "frame.xim", pixels, header)
    monkeypatch.setitem(sys.modules, "pylinac.core.image", None)
    with pytest.raises(ImageError) as raised:
        read_series(path)
    assert_one_line(raised, "frame.xim")
    assert "pylinac" in str(raised.value) and "requirements-xim.txt" in str(raised.value)
