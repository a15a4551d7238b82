"""ZB-H1's gain over 1F1B against Qi et al. 2024 (ICLR), Tables 3 and 4: the benchmark
``benchmarks/zero_bubble_qi2024.py`` prices each model's two layouts; its smallest-m rows
(the biggest bubbles) must be within 5 points of the published gain (issue 33)."""

from __future__ import annotations

import pytest

from helpers import load_script

bench = load_script("benchmarks/zero_bubble_qi2024.py")


@pytest.mark.parametrize("row", [bench.ROWS[0], bench.ROWS[3]], ids=lambda r: r.name)
def test_predicted_zb_h1_gain_is_within_5_points_of_the_published_one(row):
    m, base, zb = row.micro_batches[0], row.one_f_one_b[0], row.zb_1p[0]
    one_f_one_b = bench.predicted_step_s(row, m, "1f1b")
    zero_bubble = bench.predicted_step_s(row, m, "zb_h1")
    predicted, published = one_f_one_b / zero_bubble - 1, zb / base - 1
    assert predicted > 0 and abs(predicted - published) < 0.05, (predicted, published)


def test_the_paper_cut_has_one_layer_fewer_at_each_end():
    assert bench.stage_layers(22, 8) == [[0, 2]] + [[2 + 3 * k, 5 + 3 * k] for k in range(6)] + [[20, 22]]
    with pytest.raises(ValueError, match="do not cut"):
        bench.stage_layers(23, 8)
