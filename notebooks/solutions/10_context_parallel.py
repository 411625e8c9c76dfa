"""Solutions to notebook 10's exercises (load in the notebook with `%load solutions/10_context_parallel.py`).

Each function is self-contained (imports inside), because `check` sends its source to the ranks.
"""

# Exercise 1 (predict): the bytes rank 0 sends in the forward of one attention layer, S = 48 tokens on N ranks
# (N divides 48), batch 2, 4 heads of 8, float32. Each of the N - 1 ring steps sends one block: K and V (2) of
# its S/N tokens, b·h·d numbers each, 4 bytes per number (section 6's formula 2·b·h·d·e·S·(N-1)/N).
# Forgetting V halves it; N steps instead of N - 1 is N/(N-1) too high.
#     predicted_forward_bytes = 2 * (NPROC - 1) * (48 // NPROC) * 2 * 4 * 8 * 4


def predicted_forward_bytes(ranks: int, seq_len: int = 48, batch: int = 2, heads: int = 4, head_dim: int = 8) -> int:
    return 2 * (ranks - 1) * (seq_len // ranks) * batch * heads * head_dim * 4


# Exercise 2 (implement): ring attention's forward without a mask. Post the exchange of the K/V block (send to
# the next rank, receive from the previous one), compute this block while it travels, merge the partial result
# with the online softmax, and take the received block for the next step.
def ring_forward(q, k, v):
    import torch
    import torch.distributed as dist

    from course_lib import context_parallel as cp

    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    out, lse = None, None
    for step in range(n):
        if step < n - 1:
            incoming = torch.empty_like(kv)
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, kv, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
            )
        block_out, block_lse = cp.block_attention(q, kv[0], kv[1])
        out, lse = (block_out, block_lse) if out is None else cp.merge_partials(out, lse, block_out, block_lse)
        if step < n - 1:
            for work in works:
                work.wait()
            kv = incoming
    return out


# Exercise 3 (diagnose): all_to_all_single sends rows [0, c_0) to rank 0, the next c_1 rows to rank 1, ...: the
# rows must be sorted by destination first. The broken dispatch sent them in token order, so each rank got the
# right number of rows, but rows meant for other ranks' experts. Sort tokens (and their experts) by destination.
def dispatch(tokens, expert_of_token, n_experts):
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    destination = expert_of_token // (n_experts // n)
    order = torch.argsort(destination, stable=True)
    tokens, expert_of_token = tokens[order], expert_of_token[order]
    send_counts = torch.bincount(destination, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)  # the counts first: the receivers size their buffers
    send, recv = send_counts.tolist(), recv_counts.tolist()
    rows = tokens.new_empty((sum(recv), tokens.shape[1]))
    dist.all_to_all_single(rows, tokens, recv, send)
    experts = expert_of_token.new_empty(sum(recv))
    dist.all_to_all_single(experts, expert_of_token, recv, send)
    return rows, experts
