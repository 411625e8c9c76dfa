"""Notebook 05: activation memory, measured against the formula, and what recomputation trades for it."""

from course_lib.activations.checkers import check_checkpoint_every, check_evaluate
from course_lib.activations.formulas import (
    KORTHIKANTI_TERMS,
    attention_terms,
    attention_width,
    course_block_bytes,
    course_block_terms,
    korthikanti_bytes,
    korthikanti_terms,
    stack_bytes,
)
from course_lib.activations.lab import (
    MODELS,
    LiveBytes,
    attention_backend,
    cuda_memory,
    cuda_memory_report,
    derived_held,
    draw_explorer,
    draw_korthikanti_terms,
    draw_ladder,
    draw_layer_bytes,
    draw_recompute,
    draw_tensor_parallel_bytes,
    explorer_curves,
    head_multiple,
    layer_bytes,
    loss_of,
    measure_step,
    saved_tensors,
    stats_bytes,
    step_flops,
    time_steps,
)
from course_lib.activations.oom import (
    RUNGS,
    Setup,
    allocation_scale,
    attempt,
    estimate,
    ladder,
    memory_limit,
    oom_message,
    train_step,
    unmap_freed_memory,
)
from course_lib.activations.recompute import (
    RECOMPUTE_MODES,
    Checkpointed,
    block_stack,
    checkpoint_from_scratch,
    save_matmuls,
)
