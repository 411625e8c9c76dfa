"""course_lib.context_parallel (notebook 10): ring attention from scratch, and torch's context_parallel."""

from course_lib.context_parallel.checkers import check_heads_to_sequence, check_ring_forward
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
    describe_positions,
    overlap_tokens,
    positions,
    ring_bytes,
    ring_bytes_even,
    saved_bytes,
    shard_sequence,
    unshard_sequence,
    visible_rectangle,
)
from course_lib.context_parallel.ring_attention import (
    ContextParallelAttention,
    ContextParallelBlock,
    Ring,
    RingAttention,
    block_attention,
    merge_partials,
    ring_attention,
    sent_by_kind,
    sum_gradients,
)
from course_lib.context_parallel.ulysses import heads_to_sequence, sequence_to_heads, ulysses_attention, ulysses_bytes
