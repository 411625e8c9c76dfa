"""The one way the course cuts data into global batches and a rank's rows."""

import pytest
import torch

from course_lib.data import batch_for_step, regression


def test_the_ranks_rows_make_up_the_one_process_batch_at_every_world_size():
    data = regression(n=96)
    for shuffle_seed in (None, 0):
        for step in (0, 1, 5):  # 96 // 24 = 4 batches per epoch: step 5 is in the second epoch
            whole = batch_for_step(data, step, 24, shuffle_seed=shuffle_seed)
            for world in (1, 2, 3, 4):
                rows = [batch_for_step(data, step, 24, rank, world, shuffle_seed) for rank in range(world)]
                assert all(len(x) == 24 // world for x, _ in rows)
                # contiguous: rank r holds the r-th 1/world of the global batch, in order
                assert torch.equal(torch.cat([x for x, _ in rows]), whole[0])
                assert torch.equal(torch.cat([y for _, y in rows]), whole[1])


def test_batches_are_a_pure_function_of_the_step():
    data = regression(n=96)
    x_in_order, _ = batch_for_step(data, 1, 24, shuffle_seed=None)
    assert torch.equal(x_in_order, data.tensors[0][24:48])
    first_epoch = torch.cat([batch_for_step(data, s, 24)[0] for s in range(4)])
    second_epoch = torch.cat([batch_for_step(data, s, 24)[0] for s in range(4, 8)])
    # each epoch is a permutation of the whole data set, a different one each epoch
    every_row = {tuple(row.tolist()) for row in data.tensors[0]}
    for epoch in (first_epoch, second_epoch):
        assert {tuple(row.tolist()) for row in epoch} == every_row and len(epoch) == 96
    assert not torch.equal(first_epoch, second_epoch)
    assert torch.equal(batch_for_step(data, 6, 24)[0], batch_for_step(data, 6, 24)[0])  # no state between calls
    assert not torch.equal(batch_for_step(data, 0, 24, shuffle_seed=1)[0], batch_for_step(data, 0, 24)[0])


def test_a_batch_larger_than_the_data_is_refused():
    with pytest.raises(ValueError, match="fit in the 96 samples"):
        batch_for_step(regression(n=96), 0, 100)
