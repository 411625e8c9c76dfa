"""Notebook 04: number formats, autocast inspection, and dynamic loss scaling from scratch.

- number_formats: fp32/fp16/bf16 layouts, what a value becomes when stored, its rounding error
- inspection: the dtype of every op under autocast; FSDP2's MixedPrecisionPolicy on the wire
- loss_scaler: DynamicLossScaler (GradScaler from scratch) and the found-inf check across ranks
- train: one training loop for both scalers; the loss curves per precision mode
- anti_pattern: MixedPrecisionTrainer, a hand-managed scale next to GradScaler (do not copy)
- figures: the formats table and (GPU) matmul throughput
- checkers: the exercise checkers (found-inf across ranks, a GradScaler step with clipping)
"""

from course_lib.precision.anti_pattern import MixedPrecisionTrainer
from course_lib.precision.checkers import check_clipped_scaler_step, check_found_inf
from course_lib.precision.figures import finfo_table, matmul_tflops
from course_lib.precision.inspection import inspect_fsdp2_mixed_precision, record_op_dtypes
from course_lib.precision.loss_scaler import DynamicLossScaler, found_inf_across_ranks, local_grads
from course_lib.precision.number_formats import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    LAYOUT,
    bit_fields,
    rounding_error,
    smallest_subnormal,
    stored_value,
)
from course_lib.precision.train import (
    PRECISION_MODES,
    amp_training_loop,
    poison_one_gradient,
    rank_batches,
    train_precision_mode,
)

__all__ = [
    "DTYPE_NAMES",
    "FLOAT_DTYPES",
    "LAYOUT",
    "PRECISION_MODES",
    "DynamicLossScaler",
    "MixedPrecisionTrainer",
    "amp_training_loop",
    "bit_fields",
    "check_clipped_scaler_step",
    "check_found_inf",
    "finfo_table",
    "found_inf_across_ranks",
    "inspect_fsdp2_mixed_precision",
    "local_grads",
    "matmul_tflops",
    "poison_one_gradient",
    "rank_batches",
    "record_op_dtypes",
    "rounding_error",
    "smallest_subnormal",
    "stored_value",
    "train_precision_mode",
]
