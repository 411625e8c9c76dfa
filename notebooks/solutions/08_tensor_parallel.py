"""Solutions to notebook 08's exercises (load in the notebook with `%load solutions/08_tensor_parallel.py`).

Each function is self-contained (imports inside), because `check` sends its source to the ranks.
"""

# Exercise 1 (predict): parameter bytes per rank under TP on N ranks. The two LayerNorms (weight and bias) and
# the biases of the row-parallel layers (o, down) are replicated; every other parameter is split N ways
# (section 4's formula P_rep + P_shard / N). For the course's block (48 wide): 113088 bytes in all,
# P_rep = (2 x 2 + 2) x 48 floats x 4 bytes = 1152 bytes. Forgetting the replicated part (113088 / N) is off
# by 1-5 %; forgetting that TP shards at all (113088) by a factor N.
#     predicted_parameter_bytes = 1152 + (113088 - 1152) / NPROC


def predicted_parameter_bytes(ranks: int, full_bytes: int = 113088, replicated_bytes: int = 1152) -> float:
    return replicated_bytes + (full_bytes - replicated_bytes) / ranks


# Exercise 2 (implement): the backward of the split operator: all-gather the slices' gradients, concatenate
# them in rank order along the features.
def split_backward(grad_slice):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(grad_slice) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grad_slice.contiguous())
    return torch.cat(parts, dim=-1)


# Exercise 3 (diagnose): the broken forward added the bias on every rank before the all-reduce, so the sum
# holds N copies of it (y + (N-1) b; right at N=1, which is why a one-GPU test does not see it).
# Sum the partial products first, then add the bias once.
def row_parallel_forward(x_slice, weight_slice, bias):
    import torch.distributed as dist

    y = x_slice @ weight_slice.T
    dist.all_reduce(y)
    return y + bias
