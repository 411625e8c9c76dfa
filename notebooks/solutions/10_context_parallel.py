"""Solutions to notebook 10's exercises (load in the notebook with `%load solutions/10_context_parallel.py`).

Each block replaces the stub in its exercise's cell; a function imports what it uses inside its body, because
`check` sends its source to the ranks.
"""

# Exercise 1 (predict): the bytes rank 0 sends in the forward of one attention layer, S = 48 tokens on N = NPROC
# ranks (N divides 48), batch 2, 4 heads of 8, float32. Each of the N - 1 ring steps sends one block: K and V (2) of
# its S/N tokens, b·h·d numbers each, 4 bytes per number (2·b·h·d·e·S·(N-1)/N). Forgetting V halves it; N steps
# instead of N - 1 is N/(N-1) too high.
predicted_forward_bytes = 2 * (NPROC - 1) * (48 // NPROC) * 2 * 4 * 8 * 4  # noqa: F821 (the notebook's NPROC)


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


# Exercise 3 (diagnose): the all-to-all sends its input's rows in order, the first g (= h/N) rows to rank 0, the next
# g to rank 1, ...: rank j must get chunk j of the sequence of each of my g heads. The broken version laid the rows
# out head by head (all of head 0's chunks, then head 1's), so rank j got whole heads instead of its own tokens.
# Put the chunk first: block j = chunk j of every one of my heads, then one all-to-all.
def heads_to_sequence(x):
    import torch.distributed as dist

    from course_lib import expert_parallel as ep

    n = dist.get_world_size()
    b, g, s, d = x.shape
    blocks = x.view(b, g, n, s // n, d).permute(2, 1, 0, 3, 4).reshape(n * g, b, s // n, d)  # chunk-major
    return ep.all_to_all(blocks, [g] * n, [g] * n, None).transpose(0, 1)
