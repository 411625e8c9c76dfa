"""Solutions to notebook 06's exercises (load in the notebook with `%load solutions/06_checkpointing.py`).

Each function is self-contained (imports inside), because `check` sends its source to the ranks.
"""

# Exercise 1 (predict): the bytes of tensor rows one rank reads when LOAD_NPROC ranks load the checkpoint.
# Each loading rank holds (and reads) 1/M of every sharded tensor, whatever number of ranks saved it:
#     predicted_row_bytes = S / M = 12 * P / LOAD_NPROC     (S = 12 P: weights and Adam's two moments in fp32)


def predicted_row_bytes(parameters: int, loading_ranks: int) -> float:
    return 12 * parameters / loading_ranks


# Exercise 2 (implement): verify one checkpoint on all ranks together. `verify` opens and hashes every file;
# on N ranks each can hash 1/N of them (any split every rank computes the same way: here every N-th name of the
# sorted list), and one collective combines the verdicts, so that every rank returns the same answer. A
# checkpoint is complete only if its name is committed, its metadata is readable, and every file it lists
# exists with the recorded size and SHA-256.
def verify_together(directory):
    import hashlib
    import json
    from pathlib import Path

    import torch.distributed as dist

    directory = Path(directory)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ok, files = not directory.name.endswith(".tmp"), {}  # .tmp: the rename (the commit) never happened
    try:
        files = json.loads((directory / "metadata.json").read_text())["files"]
    except (OSError, ValueError, KeyError):
        ok = False  # no readable metadata: the save did not finish
    for name in sorted(files)[rank::world_size]:  # this rank's share of the files
        path, expected = directory / name, files[name]
        ok = ok and path.is_file() and path.stat().st_size == expected["bytes"]
        ok = ok and hashlib.sha256(path.read_bytes()).hexdigest() == expected["sha256"]
    verdicts = [None] * world_size
    dist.all_gather_object(verdicts, ok)  # one collective: every rank learns every share's verdict
    return all(verdicts)


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
