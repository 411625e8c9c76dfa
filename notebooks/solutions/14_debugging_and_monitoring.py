# Solutions to notebook 14's exercises. Load them into the notebook with
# `%load solutions/14_debugging_and_monitoring.py`.
# Each function imports what it uses inside its body: `check` sends a function's source alone to the ranks.
from course_lib.models import MLP

# Exercise 1 (predict): DDP all-reduces every gradient element once per step (P float32 values, 4 bytes each),
# and a ring all-reduce sends 2 (N - 1) / N of the buffer from each rank (section 6, notebook 01).
P = sum(p.numel() for p in MLP().parameters())
predicted_ring_bytes = 2 * (NPROC - 1) / NPROC * 4 * P  # noqa: F821 (NPROC is the notebook's parameter)


# Exercise 2 (implement): one position-weighted checksum per gradient tensor, MAX and MIN over the ranks;
# every rank compares the same two results, so every rank returns the same verdict.
def gradients_in_sync(model):
    import torch
    import torch.distributed as dist

    sums = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, g.numel() + 1, dtype=torch.float64, device=g.device)
        sums.append((g * weights).sum())  # positions weighted: a swap of two entries changes the sum
    high = torch.stack(sums)
    low = high.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))


# Exercise 3 (diagnose): the broken version returned early on the rank whose loss was not finite, so that rank
# skipped the all-reduce the others were waiting in. Every rank must make the same collective calls: a rank with
# a NaN or Inf loss takes part with a zero loss and a zero count.
def mean_finite_loss(loss):
    import torch
    import torch.distributed as dist

    finite = bool(torch.isfinite(loss))
    totals = torch.stack(
        [
            loss.detach().double() if finite else torch.zeros((), dtype=torch.float64, device=loss.device),
            torch.tensor(1.0 if finite else 0.0, dtype=torch.float64, device=loss.device),
        ]
    )
    dist.all_reduce(totals)  # every rank, whatever its loss
    n_finite = int(totals[1].item())
    return totals[0].item() / n_finite, dist.get_world_size() - n_finite
