# Solutions of notebook 15's exercises. In the notebook: %load solutions/15_capstone_gpt.py


# 8.1 Predict: the matmul FLOPs of one training step of the one-process run (16 sequences of 64 characters).
# Every weight of a matrix multiply costs 2 FLOPs per token forward and 4 backward (the gradient of the input
# and of the weight): 6 per weight and token. The weights: 2 blocks of q, k, v, o (d x d each) and up, down
# (d x 4d each), and the tied table once, as the head (the embedding lookup multiplies nothing). Biases, norms
# and the position table are not matmul weights.
d, vocab, layers, tokens = 128, 108, 2, 16 * 64
predicted_matmul_flops = 6 * (layers * (4 * d * d + 2 * d * 4 * d) + vocab * d) * tokens


# 8.2 Implement: the group of the two copies of the tied table, for any number of pipeline stages.
def embedding_group(mesh):
    import torch.distributed as dist

    pp, dp, tp = mesh.mesh.shape
    p, d, t = mesh.get_coordinate()
    mine = None
    for d_ in range(dp):  # every rank creates every group, in the same order (new_group is a collective)
        for t_ in range(tp):
            ranks = [int(mesh.mesh[0, d_, t_]), int(mesh.mesh[pp - 1, d_, t_])]
            group = dist.new_group(ranks)
            if (d_, t_) == (d, t):
                mine = group
    return mine if p in (0, pp - 1) else None


# 8.3 Diagnose: the tp ranks of a group must see the same rows, and the dp ranks must split the batch.
# `dp_rank=rank, dp_size=world_size` gave the two tp ranks of a group different rows: each computed half of
# every matmul on different sequences, and the row-parallel all-reduce added halves that do not belong
# together. No error, just a wrong loss. The data-parallel coordinate comes from the mesh.
def rows_on_mesh(mesh, tokens, seq, global_batch):
    from course_lib.gpt import ShardedBatches

    return ShardedBatches(tokens, seq, global_batch, mesh["dp"].get_local_rank(), mesh["dp"].size())
