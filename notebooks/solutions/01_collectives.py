# Solutions to notebook 01's exercises.
# Load them into the notebook with `%load solutions/01_collectives.py`.
# Each function imports what it uses inside its body: `check` sends a function's source alone to the ranks.

# Exercise 1 (predict): a ring all-reduce sends 2(N-1) messages of S/N bytes per rank (section 1's table),
# here with S = 4 MiB on the session's N = NPEERS = max(2, NPROC) ranks: 2 (N-1)/N S.
predicted_ring_bytes = 2 * (max(2, NPROC) - 1) / max(2, NPROC) * 4 * 2**20  # noqa: F821 (the notebook's NPROC)


# Exercise 2 (implement): send chunk c of this rank's tensor to rank c, receive chunk `rank` from every
# other rank, add. Simpler than the ring, more messages (N-1 per rank at once); the same bytes per rank.
def my_reduce_scatter(tensor):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor, n)
    mine = chunks[rank].clone()
    incoming = {peer: torch.empty_like(mine) for peer in range(n) if peer != rank}
    ops = []
    for peer, buffer in incoming.items():
        if chunks[peer].numel():  # both sides know every size: an empty chunk is skipped by both
            ops.append(dist.P2POp(dist.isend, chunks[peer].contiguous(), peer))
        if mine.numel():
            ops.append(dist.P2POp(dist.irecv, buffer, peer))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for buffer in incoming.values():
        mine += buffer
    return mine


# Exercise 3 (implement): send this rank's chunk to every other rank, receive each rank's chunk into its place.
def my_all_gather(chunk, sizes):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    out = torch.empty(sum(sizes), dtype=chunk.dtype, device=chunk.device)
    parts = torch.split(out, sizes)
    parts[rank].copy_(chunk)
    ops = []
    for peer, part in enumerate(parts):
        if peer == rank:
            continue
        if chunk.numel():
            ops.append(dist.P2POp(dist.isend, chunk.contiguous(), peer))
        if part.numel():
            ops.append(dist.P2POp(dist.irecv, part, peer))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return out


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
