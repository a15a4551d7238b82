"""Bucket cuts of a flat gradient buffer (:func:`autopar.runtime.buckets.cut_buckets`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.runtime.buckets import cut_buckets


def test_cut_buckets_aligns_and_defers() -> None:
    """Cuts are multiples of align, reach both ends, the deferred region ends a bucket,
    and a parameter cut by a boundary belongs to both buckets."""
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 7, 30, 5)]
    offsets = [0, 10, 17, 47]
    buckets = cut_buckets(params, offsets, 52, element_size=4, align=4, deferred_end=10,
                          bucket_bytes=40, first_bucket_bytes=20)
    bounds = [(b.start, b.end) for b in buckets]
    assert bounds[0][1] == 52 and bounds[-1][0] == 0
    assert all(lo % 4 == 0 and hi % 4 == 0 and lo < hi for lo, hi in bounds)
    assert [b.deferred for b in buckets] == [False] * (len(buckets) - 1) + [True]
    assert bounds[-1] == (0, 12)
    holding = [i for i, b in enumerate(buckets) if any(q is params[1] for q in b.params)]
    assert holding == [len(buckets) - 2, len(buckets) - 1]  # elements 10..16, cut at 12
    with pytest.raises(ValueError, match="equal shards"):
        cut_buckets(params, offsets, 51, element_size=4, align=4)


def test_the_tail_of_expert_parameters_forms_buckets_of_its_own() -> None:
    """``tail``: the last elements (expert parameters) are cut apart from the rest, never
    sharing a bucket with a dense parameter, and reduced over ``tail_group``."""
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 7, 30, 5)]
    group = object()  # stands for the expert-data-parallel group
    buckets = cut_buckets(params, [0, 10, 17, 47], 52, element_size=4, tail=35,
                          tail_group=group, bucket_bytes=40, first_bucket_bytes=20)
    dense = [b for b in buckets if b.group is None]
    experts = [b for b in buckets if b.group is group]
    assert sorted((b.start, b.end) for b in dense)[-1][1] == 17
    assert min(b.start for b in experts) == 17 and max(b.end for b in experts) == 52
    assert all(q is not params[2] and q is not params[3] for b in dense for q in b.params)
    assert all(q is params[2] or q is params[3] for b in experts for q in b.params)
    assert sum(b.end - b.start for b in buckets) == 52
