"""The EPID response kernel: the default model, the radial one and MATLAB .mat loading."""

from pathlib import Path

import numpy as np
import pytest
import scipy.io

from bench import kernel_family as kernel_family_bench
from bench import radial_kernel as radial_kernel_bench
from epid.core.errors import InputError
from epid.synthesis.kernel import (
    RESPONSE_FAMILY,
    KernelError,
    ResponseShape,
    default_kernel,
    kernel_figures,
    kernel_from_config,
    load_kernel,
    radial_kernel,
    response_kernel,
)


def test_default_kernel_is_odd_normalised_symmetric_and_peaked():
    kernel = default_kernel()
    assert kernel.shape == (261, 261)
    assert kernel.dtype == np.float64
    assert kernel.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(kernel, kernel.T, rtol=0, atol=1e-18)
    np.testing.assert_allclose(kernel, kernel[::-1, ::-1], rtol=0, atol=1e-18)
    assert np.unravel_index(np.argmax(kernel), kernel.shape) == (130, 130)
    assert (kernel > 0).all()


def test_default_kernel_profile_is_the_gaussian_lorentzian_mixture():
    x = np.arange(-130, 131, dtype=np.float64)
    gaussian = np.exp(-(x**2) / (2 * 2.183**2))
    lorentzian = 12.84**2 / (x**2 + 12.84**2)
    profile = 0.7831 * gaussian / gaussian.sum() + 0.2169 * lorentzian / lorentzian.sum()
    np.testing.assert_allclose(default_kernel(), np.outer(profile, profile), rtol=1e-12, atol=0)


def test_default_kernel_is_separable():
    kernel = default_kernel()
    # a non-negative rank-1 matrix is the outer product of its row and column sums over its total
    np.testing.assert_allclose(kernel, np.outer(kernel.sum(1), kernel.sum(0)) / kernel.sum(), rtol=1e-12)


def test_radial_kernel_is_normalised_symmetric_under_rotation_and_not_separable():
    kernel = radial_kernel()
    assert kernel.shape == (261, 261) and kernel.dtype == np.float64
    assert kernel.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(kernel, kernel.T, rtol=1e-12, atol=0)
    np.testing.assert_allclose(kernel, np.rot90(kernel), rtol=1e-12, atol=0)
    singular = np.linalg.svd(kernel, compute_uv=False)
    assert 0.05 <= singular[1] / singular[0] <= 0.08  # a measured kernel's: 6.3 %
    radius = np.hypot(*np.meshgrid(np.arange(261) - 130, np.arange(261) - 130))
    assert np.all(np.diff([kernel[radius == r].mean() for r in (0, 5, 10, 20, 40)]) < 0)  # falls off with r


def test_the_radial_kernel_bench_writes_what_load_kernel_reads_back(tmp_path, capsys):
    path = tmp_path / "radial.mat"
    assert radial_kernel_bench.main([str(path), "--size", "61"]) == 0
    np.testing.assert_allclose(load_kernel(path), radial_kernel(61), rtol=1e-12, atol=0)
    assert set(scipy.io.loadmat(path)) >= {"kernel"}
    assert "61 x 61, sum 1.000000" in capsys.readouterr().out


def test_kernel_figures_of_a_gaussian_match_its_closed_forms():
    sigma = 4.0
    x_mm = np.arange(-60, 61, dtype=np.float64)
    profile = np.exp(-0.5 * (x_mm / sigma) ** 2)
    figures = kernel_figures(np.outer(profile, profile) / profile.sum() ** 2)
    assert figures.fwhm_x_mm == pytest.approx(2 * np.sqrt(2 * np.log(2)) * sigma, abs=0.1)
    assert figures.fwhm_y_mm == pytest.approx(figures.fwhm_x_mm)
    for radius, share in zip(figures.energy_radii_mm, (0.5, 0.8, 0.9, 0.99), strict=True):
        # the energy of a 2-D Gaussian within r is 1 - exp(-r^2 / 2 sigma^2); radii lie on the 1 mm lattice
        assert radius == pytest.approx(sigma * np.sqrt(-2 * np.log(1 - share)), abs=1.0)
    assert figures.singular_ratio < 1e-12


def test_the_response_family_spans_sharp_to_broad_and_one_elongated():
    np.testing.assert_array_equal(response_kernel(ResponseShape(), 61), radial_kernel(61))
    figures = {name: kernel_figures(response_kernel(shape)) for name, shape in RESPONSE_FAMILY.items()}
    assert figures["sharp"].fwhm_x_mm == pytest.approx(2.0, abs=0.3)
    assert 55 <= figures["sharp"].energy_radii_mm[3] <= 65
    assert figures["broad"].fwhm_x_mm == pytest.approx(12.0, abs=0.5)  # a measured panel's response
    assert figures["broad"].energy_radii_mm[2] == pytest.approx(32.0, abs=1.5)
    assert figures["broadest"].fwhm_x_mm == pytest.approx(16.0, abs=0.5)
    assert figures["broadest"].energy_radii_mm[3] <= 130
    assert figures["elongated"].fwhm_y_mm > 1.3 * figures["elongated"].fwhm_x_mm
    for name, kernel_figure in figures.items():
        assert 0.03 < kernel_figure.singular_ratio < 0.1, name  # not separable, as measured kernels are not
        assert response_kernel(RESPONSE_FAMILY[name], 31).sum() == pytest.approx(1.0)


def test_the_kernel_family_bench_writes_every_kernel(tmp_path, capsys):
    assert kernel_family_bench.main([str(tmp_path / "kernels"), "--size", "61"]) == 0
    for name, shape in RESPONSE_FAMILY.items():
        np.testing.assert_allclose(load_kernel(tmp_path / "kernels" / f"{name}.mat"), response_kernel(shape, 61),
                                   rtol=1e-12, atol=0)
    assert "broad.mat" in capsys.readouterr().out


def _save(path: Path, **variables) -> Path:
    scipy.io.savemat(path, variables)
    return path


def test_mat_round_trip_normalises_to_sum_one(tmp_path):
    rng = np.random.default_rng(3)
    measured = rng.random((31, 27)) * 5.0
    path = _save(tmp_path / "kernel.mat", psf=measured)
    loaded = load_kernel(path)
    np.testing.assert_allclose(loaded, measured / measured.sum(), rtol=1e-12)
    assert loaded.sum() == pytest.approx(1.0)


def test_named_variable_is_chosen_among_several(tmp_path):
    path = _save(tmp_path / "k.mat", first=np.ones((3, 3)), second=np.arange(25.0).reshape(5, 5) + 1)
    loaded = load_kernel(path, "second")
    assert loaded.shape == (5, 5)
    np.testing.assert_allclose(loaded, (np.arange(25.0).reshape(5, 5) + 1) / 325.0)


def test_single_matrix_is_found_beside_scalars_and_vectors(tmp_path):
    path = _save(tmp_path / "k.mat", pixel_mm=1.0, profile=np.ones(9), kernel=np.ones((5, 5)))
    assert load_kernel(path).shape == (5, 5)


def test_kernel_from_config(tmp_path):
    np.testing.assert_array_equal(kernel_from_config("", None), default_kernel())
    path = _save(tmp_path / "k.mat", a=np.ones((3, 3)), b=np.full((5, 5), 2.0))
    np.testing.assert_allclose(kernel_from_config(str(path), "b"), np.full((5, 5), 1 / 25))


def test_even_axes_are_resampled_onto_the_pixel_centred_grid(tmp_path):
    rng = np.random.default_rng(5)
    measured = rng.random((6, 8)) + 0.1
    loaded = load_kernel(_save(tmp_path / "even.mat", k=measured))
    assert loaded.shape == (7, 9)
    assert loaded.sum() == pytest.approx(1.0)
    rows, cols = np.indices(measured.shape)
    centroid = (
        ((rows - 2.5) * measured).sum() / measured.sum(),
        ((cols - 3.5) * measured).sum() / measured.sum(),
    )
    new_rows, new_cols = np.indices(loaded.shape)
    assert ((new_rows - 3) * loaded).sum() == pytest.approx(centroid[0])
    assert ((new_cols - 4) * loaded).sum() == pytest.approx(centroid[1])


def _v73_file(directory: Path) -> Path:
    path = directory / "hdf5.mat"
    header = b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: Mon Jan  5 10:00:00 2026 HDF5 schema 1.00 ."
    path.write_bytes(header.ljust(116, b" ") + b"\x00" * 8 + b"\x00\x02" + b"IM" + b"\x00" * 512)
    return path


def _text_file(path: Path) -> Path:
    path.write_text("not a kernel\n")
    return path


@pytest.mark.parametrize(
    ("make", "variable", "expected"),
    [
        (lambda d: d / "missing.mat", None, "does not exist"),
        (lambda d: _text_file(d / "notes.mat"), None, "not a readable"),
        (_v73_file, None, "v7.3"),
        (lambda d: _save(d / "k.mat", a=np.ones((3, 3))), "b", "no variable 'b'"),
        (lambda d: _save(d / "k.mat", a=np.ones((3, 3)), b=np.ones((5, 5))), None, "several 2-D arrays"),
        (lambda d: _save(d / "k.mat", scale=2.0), None, "no 2-D numeric array"),
        (lambda d: _save(d / "k.mat", k=np.ones((3, 3, 3))), "k", "shape (3, 3, 3)"),
        (lambda d: _save(d / "k.mat", k=np.array([[1.0, np.nan], [1.0, 1.0]])), None, "non-finite"),
        (lambda d: _save(d / "k.mat", k=np.array([[1.0, np.inf], [1.0, 1.0]])), None, "non-finite"),
        (lambda d: _save(d / "k.mat", k=np.zeros((3, 3))), None, "sums to 0"),
        (lambda d: _save(d / "k.mat", k=-np.ones((3, 3))), None, "sums to -9"),
        (lambda d: _save(d / "k.mat", k=np.ones((3, 3)) * 1j), "k", "real numeric"),
        (lambda d: _save(d / "k.mat", k="gaussian"), "k", "real numeric"),
    ],
)
def test_bad_kernel_files_are_rejected_naming_the_file(tmp_path, make, variable, expected):
    path = make(tmp_path)
    with pytest.raises(KernelError) as caught:
        load_kernel(path, variable)
    message = str(caught.value)
    assert str(path) in message
    assert expected in message
    assert "\n" not in message
    if variable is not None and expected != "does not exist":
        assert repr(variable) in message


def test_kernel_error_is_an_input_error():
    assert issubclass(KernelError, InputError)
    assert issubclass(KernelError, ValueError)
