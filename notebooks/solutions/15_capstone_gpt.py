# Solutions of notebook 15's exercises. In the notebook: %load solutions/15_capstone_gpt.py


from course_lib import gpt

config = gpt.default_config()  # as the notebook defines them above exercise 1
counts = gpt.count_parameters(config)


# Exercise 1 (predict): the matmul FLOPs of one training step (16 sequences of config.seq characters).
# Every weight of a matrix multiply costs 2 FLOPs per token forward and 4 backward (the gradient of the input
# and of the weight): 6 per weight and token. counts["matmul"] holds the blocks' q, k, v, o, up, down and the
# tied table once, as the head (the embedding lookup multiplies nothing; biases, norms and positions neither).
predicted_matmul_flops = 6 * counts["matmul"] * 16 * config.seq


# Exercise 2 (implement): the group of the two copies of the tied table, for any number of pipeline stages.
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


# Exercise 3 (diagnose): the tp ranks of a group must see the same rows, and the dp ranks must split the batch.
# `dp_rank=rank, dp_size=world_size` gave the two tp ranks of a group different rows: each computed half of
# every matmul on different sequences, and the row-parallel all-reduce added halves that do not belong
# together. No error, just a wrong loss. The data-parallel coordinate comes from the mesh.
def rows_on_mesh(mesh, tokens, seq, global_batch):
    from course_lib.gpt import ShardedBatches

    return ShardedBatches(tokens, seq, global_batch, mesh["dp"].get_local_rank(), mesh["dp"].size())
