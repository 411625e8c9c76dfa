"""Solutions to notebook 11's exercises (load in the notebook with `%load solutions/11_expert_parallel.py`).

Each block replaces the stub in its exercise's cell; a function imports what it uses inside its body, because
`check` sends its source to the ranks.
"""

# Exercise 1 (predict): capacity C = ceil(c_f·T·k/E) = ceil(1.5·32·2/12) = 8; every expert drops what it was routed
# beyond C, whatever the order of the queue: Σ_e max(0, n_e - C) over rank 0's routed counts (section 2).
predicted_dropped = sum(max(0, n - -(-3 * 32 * 2 // (2 * 12))) for n in routed[0].tolist())  # noqa: F821


# Exercise 2 (diagnose): all_to_all_single sends rows [0, c_0) to rank 0, the next c_1 rows to rank 1, ...: the
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


# Exercise 3 (implement): queue the assignments as the router ranks them (every first choice in token order, then
# every second choice, ...), number each expert's assignments in queue order, keep those numbered below `cap`.
def capacity_mask(experts, n_experts, cap):
    import torch

    tokens, k = experts.shape
    kept = torch.zeros(tokens, k, dtype=torch.bool)
    taken = [0] * n_experts
    for choice in range(k):  # first choices before second choices
        for token in range(tokens):
            expert = int(experts[token, choice])
            kept[token, choice] = taken[expert] < cap
            taken[expert] += 1
    return kept
