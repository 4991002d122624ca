"""Aperture masks, convolution and EPID frames, against slow references and scipy."""

import math

import numpy as np
import pytest
import scipy.signal
import torch

from epid.synthesis import frames as frames_module
from epid.synthesis.fluence import rasterize
from epid.synthesis.frames import FrameRenderer, convolve, frame_noise_seed, render_frames, renderer_for
from epid.synthesis.kernel import default_kernel
from epid.synthesis.sequences import ControlPoints, generate_control_points


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Small tensor operations wait on busy cores with several intra-op threads; results do not
    depend on the thread count, so these checks run on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_mask(leaf_a, leaf_b, jaw_1, jaw_2) -> np.ndarray:
    """Pixel-by-pixel mask in the final orientation (row 0 = most positive y)."""
    mask = np.zeros((256, 256))
    for row in range(256):
        y = row - 128 + 0.5
        if not math.floor(jaw_1) <= y < math.ceil(jaw_2):
            continue
        leaf = math.floor((y + 130) / 5)
        for col in range(256):
            x = col - 128 + 0.5
            if math.floor(leaf_a[leaf]) <= x < math.ceil(leaf_b[leaf]):
                mask[row, col] = 1.0
    return mask[::-1]


def reference_area(leaf_a, leaf_b, jaw_1, jaw_2) -> float:
    """Open area in pixels: per leaf, clipped floor/ceil width times the height of its band."""
    area = 0.0
    for leaf in range(52):
        bottom = max(-130 + 5 * leaf, math.floor(jaw_1), -128)
        top = min(-125 + 5 * leaf, math.ceil(jaw_2), 128)
        left = max(math.floor(leaf_a[leaf]), -128)
        right = min(math.ceil(leaf_b[leaf]), 128)
        area += max(top - bottom, 0) * max(right - left, 0)
    return area


def random_apertures(count: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    leaf_a = rng.uniform(-140, 100, size=(count, 52))
    leaf_b = leaf_a + rng.uniform(0, 80, size=(count, 52))
    jaw_1 = rng.uniform(-140, 60, size=count)
    jaw_2 = jaw_1 + rng.uniform(0, 120, size=count)
    # at least 5 um from a whole millimetre, where floor and ceil are unambiguous
    return tuple(np.round(v, 2) + 0.005 for v in (leaf_a, leaf_b, jaw_1, jaw_2))


def uniform_aperture(a: float, b: float, jaw_1: float, jaw_2: float) -> tuple[np.ndarray, ...]:
    return np.full(52, a), np.full(52, b), np.float64(jaw_1), np.float64(jaw_2)


def test_hand_worked_aperture():
    mask = rasterize(*uniform_aperture(-10.3, 10.2, 0.5, 19.2)).numpy()
    expected = np.zeros((256, 256))
    # x in [-11, 11) -> columns 117..138; y in [0, 20) -> unflipped rows 128..147 -> rows 108..127
    expected[108:128, 117:139] = 1.0
    np.testing.assert_array_equal(mask, expected)


def test_field_at_positive_y_lights_the_top_rows():
    mask = rasterize(*uniform_aperture(-50, 50, 10, 60)).numpy()
    lit_rows = np.flatnonzero(mask.any(axis=1))
    assert lit_rows.min() == 128 - 60 and lit_rows.max() == 127 - 10
    assert not mask[128:].any()


def test_single_leaf_pair_opens_its_five_rows():
    leaf_a, leaf_b = np.zeros(52), np.zeros(52)
    leaf_a[26], leaf_b[26] = -3.0, 4.0  # leaf 26 covers y in [0, 5)
    mask = rasterize(leaf_a, leaf_b, -130.0, 130.0).numpy()
    rows, cols = np.nonzero(mask)
    assert set(rows) == {123, 124, 125, 126, 127}
    assert set(cols) == set(range(125, 132))


def test_edge_leaves_are_partly_outside_the_imager():
    leaf_a, leaf_b = np.zeros(52), np.zeros(52)
    leaf_a[[0, 51]], leaf_b[[0, 51]] = -1.0, 1.0
    mask = rasterize(leaf_a, leaf_b, -130.0, 130.0).numpy()
    assert set(np.flatnonzero(mask.any(axis=1))) == {0, 1, 2, 253, 254, 255}


def test_jaws_and_leaves_beyond_the_imager_are_clipped():
    assert rasterize(*uniform_aperture(-200, 200, -200, 200)).sum() == 256 * 256
    assert rasterize(*uniform_aperture(-200, 200, 130, 200)).sum() == 0
    assert rasterize(*uniform_aperture(150, 200, -200, 200)).sum() == 0


def test_jaws_cut_the_leaf_field():
    full = rasterize(*uniform_aperture(-20, 20, -130, 130)).numpy()
    cut = rasterize(*uniform_aperture(-20, 20, -7.5, 12.1)).numpy()
    rows = np.flatnonzero(cut.any(axis=1))
    # y in [-8, 13) -> unflipped rows 120..140 -> rows 115..135
    assert rows.min() == 115 and rows.max() == 135
    np.testing.assert_array_equal(cut[115:136], full[115:136])


def test_closed_or_crossed_leaves_are_dark():
    assert rasterize(*uniform_aperture(5.0, 5.0, -50, 50)).sum() == 0
    assert rasterize(*uniform_aperture(10.0, -10.0, -50, 50)).sum() == 0


def test_random_apertures_match_the_pixel_reference():
    leaf_a, leaf_b, jaw_1, jaw_2 = random_apertures(3, seed=1)
    masks = rasterize(leaf_a, leaf_b, jaw_1, jaw_2).numpy()
    for i in range(3):
        np.testing.assert_array_equal(masks[i], reference_mask(leaf_a[i], leaf_b[i], jaw_1[i], jaw_2[i]))


def test_open_area_is_the_sum_of_clipped_leaf_widths_times_band_heights():
    leaf_a, leaf_b, jaw_1, jaw_2 = random_apertures(40, seed=2)
    masks = rasterize(torch.from_numpy(leaf_a), torch.from_numpy(leaf_b), jaw_1, jaw_2)
    assert masks.dtype == torch.float32 and set(masks.unique().tolist()) <= {0.0, 1.0}
    for i in range(40):
        assert masks[i].sum().item() == reference_area(leaf_a[i], leaf_b[i], jaw_1[i], jaw_2[i])


def test_control_point_apertures_match_the_area_reference():
    cp = generate_control_points(500, 30)
    masks = rasterize(cp.leaf_a, cp.leaf_b, cp.jaw_1, cp.jaw_2)
    for n in range(30):
        assert masks[n].sum().item() == reference_area(cp.leaf_a[n], cp.leaf_b[n], cp.jaw_1[n], cp.jaw_2[n])


def test_rasterize_broadcasts_batch_shapes_and_follows_tensor_inputs():
    leaf_a, leaf_b, jaw_1, jaw_2 = random_apertures(6, seed=4)
    batched = rasterize(leaf_a.reshape(2, 3, 52), leaf_b.reshape(2, 3, 52), jaw_1.reshape(2, 3), jaw_2.reshape(2, 3))
    assert batched.shape == (2, 3, 256, 256)
    singles = torch.stack([rasterize(leaf_a[i], leaf_b[i], jaw_1[i], jaw_2[i]) for i in range(6)])
    torch.testing.assert_close(batched.reshape(6, 256, 256), singles, rtol=0, atol=0)
    shared_jaws = rasterize(leaf_a, leaf_b, -20.0, 20.0)
    assert shared_jaws.shape == (6, 256, 256)
    assert isinstance(rasterize(torch.from_numpy(leaf_a[0]), leaf_b[0], 0.0, 10.0), torch.Tensor)


def test_positions_a_hair_off_a_whole_millimetre_do_not_open_a_pixel_column():
    exact = rasterize(*uniform_aperture(-10.0, 10.0, -10.0, 10.0))
    wobbly = rasterize(*uniform_aperture(-10.0 + 1e-9, 10.0 + 1e-9, -10.0 - 1e-9, 10.0 + 1e-9))
    torch.testing.assert_close(exact, wobbly, rtol=0, atol=0)


def scipy_same(images: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    return np.stack([scipy.signal.fftconvolve(image, kernel, mode="same") for image in images])


def assert_close_to_max(result: torch.Tensor, reference: np.ndarray, fraction: float = 1e-4) -> None:
    error = np.abs(result.numpy().astype(np.float64) - reference).max()
    assert error <= fraction * np.abs(reference).max()


def test_convolution_with_the_default_kernel_matches_scipy():
    leaf_a, leaf_b, jaw_1, jaw_2 = random_apertures(3, seed=7)
    images = rasterize(leaf_a, leaf_b, jaw_1, jaw_2).numpy() * np.array([1.0, 3.5, 7.0])[:, None, None]
    assert renderer_for(default_kernel()).method == "separable"
    assert_close_to_max(convolve(images, default_kernel()), scipy_same(images, default_kernel()))


@pytest.mark.parametrize(
    ("shape", "rank"),
    [((31, 31), 2), ((41, 25), None), ((20, 33), None), ((301, 301), 1)],
)
def test_convolution_with_other_kernels_matches_scipy(shape, rank):
    rng = np.random.default_rng(sum(shape))
    if rank is None:
        kernel = rng.random(shape)
    else:
        kernel = sum(np.outer(rng.random(shape[0]), rng.random(shape[1])) for _ in range(rank))
    images = rng.random((2, 256, 256)) * (rng.random((2, 256, 256)) > 0.5)
    assert renderer_for(kernel).method == ("fft" if rank is None else "separable")
    assert_close_to_max(convolve(images, kernel), scipy_same(images, kernel))
    assert_close_to_max(convolve(torch.from_numpy(images), torch.from_numpy(kernel)), scipy_same(images, kernel))


def test_convolution_of_other_image_sizes_matches_scipy():
    rng = np.random.default_rng(11)
    images = rng.random((2, 60, 90))
    for kernel in (default_kernel(), rng.random((15, 9))):
        assert_close_to_max(convolve(images, kernel), scipy_same(images, kernel))


def reference_frame(cp: ControlPoints, frame: int, kernel: np.ndarray) -> np.ndarray:
    """Sum of 7 interpolated sub-aperture masks, convolved by scipy, times MU / 7."""
    masks = np.zeros((256, 256))
    for t in np.arange(7) / 6:
        at = [
            v[frame - 1].astype(np.float64) + t * (v[frame].astype(np.float64) - v[frame - 1])
            for v in (cp.leaf_a, cp.leaf_b, cp.jaw_1, cp.jaw_2)
        ]
        masks += rasterize(*at).numpy()
    return scipy.signal.fftconvolve(masks, kernel, mode="same") * cp.mu[frame] / 7


@pytest.fixture(scope="module")
def control_points() -> ControlPoints:
    return generate_control_points(200, 80)


def test_noiseless_frames_match_the_reference_pipeline(control_points):
    frames = [1, 17, 40, 79]
    rendered = render_frames(control_points, frames, default_kernel(), dataset_id=200, noise_std=0.0)
    assert rendered.shape == (4, 256, 256) and rendered.dtype == torch.float32
    for image, frame in zip(rendered, frames, strict=True):
        assert_close_to_max(image, reference_frame(control_points, frame, default_kernel()))


def test_hd120_frames_on_the_fine_strips_match_the_reference_pipeline():
    """The separable renderer's bags over rows of 0.5 mm, two to a pixel row, against the scipy
    pipeline on ``rasterize``'s masks (which an independent 0.1 mm rasterisation checks)."""
    from epid.synthesis.mlc import MLC_GEOMETRIES

    arc = generate_control_points(166, 60, MLC_GEOMETRIES["hd120"])
    assert arc.leaf_a.shape == (60, 104) and arc.leaf_weight.shape == (60, 104)
    frames = [1, 23, 59]
    rendered = render_frames(arc, frames, default_kernel(), dataset_id=166, noise_std=0.0)
    for image, frame in zip(rendered, frames, strict=True):
        assert_close_to_max(image, reference_frame(arc, frame, default_kernel()))


def test_frame_integral_is_mu_over_seven_times_the_sub_aperture_areas():
    rng = np.random.default_rng(12)
    kernel = rng.random((9, 9))
    n = 6
    leaf_a = np.tile(rng.uniform(-40, -5, size=(n, 1)), (1, 52)).astype(np.float32)
    leaf_b = (leaf_a + rng.uniform(10, 40, size=(n, 1))).astype(np.float32)
    cp = ControlPoints(
        leaf_a=leaf_a,
        leaf_b=leaf_b,
        jaw_1=rng.uniform(-60, -10, size=n).astype(np.float32),
        jaw_2=rng.uniform(10, 60, size=n).astype(np.float32),
        mu=rng.uniform(1, 40, size=n).astype(np.float32),
        leaf_weight=np.ones((n, 52), np.float32),
        dataset_id=0,
        pattern="regular",
    )
    rendered = render_frames(cp, range(1, n), kernel, dataset_id=0, noise_std=0.0)
    for image, frame in zip(rendered, range(1, n), strict=True):
        areas = 0.0
        for t in np.arange(7) / 6:
            at = [
                v[frame - 1].astype(np.float64) + t * (v[frame].astype(np.float64) - v[frame - 1])
                for v in (cp.leaf_a, cp.leaf_b, cp.jaw_1, cp.jaw_2)
            ]
            areas += reference_area(*at)
        expected = cp.mu[frame] / 7 * areas * kernel.sum()
        assert image.double().sum().item() == pytest.approx(expected, rel=1e-5)


def test_noise_std_is_noise_std_times_mu_over_root_seven(control_points):
    frames = [3, 30, 60]
    clean = render_frames(control_points, frames, default_kernel(), dataset_id=200, noise_std=0.0)
    noisy = render_frames(control_points, frames, default_kernel(), dataset_id=200, noise_std=0.02)
    for residual, frame in zip(noisy - clean, frames, strict=True):
        expected = 0.02 * float(control_points.mu[frame]) / math.sqrt(7)
        # 65536 samples: the standard error of the std is std / sqrt(2 * 65536), about 0.3 %
        assert residual.std().item() == pytest.approx(expected, rel=0.015)
        assert abs(residual.mean().item()) < 5 * expected / 256


def test_a_frame_is_identical_in_any_batch(control_points):
    kernel = default_kernel()

    def render(frames):
        return render_frames(control_points, frames, kernel, dataset_id=200, noise_std=0.005, noise_seed=7)

    def assert_same_frame(first, second):
        # the noise (std >= 0.005 / sqrt(7) here) must match exactly; the convolution may
        # differ by float32 round-off when a batch spans more rows of the leaf grid
        torch.testing.assert_close(first, second, rtol=0, atol=1e-6 * float(second.abs().max()))

    alone = render([20])[0]
    assert_same_frame(render([19, 20])[1], alone)
    assert_same_frame(render([20, 21])[0], alone)
    long_run = render(np.arange(1, 80))
    assert_same_frame(long_run[19], alone)
    chunk = frames_module.CHUNK_FRAMES["cpu"]
    for frame in (chunk, chunk + 1, 79):  # either side of a chunk boundary, and the last frame
        assert_same_frame(long_run[frame - 1], render([frame])[0])


def test_noise_depends_on_seed_dataset_and_frame(control_points):
    kernel = default_kernel()

    def residual(frame, dataset_id=200, noise_seed=0):
        noisy = render_frames(control_points, [frame], kernel, dataset_id=dataset_id, noise_seed=noise_seed)
        return noisy - render_frames(control_points, [frame], kernel, dataset_id=dataset_id, noise_std=0.0)

    base = residual(10)
    torch.testing.assert_close(residual(10), base, rtol=0, atol=0)
    for other in (residual(10, dataset_id=201), residual(10, noise_seed=1)):
        assert abs(np.corrcoef(base.flatten(), other.flatten())[0, 1]) < 0.02
    seeds = {frame_noise_seed(s, d, f) for s in range(3) for d in range(3) for f in range(1, 4)}
    assert len(seeds) == 27 and all(0 <= seed < 2**63 for seed in seeds)


def test_frames_ignore_the_callers_precision_settings(control_points):
    kernel = default_kernel()
    expected = render_frames(control_points, [5, 6], kernel, dataset_id=200)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rendered = render_frames(control_points, [5, 6], kernel, dataset_id=200)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    assert rendered.dtype == torch.float32
    torch.testing.assert_close(rendered, expected, rtol=0, atol=0)


def test_kernel_forms_and_renderer_reuse(control_points):
    kernel = default_kernel()
    renderer = renderer_for(kernel, "cpu")
    assert renderer_for(kernel.copy()) is renderer
    assert renderer_for(torch.from_numpy(kernel)) is renderer
    expected = render_frames(control_points, [8], kernel, dataset_id=200)
    torch.testing.assert_close(render_frames(control_points, [8], renderer, dataset_id=200), expected)
    torch.testing.assert_close(
        render_frames(control_points, [8], torch.from_numpy(kernel).float(), dataset_id=200),
        expected,
        rtol=1e-5,
        atol=1e-6,
    )
    fft = FrameRenderer(np.random.default_rng(0).random((5, 5)))
    assert fft.method == "fft"
    assert fft.render(control_points, [8, 9], dataset_id=200).shape == (2, 256, 256)


@pytest.mark.parametrize("frames", [[0], [80], [1, 2, 80], [[1, 2]], [1.0]])
def test_frame_indices_outside_1_to_n_minus_1_are_rejected(control_points, frames):
    with pytest.raises(ValueError):
        render_frames(control_points, frames, default_kernel(), dataset_id=200)


def test_an_empty_frame_list_gives_an_empty_batch(control_points):
    assert render_frames(control_points, [], default_kernel(), dataset_id=200).shape == (0, 256, 256)


def test_x_jaws_multiply_their_transmission_into_the_fluence_as_a_tenth_of_a_millimetre_grid_does():
    """A static aperture under Y and X jaws: each 1 mm cell's fluence is the mean over a 0.1 mm grid of
    the product of the Y jaws', the leaves' and the X jaws' transmission, t + (1 - t) x open."""
    from epid.synthesis.fluence import aperture_fluence

    rng = np.random.default_rng(4)
    leaf_a = rng.integers(-600, 0, 52) / 10
    leaf_b = leaf_a + rng.integers(0, 900, 52) / 10
    jaw_1, jaw_2, x1, x2 = -71.3, 88.6, -25.4, 47.7
    leaf_t, jaw_t = 0.015, 0.004
    step = 0.1
    y = -130.0 + step * (np.arange(2600) + 0.5)  # ascending, the leaf grid's rows
    x = -128.0 + step * (np.arange(2560) + 0.5)
    strip = np.clip(((y + 130.0) // 5).astype(int), 0, 51)
    leaf_open = (x[None] >= leaf_a[strip][:, None]) & (x[None] < leaf_b[strip][:, None])
    y_open = (y >= jaw_1) & (y < jaw_2)
    x_open = (x >= x1) & (x < x2)

    def passed(t, is_open):
        return t + (1 - t) * is_open

    fine = passed(jaw_t, y_open)[:, None] * passed(leaf_t, leaf_open) * passed(jaw_t, x_open)[None]
    expected = fine.reshape(260, 10, 256, 10).mean(axis=(1, 3))
    sub = 7

    def moving(values):
        return torch.tensor(values, dtype=torch.float32).expand(1, sub, *np.shape(values))

    fluence = aperture_fluence(moving(leaf_a), moving(leaf_b), moving(jaw_1), moving(jaw_2),
                               torch.full((1, sub), 1.0 / sub), leaf_transmission=leaf_t, jaw_transmission=jaw_t,
                               x_jaws=(moving(x1), moving(x2)))[0].numpy()
    np.testing.assert_allclose(fluence, expected, atol=1e-5)  # float32 sums of the 7 sub-apertures
    without = aperture_fluence(moving(leaf_a), moving(leaf_b), moving(jaw_1), moving(jaw_2),
                               torch.full((1, sub), 1.0 / sub), leaf_transmission=leaf_t, jaw_transmission=jaw_t)
    assert np.abs(without[0].numpy() - expected).max() > 0.5, "without the X jaws the leaves alone shape the field"
