"""Solutions to notebook 09's exercises (load in the notebook with `%load solutions/09_pipeline_parallel.py`).

Each function is self-contained (imports inside), because `check` sends its source to the ranks.
"""

# Exercise 1 (predict): the ideal bubble of interleaved 1F1B with p = NPROC ranks, v = 2 virtual stages per
# rank and m = 2p micro-batches. Each action is 1/v of a stage's work, so the fill and drain shrink v times:
# (p - 1) / (v m + p - 1) = (p - 1) / (5p - 1). Forgetting v gives 1F1B's (p - 1) / (m + p - 1), about 1.7x too high.
predicted_bubble = (NPROC - 1) / (2 * (2 * NPROC) + NPROC - 1)  # noqa: F821 (the notebook's NPROC)


# Exercise 2 (implement): 1F1B's action list for one stage. Stage s runs p - 1 - s warm-up forwards: just enough
# that the gradient of micro-batch 0 is back when its warm-up ends, so it never idles waiting for one (the bubble
# stays (p-1)/(m+p-1)); then each forward is followed by the backward of the oldest micro-batch it holds, so it
# never holds more than p - s (one warm-up forward more would hold p - s + 1; none, as in "F0 B0 F1 B1 ...",
# holds one but leaves the pipeline empty most of the time).
def one_f_one_b(stage, n_stages, n_microbatches):
    warmup = min(n_stages - 1 - stage, n_microbatches)
    actions = [("F", mb) for mb in range(warmup)]
    next_backward = 0
    for mb in range(warmup, n_microbatches):  # steady state: one forward, then the oldest backward
        actions += [("F", mb), ("B", next_backward)]
        next_backward += 1
    actions += [("B", mb) for mb in range(next_backward, n_microbatches)]  # drain
    return actions


# Exercise 3 (diagnose): in the broken step a middle rank waited for the gradient of its output *before* sending
# that output on, so rank k waited on rank k+1, which waited on rank k for its input: a deadlock. Receive the
# gradient only after the activation went out.
def pipeline_step(stage_module, x, y):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    inp = x
    if not first:
        inp = torch.empty(x.shape[0], 64, device=x.device)  # the activations between stages are 64 wide
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_()
    out = stage_module(inp)
    loss = None
    if last:
        loss = F.mse_loss(out, y)
        loss.backward()
    else:
        dist.send(out.detach(), dst=rank + 1)  # the fix: send first ...
        grad_out = torch.empty_like(out)
        dist.recv(grad_out, src=rank + 1)  # ... then wait for the gradient
        out.backward(grad_out)
    if not first:
        dist.send(inp.grad, dst=rank - 1)
    return loss
