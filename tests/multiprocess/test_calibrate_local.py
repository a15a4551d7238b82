"""autopar.runtime.calibrate on real processes: a quick calibration spawns 2 gloo ranks and
writes a profile that Cluster.from_json_file loads, with positive, plausible, sourced numbers
(the ring fit alone: tests/unit/test_calibrate.py)."""

from __future__ import annotations

import json

from autopar.runtime.calibrate import CalibrationSizes, calibrate_local
from cost_models import comm
from cost_models.hardware import Cluster


QUICK = CalibrationSizes(matmul_sizes=(64, 128), matmul_seconds=0.1, copy_bytes=8 * 2**20,
                         linear_shapes=((128, 32, 64), (128, 64, 256)),
                         attention_shapes=((4, 32, 16), (4, 32, 8)),
                         overhead_seconds=0.1, overlap_bytes=2**20,
                         all_reduce_bytes=(4, 4096, 65536, 2**20), all_reduce_seconds=0.05,
                         all_gather_bytes=(4096, 2**20),
                         timeout_s=90)


def test_calibrate_local_writes_a_loadable_plausible_profile(tmp_path):
    path = tmp_path / "local.json"
    profile = calibrate_local(2, str(path), sizes=QUICK)
    assert json.loads(path.read_text())["name"] == profile["name"]
    cluster = Cluster.from_json_file(path)
    dev, link = cluster.device, cluster.intra_node
    assert (cluster.nodes, cluster.gpus_per_node, cluster.dtype) == (1, 2, "fp32")
    assert 1e-4 < dev.peak_tflops < 50  # one CPU thread: ~1 GFLOP/s .. tens of TFLOP/s
    assert dev.matmul_efficiency == 1.0
    assert 0.1 < dev.memory_gib < 1e5 and 0.1 < dev.memory_bandwidth_gbps < 1e4
    # torch's unfused AdamW moves at least the 28 bytes of p, g, m, v read and p, m, v
    # written per parameter; its temporaries make it more (about 80 B on this kind of host)
    assert 28 <= dev.optimizer_bytes_per_param < 1000, dev.optimizer_bytes_per_param
    assert 1e-3 < link.bandwidth_gbps < 1e3 and 0.0 <= link.latency_s < 1e-2
    assert link.reduce_scatter_as_all_reduce  # gloo reduce-scatters as a whole all-reduce
    assert 0.0 <= link.all_gather_latency_s < 1e-2  # gloo's in-step all-gather: its own alpha
    assert set(profile["notes"]["all_gather_s_by_bytes"]) == {4096, 2**20}
    # the host terms: a graph node's dispatch costs microseconds (a block of 22 nodes forward
    # and backward); checkpointing adds to it; attention runs no faster than the linear layers
    # would let it by orders of magnitude; the overlap is a fraction
    assert 1e-7 < dev.op_overhead_s < 1e-3 and 0.0 <= dev.recompute_overhead_s < 1e-2
    assert 1e-5 < dev.attention_tflops < 50 and 0.0 <= dev.comm_overlap <= 1.0
    assert 1e-3 < dev.transcendental_gelems_per_s < 1e3  # erf-GELU: ~0.5e9 elements/s per core
    for source in (dev.source, link.source):
        assert "measured on" in source and "by autopar calibrate" in source
    # the fitted ring reproduces the measured all-reduce times: the median ratio is within
    # a factor of 4 (single points on 2 shared cores can be far off; the fit is least squares)
    n, times = 2, profile["notes"]["all_reduce_s_by_bytes"]
    ratios = sorted(comm.all_reduce_time_s(b, n, link) / s for b, s in times.items())
    assert 0.25 < ratios[len(ratios) // 2] < 4, (times, ratios)
