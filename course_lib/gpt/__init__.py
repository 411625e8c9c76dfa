"""Notebook 15, the capstone: a small GPT trained on the course's own prose in every layout of the course.

snapshot     the data set: the course's markdown at one commit, written once to course_text.txt
text         character tokens, the fixed train/validation split, a loader that gives each dp rank its rows
model        the GPT: embeddings, the course's TransformerBlocks, a head tied to the token table; FLOPs
layouts      one process, DDP, FSDP2, FSDP2 x TP, PP x FSDP2 x TP (one function per mesh dimension); compiled
train        the training run every layout shares (the counted step, the timed steps, checkpoints)
checkpoints  DCP save/load with notebook 06's AppState, and a fingerprint of the whole state
measure      FLOPs counted, the matmul limit, a GPU's peak, bytes sent (comms.Recorder)
predict      memory per rank and bytes per step from the course's calculators (memory, compose.plan)
lab          a %%torchrun cell's run: train and measure; evaluation and samples; the kernel's table and figures
checkers     the exercises' checkers (solutions: notebooks/solutions/15_capstone_gpt.py)
"""

from course_lib.gpt.checkers import check_embedding_group, check_rows_on_mesh
from course_lib.gpt.checkpoints import fingerprint, load, save
from course_lib.gpt.lab import (
    compiled_against_eager,
    draw_drift,
    draw_plan,
    draw_runs,
    drift_tolerance,
    evaluate,
    run_layout,
    sample_text,
    speed_table,
)
from course_lib.gpt.layouts import (
    Layout,
    apply_compile,
    compiled_layouts,
    layouts,
    make_optimizer,
    parallelize,
    sync_tied_gradients,
)
from course_lib.gpt.measure import counted_flops, device_peak_flops, matmul_flops, peak_flops_of
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
from course_lib.gpt.predict import parameters_before_dp, predicted_memory, predicted_shard_bytes, predicted_traffic
from course_lib.gpt.text import ShardedBatches, course_text, entropy_baselines, split, tokens_and_tokenizer
from course_lib.gpt.train import default_config, loss_share, pipeline_step, plain_step
