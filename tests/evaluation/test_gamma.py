"""Gamma index: hand-worked cases, batching, and agreement with pymedphys.gamma."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter, maximum_filter, minimum_filter, shift

from epid.evaluation import gamma_search
from epid.evaluation.gamma import (
    GammaCriteria,
    gamma_index,
    gamma_maps,
    gamma_pass_rate,
    gamma_pass_rates,
    release_workspaces,
)


def epid_like_field(rng: np.random.Generator, height: int = 64, width: int = 80) -> np.ndarray:
    """MLC-shaped aperture (leaf pairs 5 mm wide) blurred like an EPID response, x MU."""
    aperture = np.zeros((height, width))
    top = rng.integers(8, height // 2 - 4)
    bottom = rng.integers(height // 2 + 4, height - 8)
    for first_row in range(top, bottom, 5):
        leaf_a = rng.integers(8, width // 2 - 3)
        leaf_b = rng.integers(width // 2 + 3, width - 8)
        aperture[first_row : min(first_row + 5, bottom), leaf_a:leaf_b] = 1.0
    field = 0.8 * gaussian_filter(aperture, 2.2) + 0.2 * gaussian_filter(aperture, 8.0)
    return field * rng.uniform(5.0, 40.0)


def blurred_rectangle(
    height: int = 64, width: int = 64, field_mm: tuple[int, int] = (30, 40), sigma: float = 2.5
) -> np.ndarray:
    """An open field (rows x columns, mm) with Gaussian penumbrae, maximum close to 100."""
    aperture = np.zeros((height, width))
    top, left = (height - field_mm[0]) // 2, (width - field_mm[1]) // 2
    aperture[top : top + field_mm[0], left : left + field_mm[1]] = 100.0
    return gaussian_filter(aperture, sigma)


def test_identical_images_pass_everywhere():
    reference = epid_like_field(np.random.default_rng(0))
    gamma = gamma_index(reference, reference)
    counted = ~torch.isnan(gamma)
    assert gamma.dtype == torch.float32
    assert counted.any()
    assert torch.all(gamma[counted] == 0)
    assert gamma_pass_rate(gamma).item() == 100.0


def test_ramp_shifted_by_1_mm_matches_the_hand_worked_gamma():
    # Reference rising 4 % of the normalisation per mm down the rows; the evaluated
    # image is it shifted by +1 mm along the rows, E(r) = R(r - 1) = R(r) - 4.
    # Bilinear interpolation of a linear ramp is exact, so at offset o the dose
    # difference is 4 (o_row - 1) and, minimised over o, gamma = 1 mm /
    # sqrt(DTA^2 + (dose criterion / gradient)^2):
    #   3 %/3 mm:   1 / sqrt(9 + 0.75^2)    = 0.323 (pass)
    #   1 %/0.5 mm: 1 / sqrt(0.25 + 0.25^2) = 1.789 (fail)
    rows = np.arange(25, dtype=np.float64)[:, None]
    reference = np.broadcast_to(2.0 + 4.0 * rows, (25, 12))
    evaluation = reference - 4.0
    interior = (slice(3, -2), slice(None))
    loose = gamma_index(reference, evaluation, global_normalisation=100.0)
    tight = gamma_index(
        reference, evaluation, dose_percent=1.0, distance_mm=0.5, global_normalisation=100.0
    )
    assert torch.allclose(loose[interior], torch.tensor(1 / math.sqrt(9 + 0.75**2)), atol=0.01)
    assert torch.allclose(tight[interior], torch.tensor(1 / math.sqrt(0.25 + 0.25**2)), atol=0.01)
    assert torch.all(loose[interior] <= 1) and torch.all(tight[interior] > 1)


def test_field_shifted_by_1_mm_passes_3_3_and_fails_1_05_in_the_penumbra():
    field = blurred_rectangle(height=65)
    reference, evaluation = field[1:], field[:-1]  # evaluation(r) = reference(r - 1)
    step_down = np.abs(np.diff(field, axis=0))  # |reference(r) - reference(r - 1)|
    loose = gamma_index(reference, evaluation).numpy()
    counted = ~np.isnan(loose)
    # The search point 0.9 mm down the rows samples 0.1 reference(r - 1) + 0.9
    # reference(r), so gamma <= sqrt((0.1 step / 3 %)^2 + 0.3^2) everywhere.
    bound = np.sqrt((0.1 * step_down / (0.03 * reference.max())) ** 2 + 0.09)
    assert bound.max() < 1
    assert np.all(loose[counted] <= bound[counted] + 1e-5)
    assert gamma_pass_rate(torch.from_numpy(loose)).item() == 100.0

    tight = gamma_index(reference, evaluation, dose_percent=1.0, distance_mm=0.5).numpy()
    # Flat region: the point itself differs by less than 0.3 % -> gamma < 0.3.
    flat = counted & (step_down < 0.003 * reference.max())
    assert flat.sum() > 100 and np.all(tight[flat] < 0.3)
    # Steep penumbra across the rows (> 3 %/mm on both sides, well above the ~1.2 %/mm
    # at which a 1 mm shift of a ramp fails 1 %/0.5 mm) and locally flat along them
    # (not a corner of the field): every point fails.
    step_up = np.concatenate([step_down[1:], step_down[-1:]])  # |reference(r + 1) - reference(r)|
    gradient = np.minimum(step_down, step_up) / reference.max()
    along_rows = np.ones((1, 7), dtype=bool)
    lateral = (
        maximum_filter(reference, footprint=along_rows)
        - minimum_filter(reference, footprint=along_rows)
    ) / reference.max()
    steep = counted & (gradient > 0.03) & (lateral < 0.005)
    assert steep.sum() > 100 and np.all(tight[steep] > 1)


def test_five_percent_scale_fails_three_percent_global_in_the_high_dose_region():
    reference = blurred_rectangle(field_mm=(44, 48))
    gamma = gamma_index(reference, 1.05 * reference).numpy()
    peak = reference.max()
    # Where the reference stays within 0.5 % of itself over the whole 6 mm search
    # radius, every sample differs by >= (5 % - 1.05 * 0.5 %) of the local dose.
    neighbourhood = np.ones((13, 13), dtype=bool)
    steady = (maximum_filter(reference, footprint=neighbourhood) <= 1.005 * reference) & (
        minimum_filter(reference, footprint=neighbourhood) >= 0.995 * reference
    )
    high = (reference >= 0.95 * peak) & steady
    assert high.sum() > 100
    lower_bound = (0.05 - 1.05 * 0.005) * reference[high] / (0.03 * peak)
    assert np.all(gamma[high] >= lower_bound - 1e-5) and np.all(gamma[high] > 1)
    assert np.allclose(gamma[high], 0.05 * reference[high] / (0.03 * peak), atol=0.03)
    assert gamma_pass_rate(torch.from_numpy(gamma)).item() < 100


def test_points_below_the_cutoff_are_nan_and_not_counted():
    reference = epid_like_field(np.random.default_rng(1))
    evaluation = reference * 1.01
    for cutoff in (10.0, 50.0):
        gamma = gamma_index(reference, evaluation, lower_percent_cutoff=cutoff).numpy()
        assert np.array_equal(np.isnan(gamma), reference < cutoff / 100 * reference.max())
    counted = gamma[~np.isnan(gamma)]
    expected = 100 * np.mean(counted <= 1)
    assert gamma_pass_rate(torch.from_numpy(gamma)).item() == pytest.approx(expected)
    assert math.isnan(gamma_pass_rate(torch.full((4, 4), math.nan)).item())


def test_max_gamma_caps_reported_values_and_inf_searches_uncapped():
    reference = np.full((12, 14), 100.0)
    # A uniform dose difference D everywhere: gamma D / 3 at every point.
    assert torch.all(gamma_index(reference, 1.2 * reference) == 2.0)
    assert torch.all(gamma_index(reference, 1.2 * reference, max_gamma=3.0) == 3.0)
    uncapped = gamma_index(reference, 1.1 * reference, max_gamma=math.inf)
    assert torch.allclose(uncapped, torch.tensor(10 / 3))
    below_cap = gamma_index(reference, 1.02 * reference, max_gamma=1.0)
    assert torch.allclose(below_cap, torch.tensor(2 / 3))


def test_local_and_global_on_two_plateaus():
    # Left half 100, right half 40; evaluation 2 % higher everywhere. Away from the
    # step (beyond the 6 mm search radius) the dose difference is 2 or 0.8:
    #   global 3 % of 100: 2/3 and 0.8/3;  local 3 % of the point's dose: 2/3 and 2/3.
    reference = np.full((24, 40), 100.0)
    reference[:, 20:] = 40.0
    evaluation = 1.02 * reference
    global_gamma = gamma_index(reference, evaluation).numpy()
    local_gamma = gamma_index(reference, evaluation, local=True).numpy()
    high, low = (slice(None), slice(0, 13)), (slice(None), slice(27, None))
    assert np.allclose(global_gamma[high], 2 / 3, atol=1e-5)
    assert np.allclose(global_gamma[low], 0.8 / 3, atol=1e-5)
    assert np.allclose(local_gamma[high], 2 / 3, atol=1e-5)
    assert np.allclose(local_gamma[low], 2 / 3, atol=1e-5)


def test_local_gamma_is_nan_where_the_reference_is_zero():
    reference = blurred_rectangle()  # exactly 0 beyond 4 sigma of the field edges
    gamma = gamma_index(reference, reference + 1.0, local=True, lower_percent_cutoff=0.0)
    assert torch.equal(torch.isnan(gamma), torch.from_numpy(reference == 0))
    tiny = torch.from_numpy((reference > 0) & (reference < 1e-3))
    assert tiny.any() and torch.all(gamma[tiny] == 2.0)


def test_non_finite_evaluated_doses_give_nan_only_near_them():
    reference = blurred_rectangle()
    evaluation = reference.copy()
    evaluation[32, 32] = math.nan
    for max_gamma in (2.0, math.inf):
        gamma = gamma_index(reference, evaluation, max_gamma=max_gamma).numpy()
        assert np.isnan(gamma[32, 32])
        assert np.all(gamma[18:24, 14:50] == 0)  # beyond the search radius of (32, 32)


def test_batch_equals_per_image_calls(monkeypatch):
    rng = np.random.default_rng(2)
    references = np.stack([epid_like_field(rng) for _ in range(6)]).reshape(2, 3, 64, 80)
    evaluations = shift(references, (0, 0, 0.6, -0.8), order=1) * 1.01
    for local in (False, True):
        batch = gamma_index(references, evaluations, local=local)
        assert batch.shape == (2, 3, 64, 80)
        for i in range(2):
            for j in range(3):
                single = gamma_index(references[i, j], evaluations[i, j], local=local)
                assert torch.allclose(batch[i, j], single, atol=1e-6, equal_nan=True)
        assert gamma_pass_rate(batch).shape == (2, 3)
        # Two worker threads (blocks of images, or the chunks of one image) searching points in
        # many small chunks give the same result, and leave the torch thread count as it was.
        monkeypatch.setattr(gamma_search, "_CHUNK_POINTS", {"cpu": 1024, "cuda": 1024})
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            chunked = gamma_index(references, evaluations, local=local)
            one_image = gamma_index(references[1, 2], evaluations[1, 2], local=local)
            assert torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(threads)
        monkeypatch.undo()
        assert torch.allclose(chunked, batch, atol=1e-6, equal_nan=True)
        assert torch.allclose(one_image, batch[1, 2], atol=1e-6, equal_nan=True)


def test_calls_under_inference_mode_and_outside_it_mix_on_two_threads():
    """Worker threads do not inherit inference mode, and the kept buffers outlive it: a call under
    torch.inference_mode (inputs made there too), then one outside it, then one inside again."""
    rng = np.random.default_rng(6)
    references = torch.from_numpy(np.stack([epid_like_field(rng) for _ in range(4)]))
    evaluations = references * 1.02
    expected = gamma_index(references.float(), evaluations.float())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        release_workspaces()
        with torch.inference_mode():
            inside = [gamma_index(references.clone(), evaluations.clone()),
                      gamma_index(references.float(), evaluations.float())]
        outside = gamma_index(references, evaluations)
        with torch.inference_mode():
            inside.append(gamma_index(references, evaluations))
            inside[-1].clamp_(max=1.0)  # a result the caller may change where it got it
    finally:
        torch.set_num_threads(threads)
        release_workspaces()
    for gamma in (*inside[:2], outside):
        assert torch.allclose(gamma, expected, atol=1e-6, equal_nan=True)
    assert torch.allclose(inside[2], expected.clamp(max=1.0), atol=1e-6, equal_nan=True)


def test_inputs_broadcast_and_numpy_or_torch_give_the_same_result():
    rng = np.random.default_rng(3)
    reference = epid_like_field(rng)
    evaluations = np.stack([reference * 1.02, shift(reference, (1.0, 0.0), order=1)])
    from_numpy = gamma_index(reference, evaluations)
    from_torch = gamma_index(torch.from_numpy(reference), torch.from_numpy(evaluations))
    assert from_numpy.shape == (2, 64, 80) and from_numpy.dtype == torch.float32
    assert torch.equal(torch.isnan(from_numpy), torch.isnan(from_torch))
    assert torch.allclose(from_numpy, from_torch, equal_nan=True)


def test_buffers_kept_between_calls_never_alias_results_and_stay_within_their_cap(monkeypatch):
    rng = np.random.default_rng(5)
    references = torch.from_numpy(np.stack([epid_like_field(rng) for _ in range(4)]))  # float64
    evaluations = torch.from_numpy(shift(references.numpy(), (0, 0.7, -0.4), order=1) * 1.02)
    expected = gamma_index(references.float(), evaluations.float())
    release_workspaces()
    first = gamma_index(references, evaluations)
    kept = gamma_search.kept_bytes()
    assert kept > references.numel() * 4  # the converted inputs at least
    first_copy = first.clone()
    # another call (other images, other dtype) reuses the buffers: the first result is untouched
    second = gamma_index(evaluations, references.to(torch.float16))
    assert torch.equal(first.nan_to_num(-1), first_copy.nan_to_num(-1))
    assert torch.allclose(first, expected, atol=1e-6, equal_nan=True)
    assert torch.allclose(second, gamma_index(evaluations.float(), references.half().float()), equal_nan=True)
    # calls from two threads at once each borrow their own buffers
    with gamma_search.one_thread_workers(2) as pool:
        results = list(pool.map(lambda _: gamma_index(references, evaluations), range(4)))
    for result in results:
        assert torch.allclose(result, expected, atol=1e-6, equal_nan=True)
    release_workspaces()
    assert gamma_search.kept_bytes() == 0
    # past the cap, buffers are freed after the call
    monkeypatch.setattr(gamma_search, "_KEPT_BYTES", kept // 2)
    assert torch.allclose(gamma_index(references, evaluations), expected, atol=1e-6, equal_nan=True)
    assert 0 < gamma_search.kept_bytes() <= kept // 2
    release_workspaces()


@pytest.mark.parametrize(
    "options",
    [
        {"dose_percent": 0.0},
        {"distance_mm": -1.0},
        {"pixel_mm": math.nan},
        {"max_gamma": 0.0},
        {"lower_percent_cutoff": -5.0},
        {"interp_fraction": 0},
    ],
)
def test_bad_options_raise(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        gamma_index(np.ones((8, 8)), np.ones((8, 8)), **options)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    rng = np.random.default_rng(4)
    references = np.stack([epid_like_field(rng) for _ in range(4)])
    evaluations = gaussian_filter(references, (0, 1.0, 1.0)) * 0.98
    cpu = gamma_index(references, evaluations)
    cuda = gamma_index(torch.from_numpy(references).cuda(), torch.from_numpy(evaluations).cuda())
    assert cuda.is_cuda
    assert torch.allclose(cpu, cuda.cpu(), atol=1e-4, equal_nan=True)


def _perturbed(reference: np.ndarray, rng: np.random.Generator, kind: str) -> np.ndarray:
    if kind == "shift":
        return shift(reference, rng.uniform(-2.0, 2.0, 2), order=1)
    if kind == "scale":
        return reference * rng.uniform(0.94, 1.06)
    if kind == "blur":
        return gaussian_filter(reference, rng.uniform(0.7, 1.5))
    noise = rng.normal(0.0, 0.01 * reference.max(), reference.shape)
    return shift(reference, rng.uniform(-1.0, 1.0, 2), order=1) * rng.uniform(0.98, 1.02) + noise


PYMEDPHYS_CASES = [
    # (kind, local, pixel_mm, dose %, distance mm, cutoff %, max_gamma, interp_fraction)
    ("shift", False, 1.0, 2.0, 1.0, 10.0, 2.0, 10),
    ("scale", False, 1.0, 3.0, 3.0, 10.0, 2.0, 10),
    ("blur", False, 1.0, 2.0, 1.0, 20.0, 2.0, 10),
    ("noise", False, 1.0, 1.0, 1.0, 10.0, 2.0, 10),
    ("noise", False, 0.8, 1.0, 1.5, 5.0, 3.0, 5),
    ("shift", True, 1.0, 2.0, 2.0, 10.0, 2.0, 10),
    ("scale", True, 1.0, 3.0, 3.0, 20.0, 2.0, 10),
    ("noise", True, 1.2, 2.0, 1.0, 10.0, 1.5, 10),
    ("blur", False, 1.0, 1.0, 1.0, 10.0, math.inf, 10),
]


@pytest.mark.parametrize("case", range(len(PYMEDPHYS_CASES)))
def test_agrees_with_pymedphys(case):
    pymedphys = pytest.importorskip("pymedphys")
    kind, local, pixel_mm, dose, distance, cutoff, max_gamma, fraction = PYMEDPHYS_CASES[case]
    rng = np.random.default_rng(100 + case)
    reference = epid_like_field(rng, 56, 72)
    evaluation = _perturbed(reference, rng, kind)
    axes = (np.arange(56) * pixel_mm, np.arange(72) * pixel_mm)
    expected = pymedphys.gamma(
        axes,
        reference,
        axes,
        evaluation,
        dose,
        distance,
        lower_percent_dose_cutoff=cutoff,
        interp_fraction=fraction,
        max_gamma=max_gamma,
        local_gamma=local,
    )
    gamma = gamma_index(
        reference,
        evaluation,
        pixel_mm=pixel_mm,
        dose_percent=dose,
        distance_mm=distance,
        lower_percent_cutoff=cutoff,
        local=local,
        max_gamma=max_gamma,
        interp_fraction=fraction,
    ).numpy()
    assert np.array_equal(np.isnan(gamma), np.isnan(expected))
    evaluated = ~np.isnan(expected)
    assert np.abs(gamma - expected)[evaluated].max() < 2e-5  # the README: agrees to about 1e-5 in gamma
    counted = ~np.isnan(expected)
    expected_pass = 100 * np.mean(expected[counted] <= 1)
    assert abs(gamma_pass_rate(torch.from_numpy(gamma)).item() - expected_pass) < 0.5
    assert expected_pass < 100  # the case has failing points to agree on


@pytest.mark.parametrize("kind", ["shift", "scale", "noise"])
@pytest.mark.parametrize("local", [False, True])
def test_pass_rates_searched_to_the_distance_criterion_are_the_full_searchs(kind, local):
    rng = np.random.default_rng(7)
    reference = torch.from_numpy(np.stack([epid_like_field(rng, 56, 72) for _ in range(6)])).float()
    evaluation = torch.from_numpy(np.stack([_perturbed(image, rng, kind) for image in reference.numpy()])).float()
    failing = []
    for criteria in (GammaCriteria(2.0, 2.0, 10.0, local), GammaCriteria(1.0, 1.0, 10.0, local, max_gamma=3.0)):
        full = gamma_pass_rate(gamma_maps(reference, evaluation, criteria, batch_size=4))
        rates = gamma_pass_rates(reference, evaluation, criteria, batch_size=4)
        torch.testing.assert_close(rates, full, rtol=0, atol=0)
        failing.append(float(full.min()) < 100)
    assert any(failing)  # failing points to agree on
