"""Notebook 04: number formats, autocast inspection, and dynamic loss scaling from scratch.

- number_formats: fp32/fp16/bf16 layouts, what a value becomes when stored, its rounding error
- inspection: the dtype of every op under autocast; FSDP2's MixedPrecisionPolicy on the wire
- loss_scaler: DynamicLossScaler (GradScaler from scratch) and the found-inf check across ranks
- train: one training loop for both scalers; the loss curves per precision mode
- anti_pattern: MixedPrecisionTrainer, a hand-managed scale next to GradScaler (do not copy)
- lab: the formats table, (GPU) matmul throughput, the storage explorer
- float8: e4m3/e5m2, scaled casts from scratch, which Linears go float8, FSDP2 with the float8 all-gather, speed
- checkers: the exercise checkers (found-inf across ranks, a GradScaler step with clipping)
"""

from course_lib.precision.anti_pattern import MixedPrecisionTrainer
from course_lib.precision.checkers import check_clipped_scaler_step, check_found_inf
from course_lib.precision.float8 import (
    cast_error,
    float8_filter,
    float8_recipe,
    float8_tensor_cores,
    float8_width,
    formats_table,
    from_float8,
    fsdp_model,
    matmul_and_linear_seconds,
    to_float8,
    train_fsdp,
    why_high_precision,
)
from course_lib.precision.inspection import inspect_fsdp2_mixed_precision, record_op_dtypes
from course_lib.precision.lab import (
    draw_float8_layouts,
    draw_op_dtypes,
    draw_policy_stages,
    draw_storage,
    finfo_table,
    matmul_tflops,
    special_patterns,
)
from course_lib.precision.loss_scaler import DynamicLossScaler, found_inf_across_ranks
from course_lib.precision.number_formats import (
    DTYPE_NAMES,
    FLOAT8_DTYPES,
    FLOAT_DTYPES,
    LAYOUT,
    bit_fields,
    rounding_error,
    stored_value,
)
from course_lib.precision.train import PRECISION_MODES, amp_training_loop, rank_batches, train_precision_mode
