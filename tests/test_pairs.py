"""A rank's train pairs: the order its samples are tiled in, and the micro-batches cut from them (oracles written
out by hand)."""

import pytest

from trueflow.train.pairs import Row, micro_batches, train_order


def test_contiguous_keeps_the_rollout_order_and_stride_deals_across_microgroups():
    assert train_order([2, 2, 2], "contiguous") == [0, 1, 2, 3, 4, 5]
    # the first sample of each microgroup, then the second: every micro-batch of 2 mixes two prompts' samples
    assert train_order([2, 2, 2], "stride") == [0, 2, 4, 1, 3, 5]
    assert train_order([3, 1], "stride") == [0, 3, 1, 2]
    with pytest.raises(ValueError, match="unknown split mode 'shuffle'"):
        train_order([2], "shuffle")


def test_micro_batches_are_slot_major_within_each_chunk_of_samples():
    assert micro_batches([0, 1, 2, 3], num_slots=2, mbs_sample=2, mbs_tstep=1) == [
        [Row(0, 0), Row(1, 0)], [Row(0, 1), Row(1, 1)], [Row(2, 0), Row(3, 0)], [Row(2, 1), Row(3, 1)]]
    assert micro_batches([4, 5], num_slots=2, mbs_sample=2, mbs_tstep=2) == [
        [Row(4, 0), Row(5, 0), Row(4, 1), Row(5, 1)]]
