"""Solutions to notebook 07's exercises (load in the notebook with `%load solutions/07_fault_tolerance.py`).

Each function is self-contained (imports inside), because `check` sends its source to the ranks.
"""

# Exercise 1 (predict): the bytes LocalSGD with H = 8 all-reduces per replica per step. One synchronisation sends the
# weights once, 4P bytes in fp32, and it comes every 8 steps: 4P / 8, whatever the number of replicas.
predicted_sync_bytes = 4 * parameters / 8  # noqa: F821 (the notebook's P)


# Exercise 2 (implement): DiLoCo's outer step. The pseudo-gradient anchor - weights is averaged over the replicas
# (one all-reduce of 4P bytes: a sum, then / W), handed to the outer optimizer as the anchor's gradient, and the
# model restarts its inner steps from the new anchor.
def diloco_outer_step(model, anchor, outer_optimizer):
    import torch
    import torch.distributed as dist

    pseudo = torch.cat([(a.detach() - p.detach()).flatten() for p, a in zip(model.parameters(), anchor)])
    dist.all_reduce(pseudo)  # one call: the sum over the replicas
    pseudo /= dist.get_world_size()
    offset = 0
    for a in anchor:
        a.grad = pseudo[offset : offset + a.numel()].view_as(a).clone()
        offset += a.numel()
    outer_optimizer.step()
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)


# Exercise 3 (diagnose): every rank chose from its own view of the directory, so after a restart the ranks
# resumed from different steps. One rank (0) decides, and every rank follows its choice.
def resume_step(root):
    import torch.distributed as dist

    from course_lib import checkpoint

    choice = [None]
    if dist.get_rank() == 0:
        found, _ = checkpoint.latest_complete(root)
        choice = [None if found is None else int(found.name.removeprefix("step_"))]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]
