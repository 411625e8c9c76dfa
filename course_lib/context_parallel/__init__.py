"""course_lib.context_parallel (notebook 10): ring attention from scratch, and torch's context_parallel.

layout          which tokens each rank holds (contiguous or zig-zag), for any sequence length; the causal
                work of each rank at each ring step, and the rectangle it computes
ring_attention  block attention, the online-softmax merge, RingAttention (forward and backward on the ring),
                the bytes each rank sent, by kind, from a comms.Recorder (sent_by_kind)
block           the course's TransformerBlock with ring attention, the gradient sum over the ranks
cost            bytes per rank per layer, memory per rank, when the ring hides behind compute
ulysses         Ulysses: an all-to-all from sequence- to head-sharded, local attention, and back; its bytes
lab             one layer's forward + backward timed on a group; torch.distributed.tensor.experimental.context_parallel:
                its layout (CPU too), its attention (GPU); kernel-only pictures and the explorer
checkers        the exercises' checkers (solutions: notebooks/solutions/10_context_parallel.py)
"""

from course_lib.context_parallel.block import ContextParallelAttention, ContextParallelBlock, sum_gradients
from course_lib.context_parallel.checkers import check_heads_to_sequence, check_ring_forward
from course_lib.context_parallel.cost import overlap_tokens, ring_bytes, ring_bytes_even, saved_bytes
from course_lib.context_parallel.lab import (
    LINKS,
    draw_cp_explorer,
    draw_layouts,
    draw_online_softmax,
    draw_ring_steps,
    draw_step_times,
    draw_ulysses_layout,
    time_ring_step,
    torch_positions,
    torch_ring_attention,
)
from course_lib.context_parallel.layout import (
    LAYOUTS,
    all_positions,
    causal_work,
    computed_work,
    describe,
    positions,
    shard_sequence,
    unshard_sequence,
    visible_rectangle,
)
from course_lib.context_parallel.ring_attention import (
    Ring,
    RingAttention,
    block_attention,
    merge_partials,
    ring_attention,
    sent_by_kind,
)
from course_lib.context_parallel.ulysses import heads_to_sequence, sequence_to_heads, ulysses_attention, ulysses_bytes
