"""A forward model whose detector response starts as a measured kernel: it renders the kernel's
convolution (checked against scipy), cuts or pads the kernel to its reach, stores it in its
checkpoint, loads checkpoints written before it had one, and a training run starts from the kernel
file EPID_KERNEL names (only then). An inverse model given a broad measured kernel reads its frames
through the tracking's Wiener filter of it (the same rows), keeps it in its checkpoint, and is left
as it was by a response the tracking needs no filter for."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import scipy.io
import scipy.signal
import torch

from epid.config.load import load_config
from epid.models.checkpoint import build_models_from_checkpoint, load_weights
from epid.models.families import PairConfig, build_models
from epid.models.response import MEASURED_START_SHARE, MIN_TARGET_SIGMA_MM, to_imager
from epid.reconstruction.rows import RowDomain
from epid.synthesis.kernel import ResponseShape, default_kernel, response_kernel
from epid.training.loop import starting_models


def broad_kernel(size: int = 81) -> np.ndarray:
    return response_kernel(ResponseShape(core_sigma_mm=5.6, scatter_mm=6.0, tail_mm=20.0, weights=(0.45, 0.35, 0.2),
                                         aspect=1.3), size)


def test_a_measured_response_renders_the_kernels_convolution():
    forward, _ = build_models("full", "aperture")
    kernel = broad_kernel()
    forward.response.start_from(torch.from_numpy(kernel))
    with torch.no_grad():
        forward.response.measured_logit.fill_(40.0)  # the measured kernel alone
        leaf_a = torch.cat([torch.full((1, 52), -30.0), torch.full((1, 52), -10.0)], 1)
        leaf_b = torch.cat([torch.full((1, 52), 25.0), torch.full((1, 52), 40.0)], 1)
        scalars = torch.tensor([[1.0, -40.0, -35.0, 50.0, 52.0]])
        per_mu, fluence = forward.render(leaf_a, leaf_b, scalars)
    expected = scipy.signal.fftconvolve(fluence[0].double().numpy(), kernel / kernel.sum(), mode="same")
    np.testing.assert_allclose(per_mu[0].double().numpy(), to_imager(torch.from_numpy(expected)).numpy(), atol=1e-5)


def test_the_measured_share_starts_high_and_the_mixture_is_the_rest():
    forward, _ = build_models("tiny", "aperture")
    response = forward.response
    mixture = response.kernel().detach()
    kernel = broad_kernel(81)  # wider than the tiny model's reach (32 mm): cut
    response.start_from(torch.from_numpy(kernel))
    size = 2 * response.reach + 1
    cut = kernel[40 - response.reach:40 + response.reach + 1, 40 - response.reach:40 + response.reach + 1]
    measured = torch.from_numpy(cut / cut.sum()).float()
    torch.testing.assert_close(response.measured, measured)
    assert response.measured.shape == (size, size)
    share = MEASURED_START_SHARE
    torch.testing.assert_close(response.kernel().detach(), share * measured + (1 - share) * mixture)


def test_a_small_kernel_is_padded_and_an_even_one_refused():
    forward, _ = build_models("full", "aperture")
    response = forward.response
    response.start_from(torch.ones(3, 5))
    centre = response.reach
    assert float(response.measured.sum()) == pytest.approx(1.0)
    assert float(response.measured[centre - 1:centre + 2, centre - 2:centre + 3].sum()) == pytest.approx(1.0)
    assert float(response.measured[centre, centre]) == pytest.approx(1 / 15)
    with pytest.raises(ValueError, match="odd sides"):
        response.start_from(torch.ones(4, 5))


def test_the_measured_kernel_travels_in_the_checkpoint_and_old_checkpoints_load():
    forward, inverse = build_models("tiny", "aperture")
    forward.response.start_from(torch.from_numpy(broad_kernel(41)))
    payload = {"model_config": PairConfig.of(forward, inverse).to_dict(),
               "forward_model": forward.state_dict(), "inverse_model": inverse.state_dict()}
    loaded, _ = build_models_from_checkpoint(payload)
    torch.testing.assert_close(loaded.response.kernel(), forward.response.kernel())

    before, _ = build_models("tiny", "aperture")
    old_state = {name: value for name, value in before.state_dict().items() if "measured" not in name}
    fresh, _ = build_models("tiny", "aperture")
    load_weights(fresh, old_state)
    torch.testing.assert_close(fresh.response.kernel(), before.response.kernel())
    assert float(fresh.response.measured_present) == 0.0


def test_a_run_starts_from_the_kernel_file_it_names(tmp_path):
    kernel = broad_kernel(81)
    path = tmp_path / "panel.mat"
    scipy.io.savemat(path, {"kernel": kernel})
    named, named_inverse = starting_models(load_config({"EPID_KERNEL": str(path), "EPID_MODEL_SIZE": "tiny"}), None)
    reach = named.response.reach
    cut = kernel[40 - reach:40 + reach + 1, 40 - reach:40 + reach + 1]
    np.testing.assert_allclose(named.response.measured.numpy(), cut / cut.sum(), rtol=1e-5, atol=1e-8)
    assert named_inverse.response_filter() is not None  # the frames read through the broad kernel
    built_in, built_in_inverse = starting_models(load_config({"EPID_MODEL_SIZE": "tiny"}), None)
    assert float(built_in.response.measured_present) == 0.0
    assert float(built_in_inverse.response_present) == 0.0


def test_the_inverse_network_reads_a_broad_response_through_the_trackings_filter():
    forward, inverse = build_models("full", "aperture")
    kernel = torch.from_numpy(broad_kernel(81))
    inverse.read_through(kernel)
    forward.response.start_from(kernel)
    with torch.no_grad():
        forward.response.measured_logit.fill_(40.0)  # the measured kernel alone, as the tracking would see it
    response_filter, domain = inverse.response_filter(), RowDomain.of(forward)
    assert response_filter.target_sigma_mm == domain.target_sigma_mm > MIN_TARGET_SIGMA_MM
    frames = torch.rand(3, 256, 256, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(response_filter.filtered_rows(frames), domain.filtered_rows(frames), rtol=1e-4,
                               atol=1e-5)


def test_only_a_broad_response_changes_what_the_network_reads():
    _, plain = build_models("tiny", "aperture")
    sharp, broad = copy.deepcopy(plain), copy.deepcopy(plain)
    sharp.read_through(torch.from_numpy(default_kernel()))  # the built-in response: T stays 2 mm
    broad.read_through(torch.from_numpy(broad_kernel(81)))
    assert sharp.response_filter() is None and plain.response_filter() is None
    generator = torch.Generator().manual_seed(1)
    prev, curr = torch.rand(2, 1, 256, 256, generator=generator), torch.rand(2, 1, 256, 256, generator=generator)
    with torch.no_grad():
        leaf_a, _, scalars, _ = plain(prev, curr)
        same_a, _, same_scalars, _ = sharp(prev, curr)
        broad_a, _, _, _ = broad(prev, curr)
    assert torch.equal(same_a, leaf_a) and torch.equal(same_scalars, scalars)
    assert float((broad_a - leaf_a).abs().max()) > 1e-3


def test_the_read_through_travels_in_the_checkpoint_and_is_built_once():
    forward, inverse = build_models("tiny", "aperture")
    inverse.read_through(torch.from_numpy(broad_kernel(81)))
    payload = {"model_config": PairConfig.of(forward, inverse).to_dict(),
               "forward_model": forward.state_dict(), "inverse_model": inverse.state_dict()}
    _, loaded = build_models_from_checkpoint(payload)
    built = loaded.response_filter()
    assert built is not None and built.target_sigma_mm == inverse.response_filter().target_sigma_mm
    with torch.no_grad():  # what DistributedDataParallel does to the buffers at every step
        loaded.response_kernel.copy_(inverse.response_kernel.clone())
    assert loaded.response_filter() is built

    _, before = build_models("tiny", "aperture")
    old_state = {name: value for name, value in before.state_dict().items() if not name.startswith("response_")}
    _, fresh = build_models("tiny", "aperture")
    load_weights(fresh, old_state)
    assert float(fresh.response_present) == 0.0 and fresh.response_filter() is None
