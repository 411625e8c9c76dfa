"""Solutions to notebook 08's exercises (load in the notebook with `%load solutions/08_tensor_parallel.py`).

Each function is self-contained (imports inside), because `check` sends its source to the ranks.
"""

# Exercise 1 (predict): parameter bytes per rank under TP on N = NPROC ranks: P_rep + P_shard / N. The two
# LayerNorms (weight and bias) and the biases of the row-parallel layers (o, down) are replicated; every other
# parameter is split N ways. Forgetting the replicated part (all / N) is off by 1-5 %; forgetting that TP shards
# at all, by a factor N.
from course_lib.models import TransformerBlock  # the notebook's, imported at its top

predicted_parameter_bytes = sum(
    4 * p.numel() / (1 if name.startswith("norm") or name.endswith(("o.bias", "down.bias")) else NPROC)  # noqa: F821
    for name, p in TransformerBlock().named_parameters()
)


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
