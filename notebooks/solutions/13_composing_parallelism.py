"""Solutions to notebook 13's exercises (load in the notebook with `%load solutions/13_composing_parallelism.py`).

Each function is self-contained (imports inside): `check` sends its source to the ranks.
"""

from course_lib import compose  # as in the notebook

# Exercise 1 (predict): bytes FSDP sends per GPU in the 3D step of section 4.
# Each stage holds 2 blocks of 28272 parameters split over tp=2: 28272 fp32 values (4 bytes) per GPU, and a ring
# all-gather or reduce-scatter over dp=2 sends (dp - 1) / dp of them. torch.distributed.pipelining keeps the
# parameters gathered after the first backward and defers the gradient sync (reshard_after_backward=False,
# set_requires_gradient_sync(False) until the last micro-batch): with 2 micro-batches, 2 + 1 all-gathers and 1
# reduce-scatter per block, 4 in all (the planner's fsdp_collectives(2, reshard_after_backward=False,
# defer_grad_sync=True)). The norms and the row-parallel biases are not split by tp, so the count is ~1% higher.
predicted_dp_bytes_3d = (2 + 1 + 1) * (2 - 1) / 2 * sum(p.numel() for p in compose.make_model(2).parameters()) / 2 * 4


# Exercise 2 (implement): gradient accumulation with the sync deferred to the last micro-batch.
def accumulate(model, micro_batches):
    import torch

    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == n - 1)  # reduce-scatter only in the last backward
        loss = torch.nn.functional.mse_loss(model(x), y) / n  # the mean over the step's micro-batches
        loss.backward()


# Exercise 3 (diagnose): micro-batches every data-parallel rank agrees on.
# The broken version split each rank's rows by size: a rank with 3 rows made 2 micro-batches, one with 2 rows 1,
# and the extra forward's all-gathers had no partner. The fix agrees on the count first (the fullest rank's).
def make_micro_batches(x, y, micro_batch_size):
    import torch
    import torch.distributed as dist

    rows = torch.tensor([len(x)], device=x.device)  # where the rows are: NCCL reduces GPU tensors
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)  # every rank runs as many micro-batches as the fullest needs
    n = -(-int(rows) // micro_batch_size)
    return list(zip(x.tensor_split(n), y.tensor_split(n)))


# Exercise 4 (implement): a rank's (pp, dp, tp) coordinates, tp varying fastest.
def my_coordinates(rank, pp, dp, tp):
    return rank // (dp * tp), rank // tp % dp, rank % tp
