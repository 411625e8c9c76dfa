"""Model shapes and clusters the planner prices: a GPT layer, Llama 3, Megatron's runs; H100 and A100 nodes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelShape:
    """A transformer's shape and its training sequences; defaults are a GPT layer, n_params None counts the shape."""

    n_params: float | None
    layers: int
    hidden: int
    heads: int
    seq: int = 4096
    micro_batch: float = 1
    # activation all-reduces per layer and micro-batch: 2 forward, 2 backward with fused qkv (Megatron);
    # the course's block has separate q, k, v: their input gradients are all-reduced one by one (6)
    tp_all_reduces: int = 4
    kv_heads: int | None = None
    d_ff: int | None = None
    glu: bool = False
    vocab: int = 0
    tied: bool = True
    dropout: bool = True

    @property
    def kv_ratio(self) -> float:
        return (self.kv_heads or self.heads) / self.heads

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.hidden


def parameters(m: ModelShape) -> float:
    """Weight count from the shape: attention (GQA), MLP (2 or 3 matrices), norms, embedding and an untied head."""
    if m.n_params is not None:
        return m.n_params
    h = m.hidden
    layer = 2 * h * h * (1 + m.kv_ratio) + (3 if m.glu else 2) * h * m.ffn + 2 * h
    return m.layers * layer + m.vocab * h * (1 if m.tied else 2) + h


def flops_per_token(m: ModelShape) -> float:
    """Training FLOPs per token as torchtitan counts them for MFU: 6 per matmul weight plus 12·L·h·s of attention."""
    lookup = 0 if m.tied else m.vocab * m.hidden
    return 6 * (parameters(m) - lookup) + 12 * m.layers * m.hidden * m.seq


LLAMA_70B = ModelShape(  # Llama 3 70B (Meta's params.json), at its 8,192-token pre-training context
    None, 80, 8192, 64, 8192, kv_heads=8, d_ff=28672, glu=True, vocab=128256, tied=False, dropout=False
)
LLAMA31_8B = ModelShape(
    None, 32, 4096, 32, 8192, kv_heads=8, d_ff=14336, glu=True, vocab=128256, tied=False, dropout=False
)
GPT3_175B = ModelShape(None, 96, 12288, 96, 2048, vocab=51200)
MEGATRON_1T = ModelShape(None, 128, 25600, 160, 2048, vocab=51200)


@dataclass(frozen=True)
class Cluster:
    """GPUs per node, and one GPU's bandwidth inside a node (NVLink) and between nodes (InfiniBand)."""

    gpus_per_node: int = 8
    intra_node_GBps: float = 450.0
    inter_node_GBps: float = 50.0
    peak_TFLOPs: float = 989.0  # dense 16-bit matmuls (H100 SXM)
    # the step-time model's assumptions: start-up time of one collective step, and the fraction of the peak that
    # the layers' matmuls reach (large GEMMs; attention kernels and element-wise work reach less)
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 10e-6
    matmul_efficiency: float = 0.7


H100_NODES = Cluster()  # 8 H100 per node: NVLink 4 inside, one 400 Gb/s InfiniBand link per GPU between nodes
# 8 A100 80GB per node (Selene): NVLink 3 (300 GB/s each way), 8 x 200 Gb/s HDR InfiniBand per node
A100_NODES = Cluster(intra_node_GBps=300.0, inter_node_GBps=25.0, peak_TFLOPs=312.0, matmul_efficiency=0.8)
