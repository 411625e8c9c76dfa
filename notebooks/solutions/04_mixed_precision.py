"""Solutions to notebook 04's exercises (load in the notebook with `%load solutions/04_mixed_precision.py`).

Each block replaces the stub of its exercise's cell; functions import what they use, because `check` sends their
source to the ranks.
"""


# Exercise 1 (implement): one found-inf flag for all ranks.
def found_inf(grads):
    import torch
    import torch.distributed as dist

    found = torch.zeros((), device=grads[0].device)  # where the gradients are: NCCL reduces GPU tensors
    for grad in grads:
        if not torch.isfinite(grad).all():
            found.fill_(1.0)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)  # MAX: one rank's overflow makes every rank skip
    return found


# Exercise 2 (diagnose): the broken step clipped the *scaled* gradients (norm x 65536), so every update was
# cut to max_norm / scale of what it should be. Unscale first, then clip, then step and update.
def train_step(model, optimizer, scaler, x, y, max_norm):
    import torch

    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # the fix: the true gradients, before clipping
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# Exercise 3 (predict): bytes of rank 0's sharded parameters for MLP(d_hidden=512) under FSDP2 with the bf16
# policy, on FSDP_NPROC ranks. The policy casts to bf16 only what it gathers: the shards the optimizer updates stay
# fp32, 4 bytes each, and each rank holds 1/N of them (Shard(0)). 2 * P / N, the bf16 guess, is the trap.
predicted_shard_bytes = 4 * sum(p.numel() for p in MLP(d_hidden=512).parameters()) / FSDP_NPROC  # noqa: F821
