"""Notebook 06: distributed checkpoints: a rank-0 snapshot, torch's DCP, and a sharded checkpointer of our own.

Three ways to save an FSDP2-sharded training state, from the simplest to what large jobs use:

    snapshot    gather the whole state, rank 0 writes one torch.save file (it must fit in one process)
    dcp         torch.distributed.checkpoint with an AppState: every rank writes its shards in parallel,
                loading reshards onto any world size; AsyncCheckpointer saves in the background
    sharded     the same idea from scratch (save_sharded / load_sharded), so DCP's files stop being magic;
                bytes_to_read: what each loading rank must read, from the metadata alone
    raw_rows    its shard files: raw rows with a CRC-32 each; reads that fetch and check only a rank's rows
    atomic      every save writes step_N.tmp and renames it to step_N when complete: complete or absent
    integrity   verify (sizes, checksums) and latest_complete: resume from the newest good checkpoint
    train       the shared FSDP2 model and steps, the fault-tolerant loop (train_resumable), save stalls
    elastic_train  the rank side of an elastic run: resume at any world size, pause for membership changes
    fault_tolerance  torchft: replica groups with a lighthouse keep training when one dies (train_replica)
    local_sgd   LocalSGD and DiLoCo against DDP with torchft, the bytes of every all-reduce counted (train_synced)
    lab         the kernel side: two torchrun agents join and leave one c10d rendezvous (run_elastic); one
                torchrun run per torchft replica and a lighthouse (run_torchft, compare_sync); the elastic
                run's loss curve, who reads which rows at another world size
    hf          out to Hugging Face safetensors through DCP (one consolidated file) and back into any layout;
                a seed checkpoint (meta-device model, then load) next to broadcast from rank 0
    checkers    the exercises: verify a checkpoint together (each rank its share); the newest complete checkpoint
"""

from course_lib.checkpoint.atomic import METADATA, CheckpointError
from course_lib.checkpoint.checkers import check_newest_complete_step, check_verify_together
from course_lib.checkpoint.dcp import AppState, AsyncCheckpointer, dcp_load, dcp_save
from course_lib.checkpoint.elastic_train import train_elastic
from course_lib.checkpoint.fault_tolerance import LIGHTHOUSE, reference_losses, step_losses, torchft_step
from course_lib.checkpoint.hf import (
    CONSOLIDATED,
    empty_sharded_mlp,
    from_rank0,
    from_seed_checkpoint,
    gathered_weights,
    load_safetensors,
    save_safetensors,
)
from course_lib.checkpoint.integrity import files_of, latest_complete, verify
from course_lib.checkpoint.lab import (
    Segment,
    agent_messages,
    compare_sync,
    draw_reads,
    plot_elastic,
    run_elastic,
    run_torchft,
    segments,
)
from course_lib.checkpoint.local_sgd import SYNC_RUNS, synchronised
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
from course_lib.checkpoint.snapshot import load_full_snapshot, save_full_snapshot
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
