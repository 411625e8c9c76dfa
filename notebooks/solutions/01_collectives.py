# Solutions to notebook 01's exercises.
# Load them into the notebook with `%load solutions/01_collectives.py`.
# Each function imports what it uses inside its body: `check` sends a function's source alone to the ranks.

# Exercise 1 (predict): a ring all-reduce sends 2(N-1) messages of S/N bytes per rank (section 1's table),
# here with S = 4 MiB on the session's N = NPEERS = max(2, NPROC) ranks: 2 (N-1)/N S.
predicted_ring_bytes = 2 * (max(2, NPROC) - 1) / max(2, NPROC) * 4 * 2**20  # noqa: F821 (the notebook's NPROC)


# Exercise 2 (implement): the ring. At step k rank r sends chunk r-1-k to its right neighbour and adds the chunk
# r-2-k that its left neighbour sends; each chunk grows by one rank per step, and after N-1 steps the chunk that
# arrives last, chunk r, holds every rank's share. Sizes follow tensor_split, known on every rank: an empty chunk is
# skipped by both its sender and its receiver.
def my_reduce_scatter(tensor):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = [chunk.clone() for chunk in torch.tensor_split(tensor, n)]
    for step in range(n - 1):
        send, receive = (rank - 1 - step) % n, (rank - 2 - step) % n
        incoming = torch.empty_like(chunks[receive])
        ops = [dist.P2POp(dist.isend, chunks[send], right)] if chunks[send].numel() else []
        ops += [dist.P2POp(dist.irecv, incoming, left)] if incoming.numel() else []
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        chunks[receive] += incoming
    return chunks[rank]


# Exercise 3 (implement): the ring again, with finished chunks. At step k rank r passes on chunk r-k (its own at
# step 0, then the one it just received) and receives chunk r-1-k into its place; N-1 steps bring every chunk.
def my_all_gather(chunk, sizes):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    parts = [torch.empty(size, dtype=chunk.dtype, device=chunk.device) for size in sizes]
    parts[rank] = chunk
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - 1 - step) % n
        ops = [dist.P2POp(dist.isend, parts[send], right)] if sizes[send] else []
        ops += [dist.P2POp(dist.irecv, parts[receive], left)] if sizes[receive] else []
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    return torch.cat(parts)


# Exercise 4 (diagnose): every rank waited in recv for a message nobody had reached the line to send.
# Break the cycle: even ranks send first, odd ranks receive first. With an odd N, ranks N-1 and 0 are both
# even, but rank 0's send is matched by rank 1's first recv, so the chain unwinds from there.
def pass_right(token):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty_like(token)
    if rank % 2 == 0:
        dist.send(token, dst=right)
        dist.recv(incoming, src=left)
    else:
        dist.recv(incoming, src=left)
        dist.send(token, dst=right)
    return incoming
