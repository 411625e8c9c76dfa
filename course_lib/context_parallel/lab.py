"""Notebook 10's lab, part 1: ring attention timed on a group, torch's own context parallelism, figures, explorer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from course_lib.context_parallel.layout import (
    LAYOUTS,
    all_positions,
    causal_work,
    overlap_tokens,
    ring_bytes_even,
    shard_sequence,
)
from course_lib.context_parallel.ring_attention import ring_attention
from course_lib.launch.runtime import synchronize

# Time one attention layer's forward and backward with ring attention, on the ranks of a group.


def time_ring_step(
    layout: str,
    seq_len: int,
    group: dist.ProcessGroup | None = None,
    *,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 32,
    repeats: int = 3,
    device: torch.device | str = "cpu",
) -> float:
    """Median seconds of forward + backward of causal ring attention over `seq_len` tokens, slowest rank."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    held = all_positions(layout, seq_len, n)
    torch.manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(batch, heads, seq_len, head_dim), held[r], 2).to(device) for _ in range(3))
    times = []
    for _ in range(repeats + 1):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        dist.barrier(group=group)
        start = time.perf_counter()
        ring_attention(q_, k_, v_, held, group=group).sum().backward()
        synchronize(q_.device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=q.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # a step ends when its slowest rank ends
        times.append(float(elapsed))
    return statistics.median(times[1:])


# torch's own context parallelism: `torch.distributed.tensor.experimental.context_parallel`.
#
# Inside the context, the `buffers` are cut along the sequence (with its head-tail load balancer: the zig-zag
# layout, when 2N divides the length) and F.scaled_dot_product_attention runs as ring attention. The ring
# replaces SDPA's GPU kernels (flash, memory-efficient, cuDNN attention): on the CPU, SDPA's kernel
# (aten._scaled_dot_product_flash_attention_for_cpu) has no DTensor sharding rule, so only the sharding runs
# there. By default torch all-gathers the K/V blocks; set_rotate_method("alltoall") passes them around.


def torch_positions(seq_len: int, mesh: DeviceMesh) -> torch.Tensor:
    """The token positions context_parallel gives this rank of `mesh` (runs on the CPU too)."""
    from torch.distributed.tensor.experimental import context_parallel

    buffer = torch.arange(seq_len, dtype=torch.float32, device=mesh.device_type).view(1, 1, seq_len, 1)
    with context_parallel(mesh, buffers=[buffer], buffer_seq_dims=[2], no_restore_buffers={buffer}):
        pass  # entering shards the buffer in place
    return buffer.flatten().long().cpu()


def torch_ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, mesh: DeviceMesh
) -> list[torch.Tensor]:
    """Causal attention of whole q, k, v (the same on every rank) under context_parallel, backward with dout."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    buffers = [t.detach().clone() for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        mine = [b.requires_grad_() for b in buffers[:3]]
        out = F.scaled_dot_product_attention(mine[0], mine[1], mine[2], is_causal=True)
        out.backward(buffers[3])
    local = [out.detach()] + [t.grad for t in mine if t.grad is not None]
    return context_parallel_unshard(mesh, local, [2] * len(local))


# Context parallelism, kernel side only: who computes which (query, key) pair, the ring's steps, the explorer.

LINKS = {"NVLink (H100, 450 GB/s)": 450e9, "InfiniBand (50 GB/s)": 50e9, "Ethernet (12.5 GB/s)": 12.5e9}


def draw_layouts(seq_len: int, world_size: int) -> None:
    """The causal mask of `seq_len` tokens, each kept (query, key) pair coloured by the rank that computes it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(4.2 * len(LAYOUTS), 4.0))
    for ax, layout in zip(axes, LAYOUTS):
        owner = torch.empty(seq_len, dtype=torch.long)
        for r, mine in enumerate(all_positions(layout, seq_len, world_size)):
            owner[mine] = r  # the rank holding query q computes row q
        picture = torch.ones(seq_len, seq_len, 4)
        colours = torch.tensor([plt.cm.tab10(r % 10) for r in range(world_size)], dtype=torch.float32)
        keep = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        picture[keep] = colours[owner[:, None].expand(seq_len, seq_len)[keep]]
        ax.imshow(picture.numpy(), interpolation="nearest")
        work = [sum(row) for row in causal_work(layout, seq_len, world_size)]
        ax.set_title(f"{layout}: pairs per rank {work}", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    handles = [plt.Rectangle((0, 0), 1, 1, color=plt.cm.tab10(r % 10)) for r in range(world_size)]
    fig.legend(handles, [f"rank {r}" for r in range(world_size)], loc="lower center", ncol=min(world_size, 8))
    plt.tight_layout(rect=(0, 0.08, 1, 1))
    plt.show()


def draw_ring_steps(traces: Sequence[Sequence[Mapping]], title: str = "") -> None:
    """One row per rank, one column per ring step: whose K/V block it held, and the pairs it kept / computed."""
    import matplotlib.pyplot as plt

    forward = [[e for e in trace if e["phase"] == "forward"] for trace in traces]
    n = len(forward)
    fig, ax = plt.subplots(figsize=(1.9 * n + 1.5, 0.75 * n + 0.9))
    for r, steps in enumerate(forward):
        for e in steps:
            colour = plt.cm.tab10(e["owner"] % 10)
            ax.add_patch(plt.Rectangle((e["step"], r), 1, 1, color=colour, alpha=0.35 if e["computed"] else 0.08))
            text = f"K/V of rank {e['owner']}\n{e['pairs']} kept / {e['computed']}"
            ax.text(e["step"] + 0.5, r + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([s + 0.5 for s in range(n)], [f"step {s}" for s in range(n)])
    ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_title(title or "the K/V block each rank holds at each ring step (pairs kept by the mask / computed)")
    plt.tight_layout()
    plt.show()


def draw_step_times(
    ns: Sequence[int], times: Mapping[str, Sequence[float]], model: Mapping[str, Sequence[float]]
) -> None:
    """Measured seconds per forward + backward against N, with the work model scaled to the one-rank time."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for i, layout in enumerate(times):
        ax.plot(ns, [1000 * t for t in times[layout]], "o-", color=f"C{i}", label=f"{layout}, measured")
        ax.plot(ns, [1000 * t for t in model[layout]], ":", color=f"C{i}", label=f"{layout}, work of slowest rank")
    ax.set_xlabel("ranks N (sequence length fixed)")
    ax.set_ylabel("ms per forward + backward")
    ax.set_xticks(list(ns))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()


def draw_cp_explorer(seq_len_k: int, ranks: int, link: str) -> None:
    """Llama 3 8B attention's memory and traffic per rank at `seq_len_k`·1024 tokens; the ring passes 8 K/V heads."""
    import matplotlib.pyplot as plt

    seq, heads, kv_heads, dim, e = seq_len_k * 1024, 32, 8, 128, 2
    ns = [n for n in (1, 2, 4, 8, 16, 32, 64) if n * 2 <= seq]
    gib = 2**30
    fig, (mem, comm) = plt.subplots(1, 2, figsize=(10, 3.6))
    saved = [(2 * heads * dim + 2 * kv_heads * dim + heads) * (seq // n) * e / gib for n in ns]  # q, o, lse; k, v
    mem.plot(ns, saved, "o-", label="attention's saved tensors")
    mem.plot(
        ns, [heads * (seq // n) ** 2 * e / gib for n in ns], "s--", label="one step's score block (if materialised)"
    )
    mem.axvline(ranks, color="gray", lw=0.8)
    mem.set(
        xscale="log", yscale="log", xlabel="ranks N", ylabel="GiB per rank per layer", title=f"memory, S = {seq_len_k}k"
    )
    mem.set_xticks(ns, [str(n) for n in ns])
    mem.minorticks_off()
    mem.legend(fontsize=8)
    flops, bandwidth = 400e12, LINKS[link]  # 400 TFLOP/s: a realistic bf16 rate on an H100
    chunk = seq / ranks
    compute_ms = 2 * heads * chunk**2 * dim / flops * 1e3  # a causal zig-zag step: half of 4·h·c²·d
    send_ms = 2 * kv_heads * chunk * dim * e / bandwidth * 1e3
    comm.bar(["compute", "send K/V"], [compute_ms, send_ms], color=["C0", "C1"])
    hidden = "hidden behind compute" if send_ms <= compute_ms else "NOT hidden"
    needed = overlap_tokens(flops, bandwidth, e) * kv_heads / heads  # 4 query heads per K/V head: 4x the flops
    comm.set_title(
        f"one ring step on {ranks} ranks: the message is {hidden}\n(needs ≥ {needed:.0f} tokens per rank)", fontsize=9
    )
    comm.set_ylabel("ms")
    total = ring_bytes_even(seq, ranks, 1, kv_heads, dim, e) / gib
    fig.suptitle(
        f"{seq // ranks} tokens per rank; {total:.2f} GiB sent per rank per layer (forward + backward)", fontsize=10
    )
    plt.tight_layout()
    plt.show()


def draw_ulysses_layout(world_size: int, heads: int = 12) -> None:
    """Who holds which (head, chunk) before, during and after Ulysses' all-to-alls; hatched: the blocks moved."""
    import matplotlib.pyplot as plt

    n, per = world_size, heads // world_size
    stages = [
        ("q, k, v: rank r holds chunk r of every head", lambda h, c: c),
        ("after all-to-all: rank r holds every chunk of its heads", lambda h, c: h // per),
        ("output after all-to-all back: chunk r again", lambda h, c: c),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 0.22 * heads + 1.6), sharey=True)
    for i, (ax, (title, holder)) in enumerate(zip(axes, stages)):
        for h in range(heads):
            for c in range(n):
                moved = i > 0 and holder(h, c) != stages[i - 1][1](h, c)
                ax.add_patch(plt.Rectangle((c, h), 1, 1, color=plt.cm.tab10(holder(h, c) % 10), alpha=0.6))
                if moved:
                    ax.add_patch(plt.Rectangle((c, h), 1, 1, fill=False, hatch="//", lw=0))
        ax.set(xlim=(0, n), ylim=(heads, 0), title=title, xlabel="sequence chunk")
        ax.title.set_fontsize(8)
        ax.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)])
    axes[0].set_ylabel("head")
    handles = [plt.Rectangle((0, 0), 1, 1, color=plt.cm.tab10(r % 10), alpha=0.6) for r in range(n)]
    fig.legend(handles, [f"rank {r}" for r in range(n)], loc="lower center", ncol=min(n, 8))
    plt.tight_layout(rect=(0, 0.1, 1, 1))
    plt.show()


def draw_online_softmax(scores: Sequence[float], split: int) -> None:
    """One query's per-block softmaxes, and rescaled by exp(lse_block - lse): exactly the softmax over all keys."""
    import matplotlib.pyplot as plt

    s = torch.tensor(scores, dtype=torch.float64)
    blocks = [s[:split], s[split:]]
    lse = torch.logsumexp(s, 0)
    keys = [torch.arange(split), torch.arange(split, len(s))]
    fig, (alone, merged) = plt.subplots(1, 2, figsize=(9, 2.6), sharey=True)
    for i, (block, where) in enumerate(zip(blocks, keys)):
        block_lse = torch.logsumexp(block, 0)
        alone.bar(where, torch.softmax(block, 0), color=f"C{i}", label=f"block {i}: its own softmax")
        weight = float(torch.exp(block_lse - lse))
        merged.bar(where, torch.softmax(block, 0) * weight, color=f"C{i}", label=f"block {i} × {weight:.2f}")
    merged.plot(range(len(s)), torch.softmax(s, 0), "k_", markersize=14, label="softmax over all keys")
    alone.set(xlabel="key", ylabel="weight")
    alone.set_title("each block's own softmax", fontsize=9)
    merged.set(xlabel="key")
    merged.set_title("each × exp(lse_block - lse) = the softmax over all keys", fontsize=9)
    for ax in (alone, merged):
        ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()
