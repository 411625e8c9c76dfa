"""Notebook 06: distributed checkpoints: a rank-0 snapshot, torch's DCP, and a sharded checkpointer of our own."""

from course_lib.checkpoint.atomic import (
    METADATA,
    CheckpointError,
    files_of,
    latest_complete,
    load_full_snapshot,
    save_full_snapshot,
    verify,
)
from course_lib.checkpoint.checkers import check_newest_complete_step, check_verify_together
from course_lib.checkpoint.dcp import (
    CONSOLIDATED,
    AppState,
    AsyncCheckpointer,
    dcp_load,
    dcp_save,
    empty_sharded_mlp,
    from_rank0,
    from_seed_checkpoint,
    gathered_weights,
    load_safetensors,
    save_safetensors,
)
from course_lib.checkpoint.lab import draw_reads
from course_lib.checkpoint.raw_rows import bytes_read_by_process, row_bytes, write_rows
from course_lib.checkpoint.sharded import (
    bytes_to_read,
    flat_tensors,
    load_sharded,
    read_my_rows,
    read_plan,
    save_sharded,
    shard_rows,
)
from course_lib.checkpoint.train import (
    differing,
    full_state,
    local_state,
    make_optimizer,
    sharded_mlp,
    time_saves,
    train_resumable,
    train_step,
)
