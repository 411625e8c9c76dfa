"""Notebook 15, the capstone: a small GPT trained on the course's own prose in every layout of the course."""

from course_lib.gpt.checkers import check_embedding_group, check_rows_on_mesh
from course_lib.gpt.lab import (
    compiled_summary,
    draw_drift,
    draw_layout_plan,
    draw_layout_runs,
    drift_tolerance,
    evaluate,
    run_layout,
    sample_text,
    speed_table,
)
from course_lib.gpt.layouts import (
    Layout,
    adam_per_mesh,
    apply_compile,
    compiled_layouts,
    layouts,
    parallelize,
    sync_tied_gradients,
)
from course_lib.gpt.model import (
    GPT,
    GPTConfig,
    Head,
    count_parameters,
    flops_per_token,
    loss_fn,
    pipeline_stage,
    sample,
)
from course_lib.gpt.predict import (
    counted_flops,
    device_peak_flops,
    matmul_flops,
    parameters_before_dp,
    peak_flops_of,
    predicted_memory,
    predicted_shard_bytes,
    predicted_traffic,
)
from course_lib.gpt.text import ShardedBatches, course_text, entropy_baselines, split, tokens_and_tokenizer
from course_lib.gpt.train import default_config, fingerprint, load, loss_share, pipeline_step, plain_step, save
