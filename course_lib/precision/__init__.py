"""Notebook 04: number formats, autocast inspection, and dynamic loss scaling from scratch."""

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
from course_lib.precision.inspection import (
    DTYPE_NAMES,
    FLOAT8_DTYPES,
    FLOAT_DTYPES,
    LAYOUT,
    bit_fields,
    inspect_fsdp2_mixed_precision,
    record_op_dtypes,
    rounding_error,
    stored_value,
)
from course_lib.precision.lab import (
    draw_float8_layouts,
    draw_op_dtypes,
    draw_policy_stages,
    draw_storage,
    finfo_table,
    matmul_tflops,
    special_patterns,
)
from course_lib.precision.loss_scaler import DynamicLossScaler, MixedPrecisionTrainer, found_inf_across_ranks
from course_lib.precision.train import PRECISION_MODES, amp_training_loop, rank_batches, train_precision_mode
