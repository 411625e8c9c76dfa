"""Solutions to notebook 06's exercises (load in the notebook with `%load solutions/06_checkpointing.py`).

Each function is self-contained (imports inside), because `check` sends its source to the ranks.
"""

# Exercise 1 (predict): the bytes of tensor rows one rank reads when LOAD_NPROC ranks load the checkpoint.
# Each loading rank holds (and reads) 1/M of every sharded tensor, whatever number of ranks saved it:
#     predicted_row_bytes = S / M = 12 * P / LOAD_NPROC     (S = 12 P: weights and Adam's two moments in fp32)


def predicted_row_bytes(parameters: int, loading_ranks: int) -> float:
    return 12 * parameters / loading_ranks


# Exercise 2 (implement): the newest complete checkpoint under root, or None.
def find_latest_complete(root):
    import re
    from pathlib import Path

    from course_lib import checkpoint

    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted(
        ((int(m.group(1)), path) for path in root.iterdir() if (m := re.fullmatch(r"step_(\d+)", path.name))),
        reverse=True,  # by number: step_10 after step_9
    )
    for _, path in steps:
        try:
            checkpoint.verify(path)
            return path
        except checkpoint.CheckpointError:
            continue  # truncated or corrupt: fall back to the one before
    return None


# Exercise 3 (diagnose): every rank chose from its own view of the directory, so after a restart the ranks
# resumed from different steps. One rank (0) decides, and every rank follows its choice.
def resume_step(root):
    import torch.distributed as dist

    from course_lib import checkpoint

    choice = [None]
    if dist.get_rank() == 0:
        found, _ = checkpoint.latest_complete(root)
        choice = [None if found is None else int(found.name.removeprefix("step_"))]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]
