"""Solutions to notebook 05's exercises (load in the notebook with `%load solutions/05_activation_memory.py`).

Each block replaces the stub of its exercise's cell; functions import what they use, because `check` sends their
source to the ranks.
"""

# Exercise 1 (predict): the bytes each rank holds after the forward of section 4's FSDP2 run with full
# recomputation. A checkpointed block keeps only its input: BATCH·SEQ·d_model values of this rank's own
# micro-batch, in fp32 (4 bytes) on the CPU, bf16 (2) on GPUs. FSDP shards parameters, gradients and optimizer
# state, not activations: nothing is divided by the number of ranks. (The output of the last block takes the place
# of the first block's input, which existed before the measurement began.)
predicted_fsdp_held = LAYERS * BATCH * SEQ * BLOCK.d_model * (2 if ON_GPU else 4)  # noqa: F821 (the notebook's)


# Exercise 2 (implement): checkpoint blocks 0, k, 2k, ...; run the others as they are.
def checkpoint_every(blocks, x, k):
    from torch.utils.checkpoint import checkpoint

    for i, block in enumerate(blocks):
        # use_reentrant=False: the first block's input (the data) does not require grad, and the reentrant
        # implementation would then give that block's parameters no gradient at all
        x = checkpoint(block, x, use_reentrant=False) if i % k == 0 else block(x)
    return x


# Exercise 3 (diagnose): the broken evaluation kept every batch's loss as a tensor, and with it every batch's
# graph and the activations saved for a backward that never runs. Evaluate without autograd, keep floats.
def evaluate(model, batches):
    import torch

    with torch.no_grad():  # nothing is saved for backward; each batch's activations die with its forward
        losses = [model(x).float().square().mean().item() for x in batches]
    return sum(losses) / len(losses)
