"""torch's own context parallelism: `torch.distributed.tensor.experimental.context_parallel`.

Inside the context, the `buffers` are cut along the sequence (with its head-tail load balancer: the zig-zag
layout, when 2N divides the length) and F.scaled_dot_product_attention runs as ring attention. The ring
replaces SDPA's GPU kernels (flash, memory-efficient, cuDNN attention): on the CPU, SDPA's kernel
(aten._scaled_dot_product_flash_attention_for_cpu) has no DTensor sharding rule, so only the sharding runs
there. By default torch all-gathers the K/V blocks; set_rotate_method("alltoall") passes them around.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh


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
    """Causal attention of whole q, k, v (the same on every rank) under context_parallel, backward with dout.

    Returns [output, dq, dk, dv], put back whole and in sequence order (context_parallel_unshard).
    Needs a GPU attention kernel: on the CPU the attention call raises NotImplementedError.
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    buffers = [t.detach().clone() for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        mine = [b.requires_grad_() for b in buffers[:3]]
        out = F.scaled_dot_product_attention(mine[0], mine[1], mine[2], is_causal=True)
        out.backward(buffers[3])
    local = [out.detach()] + [t.grad for t in mine if t.grad is not None]
    return context_parallel_unshard(mesh, local, [2] * len(local))
