# Solutions to notebook 00's exercises.
# Load them into the notebook with `%load solutions/00_torchrun_and_process_groups.py`.
# Each function imports what it uses inside its body: `check` sends a function's source alone to the ranks.

# Exercise 1 (predict): all_reduce works in place. The first call leaves t = S on every rank, the sum of 100 + r
# over the ranks; the second sums N copies of S: N * S.
predicted_sum = NPROC * sum(100 + r for r in range(NPROC))  # noqa: F821 (NPROC is the notebook's parameter)


# Exercise 2 (implement): one all_reduce; it works in place, so reduce a copy and leave the argument alone.
def rank_sum(value):
    import torch.distributed as dist

    total = value.clone()
    dist.all_reduce(total)  # SUM over every rank: each rank's secret reaches every other
    return total


# Exercise 3 (implement): all_gather_object fills one slot per rank, in rank order, on every rank.
def gather_values(value):
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# Exercise 4 (diagnose): every rank must call the all_reduce (a collective is a call of the whole group);
# only the printing is rank 0's business.
def mean_loss(loss):
    import torch.distributed as dist

    total = loss.clone()
    dist.all_reduce(total)
    mean = total / dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"mean loss {mean.item():.3f}")
    return mean
