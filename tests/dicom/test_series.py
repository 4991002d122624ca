"""Measured RT Images as clinical systems write them (epid.dicom.series): cine series of single-frame
files with gantry angles and times, panels at their own pitch, SID, rescale and offsets, files
without a preamble, fields reaching past the grid, and the one-line errors on bad series."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from epid.dicom import files as files_module
from epid.dicom.image import RT_IMAGE_STORAGE, ImageError
from epid.dicom.series import expand_paths, panel_correction, read_beam_series, read_series
from tests.dicom.test_plan_and_image import assert_one_line, field_edges


def panel_image(x_mm, y_mm, *, rows, columns, pitch_mm, sid_mm, slope=1.0, translation=(0.0, 0.0),
                gantry_deg=None, acquired=None, beam=1, instance=1, level=1000.0) -> Dataset:
    """A single-frame measured-like RT Image of a field x_mm x y_mm at the isocentre (receptor
    shifted by ``translation`` mm at the imager): each pixel's value after rescale is ``level``
    times the share of its area inside the field; stored as uint16 with ``slope``."""
    scale = sid_mm / 1000.0
    first = (-(columns - 1) / 2 * pitch_mm, (rows - 1) / 2 * pitch_mm)
    centres_x = first[0] + np.arange(columns) * pitch_mm + translation[0]
    centres_y = first[1] - np.arange(rows) * pitch_mm + translation[1]

    def share(centres, edges):
        low = np.maximum(centres - pitch_mm / 2, edges[0] * scale)
        high = np.minimum(centres + pitch_mm / 2, edges[1] * scale)
        return np.clip(high - low, 0, None) / pitch_mm

    stored = np.rint(level * np.outer(share(centres_y, y_mm), share(centres_x, x_mm)) / slope).astype(np.uint16)
    dataset = Dataset()
    dataset.SOPClassUID = RT_IMAGE_STORAGE
    dataset.SOPInstanceUID = generate_uid()
    dataset.Modality = "RTIMAGE"
    dataset.ImageType = ["ORIGINAL", "PRIMARY", "PORTAL"]
    dataset.SamplesPerPixel = 1
    dataset.PhotometricInterpretation = "MONOCHROME2"
    dataset.Rows, dataset.Columns = rows, columns
    dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit, dataset.PixelRepresentation = 16, 16, 15, 0
    dataset.RescaleSlope, dataset.RescaleIntercept = f"{slope:g}", "0"
    dataset.RTImagePlane = "NORMAL"
    dataset.ImagePlanePixelSpacing = [f"{pitch_mm:g}", f"{pitch_mm:g}"]
    dataset.RTImagePosition = [f"{first[0]:.4f}", f"{first[1]:.4f}"]
    dataset.XRayImageReceptorTranslation = [f"{translation[0]:g}", f"{translation[1]:g}", "0"]
    dataset.RTImageSID = f"{sid_mm:g}"
    dataset.RadiationMachineSAD = "1000"
    dataset.BeamLimitingDeviceAngle = "0"
    dataset.XRayImageReceptorAngle = "0"
    dataset.InstanceNumber = instance
    if beam is not None:
        dataset.ReferencedBeamNumber = beam
    if gantry_deg is not None:
        dataset.GantryAngle = f"{gantry_deg:g}"
    if acquired is not None:
        dataset.AcquisitionDateTime = acquired
    dataset.PixelData = stored.tobytes()
    return dataset


def save(dataset: Dataset, path, preamble: bool = True):
    if preamble:
        dataset.file_meta = FileMetaDataset()
        dataset.file_meta.MediaStorageSOPClassUID = dataset.SOPClassUID
        dataset.file_meta.MediaStorageSOPInstanceUID = dataset.SOPInstanceUID
        dataset.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        dataset.save_as(path, enforce_file_format=True)
    else:
        dataset.save_as(path, implicit_vr=True, little_endian=True, enforce_file_format=False)
    return path


FIELD = ((-40.3, 55.7), (-30.2, 45.6))


def test_as1200_like_series_at_two_sids_reads_in_time_order_with_its_own_rescale_and_offset(tmp_path):
    # aS1200: 1190 x 1190 pixels of 0.336 mm; one image at SID 1000, one at 1500, each its own slope,
    # the receptor shifted; files given in reverse time order
    second = panel_image(*FIELD, rows=1190, columns=1190, pitch_mm=0.336, sid_mm=1500.0, slope=0.05,
                         translation=(6.0, -4.0), gantry_deg=185.5, acquired="20261126101500.25", instance=2)
    first = panel_image(*FIELD, rows=1190, columns=1190, pitch_mm=0.336, sid_mm=1000.0, slope=0.02,
                        translation=(-3.0, 2.5), gantry_deg=181.0, acquired="20261126101500.145", instance=9)
    paths = [save(second, tmp_path / "b.dcm"), save(first, tmp_path / "a.dcm")]
    series = read_series([str(p) for p in paths])
    assert series.sources == (str(paths[1]), str(paths[0])), "ordered by acquisition time, not instance or name"
    np.testing.assert_allclose(series.gantry_deg, [181.0, 185.5])
    np.testing.assert_allclose(series.time_s, [0.0, 0.105], atol=1e-6)
    assert series.beam_number == 1 and not series.integrated and series.control_point_index.tolist() == [0, 0]
    for frame in series.frames:
        edges = field_edges(frame)
        np.testing.assert_allclose(edges, [*FIELD[0], *FIELD[1]], atol=0.5)
        assert abs(float(frame[128, 128]) - 1000.0) < 2.0
    np.testing.assert_allclose(series.outside_percent, 0.0, atol=1e-9)
    assert series.pixel_mm == pytest.approx(0.336)


def test_iviewgt_like_file_without_preamble_is_read_as_one_integrated_image(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(files_module, "_PREAMBLE_NOTED", [])
    image = panel_image(*FIELD, rows=1024, columns=1024, pitch_mm=0.4, sid_mm=1600.0, beam=None)
    path = save(image, tmp_path / "iview.dcm", preamble=False)
    assert path.read_bytes()[128:132] != b"DICM"
    series = read_series(path)
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and "iview.dcm" in notes[0] and "no DICOM preamble" in notes[0]
    assert series.integrated and len(series) == 1 and series.sid_mm == 1600.0
    np.testing.assert_allclose(field_edges(series.frames[0]), [*FIELD[0], *FIELD[1]], atol=0.5)


def test_a_field_reaching_past_the_grid_reports_its_share_outside(tmp_path):
    # a 210 x 40 mm field from x = -150 mm on a 400 mm panel at SID 1000: 22 of its 210 mm lie beyond the
    # grid's -128 mm edge
    image = panel_image((-150.0, 60.0), (-20.0, 20.0), rows=1190, columns=1190, pitch_mm=0.336, sid_mm=1000.0)
    series = read_series(save(image, tmp_path / "wide.dcm"))
    assert series.outside_percent[0] == pytest.approx(100 * 22 / 210, abs=0.3)


def test_folders_and_glob_patterns_name_their_files(tmp_path):
    for index in range(3):
        save(panel_image(*FIELD, rows=64, columns=64, pitch_mm=4.0, sid_mm=1000.0, gantry_deg=10.0 * index,
                         instance=index + 1), tmp_path / f"frame_{index}.dcm")
    (tmp_path / ".hidden").write_text("not an image")
    assert len(expand_paths(tmp_path)) == 3
    assert expand_paths(str(tmp_path / "frame_*.dcm")) == sorted(str(p) for p in tmp_path.glob("frame_*.dcm"))
    series = read_series(tmp_path)
    np.testing.assert_allclose(series.gantry_deg, [0.0, 10.0, 20.0])


def small(**changes) -> Dataset:
    settings = {"rows": 64, "columns": 64, "pitch_mm": 4.0, "sid_mm": 1000.0, "gantry_deg": 0.0}
    return panel_image(*FIELD, **{**settings, **changes})


def test_a_plans_delivery_splits_into_one_series_per_beam(tmp_path):
    """Images of beams 2 and 1 interleaved (each beam's frames out of time order): one series per
    beam in beam-number order, each in its own time order, holding only its own files."""
    paths = []
    for index, (beam, second) in enumerate([(2, 3), (1, 1), (2, 1), (1, 0), (2, 2)]):
        image = small(beam=beam, instance=index + 1, gantry_deg=10.0 * index,
                      acquired=f"20261126101500.{second * 100000:06d}")
        paths.append(str(save(image, tmp_path / f"image_{index}.dcm")))
    series = read_beam_series(paths)
    assert [item.beam_number for item in series] == [1, 2]
    assert [Path(source).name for source in series[0].sources] == ["image_3.dcm", "image_1.dcm"]
    assert [Path(source).name for source in series[1].sources] == ["image_2.dcm", "image_4.dcm", "image_0.dcm"]
    np.testing.assert_allclose(series[1].gantry_deg, [20.0, 40.0, 0.0])
    np.testing.assert_allclose(series[1].time_s, [0.0, 0.1, 0.2], atol=1e-6)
    one = read_beam_series(paths[1::2] + [str(save(small(beam=None, instance=9), tmp_path / "bare.dcm"))])
    assert len(one) == 1 and one[0].beam_number == 1 and len(one[0]) == 3, "an image naming no beam joins the one"
    with pytest.raises(ImageError) as error:
        read_beam_series([*paths, str(tmp_path / "bare.dcm")])
    assert_one_line(error, "bare.dcm", "names no beam", "beams 1, 2")


@pytest.mark.parametrize("case", ["no spacing", "no sid", "two beams", "mixed references", "empty folder",
                                  "no match"])
def test_bad_series_give_one_line_naming_the_file(tmp_path, case):
    paths = []
    if case in ("no spacing", "no sid"):
        image = small()
        del image[("ImagePlanePixelSpacing" if case == "no spacing" else "RTImageSID")]
        paths = [save(image, tmp_path / "bad.dcm")]
        expected = ("bad.dcm", "ImagePlanePixelSpacing" if case == "no spacing" else "RTImageSID")
    elif case == "two beams":
        paths = [save(small(beam=1), tmp_path / "one.dcm"), save(small(beam=2, instance=2), tmp_path / "two.dcm")]
        expected = ("two.dcm", "beam 2", "one.dcm", "beam 1")
    elif case == "mixed references":
        named = small()
        item = Dataset()
        item.ReferencedControlPointIndex = 3
        named.ExposureSequence = Sequence([item])
        paths = [save(named, tmp_path / "named.dcm"), save(small(instance=2), tmp_path / "bare.dcm")]
        expected = ("bare.dcm", "without a control-point reference")
    elif case == "empty folder":
        (tmp_path / "empty").mkdir()
        paths = [tmp_path / "empty"]
        expected = ("empty", "a folder without files")
    else:
        paths = [str(tmp_path / "*.dcm")]
        expected = ("*.dcm", "no file matches")
    with pytest.raises(ImageError) as error:
        read_series([str(p) for p in paths])
    assert_one_line(error, *expected)


# --------------------------------------------------------------------------- dark offset and flood-field gain


def raw_image(pixels: np.ndarray, slope: float = 0.05, **geometry) -> Dataset:
    """A ``panel_image`` geometry holding ``pixels`` (rows, columns) in units of ``slope``."""
    dataset = panel_image(*FIELD, rows=pixels.shape[0], columns=pixels.shape[1], **geometry)
    dataset.RescaleSlope = f"{slope:g}"
    dataset.PixelData = np.rint(pixels / slope).astype(np.uint16).tobytes()
    return dataset


PANEL = {"pitch_mm": 2.0, "sid_mm": 1500.0, "translation": (4.0, -2.0)}


def test_a_panels_dark_offset_and_flood_gain_come_out_pixel_by_pixel_before_resampling(tmp_path):
    # a 160 x 128 panel whose pixels each have their own gain (0.8 to 1.2) and dark offset (40 to 60):
    # the field's frame, the flood field (flat, 2000) and the dark as the panel records them
    field = panel_image(*FIELD, rows=160, columns=128, **PANEL)
    signal = np.frombuffer(field.PixelData, dtype=np.uint16).reshape(160, 128).astype(np.float64)
    rng = np.random.default_rng(7)
    gain, dark = 0.8 + 0.4 * rng.random(signal.shape), 40.0 + 20.0 * rng.random(signal.shape)
    paths = {name: save(raw_image(pixels, **PANEL), tmp_path / f"{name}.dcm") for name, pixels in (
        ("frame", gain * signal + dark), ("flood", gain * 2000.0 + dark), ("dark", dark))}
    centre = gain[72:88, 58:70].mean()  # the central tenth of the rows and columns: the flood's unit gain
    truth = read_series(save(raw_image(signal * centre, **PANEL), tmp_path / "truth.dcm")).frames[0]
    correction = panel_correction(paths["dark"], paths["flood"])
    assert correction.sources == {"dark": [str(paths["dark"])], "flood": [str(paths["flood"])]}
    corrected = read_series(paths["frame"], correction).frames[0]
    np.testing.assert_allclose(corrected, truth, atol=2e-3 * truth.max())
    raw = read_series(paths["frame"]).frames[0]
    assert np.abs(raw - truth).max() > 0.05 * truth.max(), "the uncorrected frame is another image"
    # the dark alone: the offset out, the gain left in
    dark_only = read_series(paths["frame"], panel_correction(paths["dark"], None)).frames[0]
    gained = read_series(save(raw_image(gain * signal, **PANEL), tmp_path / "gained.dcm")).frames[0]
    np.testing.assert_allclose(dark_only, gained, atol=2e-3 * gained.max())


@pytest.mark.parametrize("case", ["uncovered flood", "other panel", "dark and flood differ"])
def test_bad_dark_and_flood_images_give_one_line_naming_the_file(tmp_path, case):
    flat = np.full((64, 64), 1000.0)
    frame = save(raw_image(flat, pitch_mm=4.0, sid_mm=1000.0), tmp_path / "frame.dcm")
    dark = save(raw_image(flat * 0.05, pitch_mm=4.0, sid_mm=1000.0), tmp_path / "dark.dcm")
    if case == "uncovered flood":
        flood = flat.copy()
        flood[:, :6] = 100.0  # the field's edge on the panel: its last columns see a tenth of the centre
        given, expected = (dark, save(raw_image(flood, pitch_mm=4.0, sid_mm=1000.0), tmp_path / "flood.dcm")), \
            ("flood.dcm", "384 of 4096 flood-image pixels", "covers the whole panel")
    elif case == "other panel":
        given = (save(raw_image(np.full((32, 32), 50.0), pitch_mm=8.0, sid_mm=1000.0), tmp_path / "small.dcm"), None)
        expected = ("frame.dcm", "64 x 64 pixels", "32 x 32")
    else:
        given = (dark, save(raw_image(np.full((32, 32), 900.0), pitch_mm=8.0, sid_mm=1000.0), tmp_path / "flood.dcm"))
        expected = ("flood.dcm", "32 x 32", "dark.dcm", "64 x 64")
    with pytest.raises(ImageError) as error:
        read_series(frame, panel_correction(*given))
    assert_one_line(error, *expected)
