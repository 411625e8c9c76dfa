# Solutions to notebook 02's exercises. In the notebook: %load solutions/02_ddp.py
# (the functions import what they use: `check` sends their source to the ranks).


# Exercise 1 (implement): a post-accumulate-grad hook that averages one parameter's gradient over ranks.
def average_gradient(param):
    import torch.distributed as dist

    dist.all_reduce(param.grad)
    param.grad /= dist.get_world_size()


# Exercise 2 (implement): a DDP communication hook, the mean of the bucket over ranks as a Future.
def mean_allreduce_hook(state, bucket):
    import torch.distributed as dist

    buffer = bucket.buffer() / dist.get_world_size()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


# Exercise 3 (predict): a ring all-reduce sends 2(N-1)/N of the gradient bytes per rank (section 1), and MinimalDDP
# all-reduces every float32 gradient once per backward: P = the parameter bytes of MLP(**BIG), N = NPEERS.
predicted_bytes_per_step = 2 * (NPEERS - 1) / NPEERS * param_bytes(MLP(**BIG))  # noqa: F821 (the notebook's names)


# Exercise 4 (diagnose): every micro-batch ran under no_sync(), so DDP never all-reduced and each rank
# stepped with its own gradient. The last micro-batch's forward and backward must run outside no_sync().
def accumulate_step(model, micro_batches, optimizer):
    import contextlib

    import torch

    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)
            loss.backward()
    optimizer.step()
