# Solutions to notebook 03's exercises. In the notebook: %load solutions/03_fsdp2.py
# (the functions import what they use: `check` sends their source to the ranks).


# Exercise 1 (predict): HSDP's bytes sent per rank per step on the 2 x 2 mesh, ring collectives.
# Shard group of s = 2: all-gather twice (forward, backward) and reduce-scatter once, (s-1)/s x P each;
# replicate group of r = 2: all-reduce of this rank's P/s gradient shard, 2(r-1)/r x P/s. In all 2 P.
predicted_hsdp_bytes = 3 * (2 - 1) / 2 * P_WIDE + 2 * (2 - 1) / 2 * P_WIDE / 2  # noqa: F821 (the notebook's P_WIDE)


# Exercise 2 (implement): this rank's flat tensor_split chunk of a parameter and of its Adam state.
def shard_with_adam_state(param, exp_avg, exp_avg_sq):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    return tuple(torch.tensor_split(t.reshape(-1), n)[rank].clone() for t in (param, exp_avg, exp_avg_sq))


# Exercise 3 (diagnose): the broken version all-reduced each rank's *own* chunk, so rank r added its
# chunk r to the other ranks' different chunks (and hung or failed when chunk sizes differ).
# Cut first, then reduce-scatter: rank r receives the sum of every rank's chunk r and nothing else, half
# the bytes of all-reducing the whole gradient and keeping a slice (DDP's traffic, which the check refuses).
def reduce_gradient(full_grad):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = [chunk.contiguous() for chunk in torch.tensor_split(full_grad.reshape(-1), n)]
    mine = torch.empty_like(chunks[rank])
    dist.reduce_scatter(mine, chunks)  # chunk sizes may differ: the list form takes them as they are
    return mine / n
