"""autopar.runtime.calibrate: the ring fit recovers known numbers; bad input is refused before
any process starts (the real calibration: tests/multiprocess/test_calibrate_local.py)."""

from __future__ import annotations

import pytest

from autopar.runtime.calibrate import calibrate_local, fit_ring_all_reduce
from autopar.runtime.calibrate_comm import fit_ring_latency
from cost_models import comm
from cost_models.hardware import LinkSpec


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_fit_recovers_alpha_and_bandwidth(n):
    link = LinkSpec(name="synthetic", bandwidth_gbps=3.0, latency_s=4e-5, source="test")
    times = {m: comm.all_reduce_time_s(m, n, link) for m in (4, 1024, 2**16, 2**20, 2**24)}
    alpha, bandwidth = fit_ring_all_reduce(times, n)
    assert alpha == pytest.approx(4e-5, rel=1e-9)
    assert bandwidth == pytest.approx(3e9, rel=1e-9)


def test_ring_fit_and_calibrate_reject_bad_input():
    with pytest.raises(ValueError, match="2 ranks"):
        fit_ring_all_reduce({4: 1e-4, 8: 1e-4}, 1)
    with pytest.raises(ValueError, match="grow with message size"):
        fit_ring_all_reduce({4: 2e-3, 2**20: 1e-4}, 2)
    with pytest.raises(ValueError, match="processes >= 2"):
        calibrate_local(1)


@pytest.mark.parametrize("n", [2, 4])
def test_all_gather_latency_fit_recovers_its_alpha_at_the_all_reduce_bandwidth(n):
    link = LinkSpec(name="synthetic", bandwidth_gbps=3.0, latency_s=4e-5, source="test",
                    all_gather_latency_s=7e-5)
    times = {m: comm.all_gather_time_s(m, n, link) for m in (4096, 2**16, 2**21)}
    assert fit_ring_latency(times, n, 1, 3e9) == pytest.approx(7e-5, rel=1e-9)
    # times below the bandwidth term alone: no negative latency
    assert fit_ring_latency({2**21: 1e-6}, n, 1, 3e9) == 0.0
    with pytest.raises(ValueError, match="2 ranks"):
        fit_ring_latency(times, 1, 1, 3e9)
    with pytest.raises(ValueError, match="1 size"):
        fit_ring_latency({}, n, 1, 3e9)
