"""Distributed checkpoints: a rank-0 snapshot, torch's DCP, and a sharded checkpointer of our own.

Three ways to save an FSDP2-sharded training state, from the simplest to what large jobs use:

- :func:`save_full_snapshot`: gather the whole state on rank 0 and `torch.save` one file (only rank 0 writes;
  the full model must fit in one process's memory);
- DCP (`torch.distributed.checkpoint`) with an :class:`AppState`: every rank writes its own shards in parallel,
  one metadata file says where every piece lives, and loading reshards onto any world size;
- :func:`save_sharded` / :func:`load_sharded`: the same idea in about 200 lines, so the files DCP writes stop
  being magic.

Every save is *atomic*: it writes into ``step_N.tmp`` and renames to ``step_N`` only when every rank's file
and the metadata are on disk. A checkpoint directory is therefore complete or absent; :func:`verify` checks
sizes and checksums, and :func:`latest_complete` resumes from the newest checkpoint that passes.
:func:`train_resumable` is the fault-tolerant training loop run under ``torchrun --max-restarts``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from course_lib.launch.runtime import rank_device

FORMAT = "course_lib.checkpoint/1"
METADATA = "metadata.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


# ---------------------------------------------------------------------------
# The model, data and training step every example here shares


def sharded_mlp(seed: int = 0, **mlp_kwargs) -> torch.nn.Module:
    """course_lib's MLP with FSDP2: every Linear is a unit, then the root. Parameters become DTensors Shard(0)."""
    from torch.distributed.fsdp import fully_shard

    from course_lib.models import MLP

    model = MLP(seed=seed, **mlp_kwargs).to(rank_device())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def batch_for_step(data, step: int, global_batch: int, rank: int, world_size: int, seed: int = 0):
    """This rank's slice of global batch number `step`: a pure function of the step, so a resumed job
    continues with exactly the samples the interrupted one would have seen (no sampler state to save)."""
    n = len(data)
    per_epoch = n // global_batch
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    batch = order[index * global_batch : (index + 1) * global_batch]
    per_rank = global_batch // world_size
    mine = batch[rank * per_rank : (rank + 1) * per_rank]
    x, y = data.tensors
    return x[mine], y[mine]


def train_step(model, optimizer, x, y) -> float:
    """One optimizer step; returns the mean loss over all ranks (the global batch's loss)."""
    device = next(model.parameters()).device
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    optimizer.step()
    mean = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return mean.item()


# ---------------------------------------------------------------------------
# 1. The classic pattern: the full state, gathered, saved by rank 0


def _rank_world(no_dist: bool = False) -> tuple[int, int]:
    if not no_dist and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(no_dist: bool = False) -> None:
    if not no_dist and dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_full_snapshot(path: str | os.PathLike, model, optimizer, step: int) -> None:
    """Gather the full model and optimizer state onto rank 0 and write one torch.save file there.

    Every rank takes part in the gather; only rank 0 holds the result (cpu_offload) and writes it,
    to a temporary name first, so a crash never leaves a half-written file under the real name.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    rank, _ = _rank_world()
    if rank == 0:
        path = Path(path)
        partial = path.with_name(path.name + ".tmp")
        torch.save({"model": model_state, "optimizer": optimizer_state, "step": step}, partial)
        os.replace(partial, path)  # atomic: the old file or the new one, never half of one
    _barrier()  # nobody goes on (or exits) before the file is complete


def load_full_snapshot(path: str | os.PathLike, model, optimizer) -> int:
    """Every rank reads the full file and keeps its own shard (set_state_dict reshards). Returns the step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    snapshot = torch.load(path, map_location="cpu", weights_only=True)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=snapshot["model"],
        optim_state_dict=snapshot["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    return snapshot["step"]


# ---------------------------------------------------------------------------
# 2. DCP: an AppState that DCP saves and loads in place


class AppState(Stateful):
    """Everything a resumed job needs: model, optimizer, step and RNG state.

    DCP calls `state_dict()` when saving, and when loading it first calls `state_dict()` for a template
    (the sharded tensors of *this* job's world size), fills it from the files, then calls
    `load_state_dict()`. `get_state_dict` / `set_state_dict` turn FSDP2's sharded parameters and the
    optimizer's per-parameter state into the plain, fully-qualified names that DCP stores.
    The ranks of this course draw identical random numbers (same seed, same calls), so one RNG state is
    saved; with per-rank generators save one per rank under rank-specific names.
    """

    def __init__(self, model, optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state, "step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"])


def _commit(partial: Path, final: Path) -> None:
    """Rank 0 makes a finished checkpoint visible: one rename, then the directory entry is made durable."""
    os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(root: Path, step: int, no_dist: bool = False) -> tuple[Path, Path]:
    final, partial = root / f"step_{step}", root / f"step_{step}.tmp"
    if final.exists():
        raise CheckpointError(f"{final.name}: already exists; a checkpoint is never overwritten")
    rank, _ = _rank_world(no_dist)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # the leftovers of a save that died
        partial.mkdir(parents=True)
    _barrier(no_dist)
    return partial, final


def dcp_save(root: str | os.PathLike, step: int, app: AppState) -> Path:
    """dcp.save into step_N.tmp, then commit (rename) to step_N. Blocks training until the files are written."""
    import torch.distributed.checkpoint as dcp

    partial, final = _prepare(Path(root), step)
    dcp.save({"app": app}, checkpoint_id=partial)  # returns on every rank after rank 0 wrote .metadata
    if _rank_world()[0] == 0:
        _commit(partial, final)
    _barrier()
    return final


def dcp_load(directory: str | os.PathLike, app: AppState) -> None:
    """Verify, then load into `app` in place (any world size: DCP reads the overlapping pieces)."""
    import torch.distributed.checkpoint as dcp

    verify(directory)
    dcp.load({"app": app}, checkpoint_id=directory)


class AsyncCheckpointer:
    """dcp.async_save with the two rules that make it safe.

    1. `async_save` returns once the state is *staged* (copied to CPU memory); the files are written by a
       background thread while training continues. The next save first waits for the previous one: two
       saves in flight would double the staging memory and could interleave their collectives.
    2. Only a finished save is committed (renamed). Its collectives run on a separate gloo group, so they
       never interleave with the training collectives on the default group.
    On GPUs, `FileSystemWriter(cache_staged_state_dict=True)` keeps one pinned CPU buffer for all saves:
    faster device-to-host copies and no new allocation per save, at the cost of one copy of the state in RAM.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: tuple[Any, Path, Path] | None = None  # (future, partial, final)

    def save(self, step: int, app: AppState) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()
        partial, final = _prepare(self.root, step)
        writer = dcp.FileSystemWriter(partial, cache_staged_state_dict=torch.cuda.is_available())
        future = dcp.async_save({"app": app}, storage_writer=writer, process_group=self.group)
        self.pending = (future, partial, final)

    def wait(self) -> None:
        """Block until the save in flight is on disk, and commit it."""
        if self.pending is None:
            return
        future, partial, final = self.pending
        self.pending = None
        future.result()  # on rank 0 this returns after every rank's data and the metadata are written
        if _rank_world()[0] == 0:
            _commit(partial, final)


# ---------------------------------------------------------------------------
# 3. From scratch: each rank writes its shards, rank 0 writes the metadata


def shard_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) that `rank` holds when `n_rows` are split over `world_size` ranks.

    torch.chunk's rule, which FSDP2's Shard(0) follows: ceil(n/W) rows per rank, the last ranks get
    fewer (possibly none)."""
    per_rank = -(-n_rows // world_size)
    start = min(rank * per_rank, n_rows)
    return start, min(start + per_rank, n_rows)


def read_plan(n_rows: int, saved_world: int, loading_world: int) -> list[list[tuple[int, int, int]]]:
    """For each loading rank: the (saved rank, start, stop) row ranges it must read to rebuild its shard."""
    plan = []
    for loading_rank in range(loading_world):
        start, stop = shard_rows(n_rows, loading_world, loading_rank)
        reads = []
        for saved_rank in range(saved_world):
            s, e = shard_rows(n_rows, saved_world, saved_rank)
            lo, hi = max(start, s), min(stop, e)
            if lo < hi:
                reads.append((saved_rank, lo, hi))
        plan.append(reads)
    return plan


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"0.weight": t}} -> {"model/0.weight": t}; anything that is not a dict is a leaf."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _materialize(state: dict[str, Any]) -> dict[str, Any]:
    """Stateful objects become their state_dict (as DCP does)."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_sharded(root: str | os.PathLike, step: int, state: dict[str, Any], *, no_dist: bool = False) -> Path:
    """Save `state` (nested dicts of DTensors sharded on dim 0, plain tensors and Python values) as step_N.

    Rank r writes shard_r.pt with its rows of every DTensor; rank 0 also writes the plain tensors and
    values, which are the same on every rank. Rank 0 then writes metadata.json (shapes, dtypes, which file
    holds which rows, each file's size and SHA-256) and renames step_N.tmp to step_N: the commit.
    Without a process group (or with no_dist=True), the calling process is a world of one.
    """
    from torch.distributed.tensor import DTensor

    rank, world_size = _rank_world(no_dist)
    partial, final = _prepare(Path(root), step, no_dist)
    mine: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, value in _flatten(_materialize(state)).items():
        if isinstance(value, DTensor):
            start, stop = shard_rows(value.shape[0], world_size, rank)
            local = value.to_local()
            if local.shape[0] != stop - start:
                raise CheckpointError(
                    f"{name}: rank {rank} holds {local.shape[0]} rows, expected {stop - start} "
                    "(only dim-0 sharding over the whole world is supported)"
                )
            mine[name] = local.detach().cpu().clone()
            chunks: list[dict[str, Any]] = [
                {"file": f"shard_{r}.pt", "rows": list(shard_rows(value.shape[0], world_size, r))}
                for r in range(world_size)
            ]
        elif isinstance(value, torch.Tensor):
            if rank == 0:
                mine[name] = value.detach().cpu().clone()
            rows = value.shape[0] if value.dim() else 1
            chunks = [{"file": "shard_0.pt", "rows": [0, rows]}]
        else:
            objects[name] = value
            continue
        entries[name] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "chunks": [c for c in chunks if c["rows"][0] < c["rows"][1] or value.dim() == 0],
        }
    shard = partial / f"shard_{rank}.pt"
    torch.save({"tensors": mine, "objects": objects if rank == 0 else {}}, shard)
    with open(shard, "rb+") as f:
        os.fsync(f.fileno())  # on disk before the commit can claim it is
    info = {"file": shard.name, "bytes": shard.stat().st_size, "sha256": _sha256(shard)}
    files: list[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(files, info)
    else:
        files = [info]
    if rank == 0:
        metadata = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size,
            "files": {f["file"]: {"bytes": f["bytes"], "sha256": f["sha256"]} for f in files},
            "tensors": entries,
        }
        (partial / METADATA).write_text(json.dumps(metadata, indent=1))  # the last file of the checkpoint
        _commit(partial, final)
    _barrier(no_dist)
    return final


def verify(directory: str | os.PathLike) -> dict[str, Any]:
    """Raise CheckpointError unless `directory` is a complete checkpoint (ours or DCP's); return its metadata.

    Ours: metadata.json present, every file it lists present with the recorded size and SHA-256.
    DCP's: .metadata present and every .distcp file at least as long as the byte ranges it indexes.
    """
    directory = Path(directory)
    name = directory.name
    if not directory.is_dir():
        raise CheckpointError(f"{name}: no such checkpoint directory")
    if name.endswith(".tmp"):
        raise CheckpointError(f"{name}: an uncommitted save (its job died before the rename)")
    if (directory / ".metadata").exists() and not (directory / METADATA).exists():
        return _verify_dcp(directory)
    meta_path = directory / METADATA
    if not meta_path.exists():
        raise CheckpointError(f"{name}/{METADATA}: missing; the save did not finish")
    try:
        metadata = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{name}/{METADATA}: unreadable ({error})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{name}/{METADATA}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    for file, expected in metadata["files"].items():
        path = directory / file
        if not path.exists():
            raise CheckpointError(f"{name}/{file}: missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{name}/{file}: truncated or overwritten: {size} bytes, metadata records {expected['bytes']}"
            )
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{name}/{file}: corrupt: SHA-256 differs from the metadata")
    return metadata


def _verify_dcp(directory: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as error:
        raise CheckpointError(f"{directory.name}/.metadata: unreadable ({type(error).__name__})") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for file, size in sorted(needed.items()):
        path = directory / file
        if not path.exists():
            raise CheckpointError(f"{directory.name}/{file}: missing")
        if path.stat().st_size < size:
            raise CheckpointError(
                f"{directory.name}/{file}: truncated: {path.stat().st_size} bytes, the metadata indexes {size}"
            )
    return {"format": "dcp", "files": {f: {"bytes": s} for f, s in needed.items()}}


def load_sharded(directory: str | os.PathLike, state: dict[str, Any]) -> dict[str, list[str]]:
    """Fill `state` (same structure as when saved, at *any* world size) from a checkpoint, in place.

    DTensors get the rows this rank holds now, read from whichever saved shards overlap them
    (:func:`read_plan`); plain tensors get the whole tensor; Python values are replaced. Stateful
    values are loaded through their `state_dict()` template and `load_state_dict()`, like DCP.
    Returns, per tensor, the files this rank read: resharding made visible.
    """
    from torch.distributed.tensor import DTensor

    directory = Path(directory)
    metadata = verify(directory)
    if metadata["format"] != FORMAT:
        raise CheckpointError(f"{directory.name}: a DCP checkpoint; load it with dcp.load")
    rank, world_size = _rank_world()
    opened: dict[str, dict] = {}

    def shard(file: str) -> dict:
        if file not in opened:  # mmap: only the rows read are paged in
            opened[file] = torch.load(directory / file, map_location="cpu", weights_only=True, mmap=True)
        return opened[file]

    materialized = _materialize(state)
    flat = _flatten(materialized)
    objects = shard("shard_0.pt")["objects"]
    missing = [n for n, t in flat.items() if isinstance(t, torch.Tensor) and n not in metadata["tensors"]]
    if missing:
        raise CheckpointError(
            f"{directory.name}: has no tensor {missing[0]!r} ({len(missing)} of this model's "
            f"tensors missing): a checkpoint from a different model"
        )
    files_read: dict[str, list[str]] = {}
    for name, target in flat.items():
        if not isinstance(target, torch.Tensor):
            if name not in objects:
                raise CheckpointError(f"{directory.name}: has no value {name!r}: saved from a different program?")
            flat[name] = objects[name]
            continue
        entry = metadata["tensors"][name]
        if entry["shape"] != list(target.shape):
            raise CheckpointError(
                f"{directory.name}: {name!r} was saved with shape {entry['shape']}, "
                f"this model has {list(target.shape)}: a checkpoint from a different model"
            )
        if entry["dtype"] != str(target.dtype).removeprefix("torch."):
            raise CheckpointError(
                f"{directory.name}: {name!r} was saved as {entry['dtype']}, this model has {target.dtype}"
            )
        if isinstance(target, DTensor):
            start, stop = shard_rows(target.shape[0], world_size, rank)
            local = target.to_local()
        else:
            start, stop = 0, (target.shape[0] if target.dim() else 1)
            local = target
        files_read[name] = []
        for chunk in entry["chunks"]:
            lo, hi = max(start, chunk["rows"][0]), min(stop, chunk["rows"][1])
            if lo >= hi:
                continue
            saved = shard(chunk["file"])["tensors"][name]
            if target.dim() == 0:
                local.copy_(saved)
            else:
                local[lo - start : hi - start].copy_(saved[lo - chunk["rows"][0] : hi - chunk["rows"][0]])
            files_read[name].append(chunk["file"])
    loaded = _unflatten(flat)
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]
    return files_read


def files_of(directory: str | os.PathLike) -> list[tuple[str, int]]:
    """(relative name, bytes) of every file in a checkpoint directory, sorted."""
    directory = Path(directory)
    return sorted((str(p.relative_to(directory)), p.stat().st_size) for p in directory.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------
# 4. Resuming: the newest complete checkpoint


def latest_complete(root: str | os.PathLike) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest committed checkpoint under `root` that passes :func:`verify`, and what was skipped (why).

    Newest by step *number* (step_10 after step_9, which string order gets wrong); directories still named
    .tmp are saves that never finished; a corrupt or truncated one is skipped, so the job falls back to
    the one before it.
    """
    root = Path(root)
    if not root.is_dir():
        return None, []
    candidates = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))), reverse=True)
    skipped = [(p.name, "uncommitted") for p in sorted(root.glob("step_*.tmp"))]
    for _, path in candidates:
        try:
            verify(path)
            return path, skipped
        except CheckpointError as error:
            skipped.append((path.name, str(error)))
    return None, skipped


def reference_find_latest_complete(root):
    """The exercise's reference answer: a path, or None."""
    return latest_complete(root)[0]


# ---------------------------------------------------------------------------
# 5. The fault-tolerant loop


def train_resumable(
    root: str | os.PathLike,
    total_steps: int,
    every: int,
    *,
    kill_at: int | None = None,
    kill_rank: int = -1,
    global_batch: int = 48,
    log: str | os.PathLike | None = None,
):
    """Train `total_steps` steps with a DCP checkpoint every `every` steps, resuming from the newest complete one.

    In the first attempt (TORCHELASTIC_RESTART_COUNT=0), rank `kill_rank` (-1: the last) dies by SIGKILL
    just before step `kill_at`: a real process death, nothing Python can catch. torchrun then stops the
    other ranks and restarts the whole group, which resumes here. Rank 0 appends one JSON line per step
    to `log`. Returns (model, optimizer, first step of this attempt).
    """
    from course_lib.data import regression

    rank, world_size = _rank_world()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    data = regression(n=480)
    model = sharded_mlp()
    optimizer = make_optimizer(model)
    app = AppState(model, optimizer)
    found = [latest_complete(root)[0] if rank == 0 else None]  # one rank decides, all follow
    if dist.is_initialized():
        dist.broadcast_object_list(found)
    if found[0] is not None:
        dcp_load(found[0], app)
    start = app.step
    for step in range(start, total_steps):
        if attempt == 0 and step == kill_at and rank == kill_rank % world_size:
            print(f"rank {rank}: SIGKILL to myself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch_for_step(data, step, global_batch, rank, world_size)
        loss = train_step(model, optimizer, x, y)
        app.step = step + 1
        if rank == 0 and log is not None:
            with open(log, "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": step, "loss": loss}) + "\n")
        if app.step % every == 0:
            dcp_save(root, app.step, app)
    return model, optimizer, start


def local_state(model, optimizer) -> torch.Tensor:
    """This rank's parameters and optimizer state as one flat tensor: what "bitwise equal" compares."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().reshape(-1).float()

    parts = [local(p) for p in model.parameters()]
    for state in optimizer.state.values():
        parts += [local(v) for _, v in sorted(state.items())]
    return torch.cat(parts)


# ---------------------------------------------------------------------------
# 6. How long a save stalls training


def time_saves(
    root: str | os.PathLike, mode: str, steps: int = 8, every: int = 2, **mlp_kwargs
) -> dict[str, list[float]]:
    """Train `steps` steps of an FSDP2 MLP, saving after every `every`-th with mode "none", "sync" or "async".

    Returns this rank's seconds per step ("step", a saving step including its save) and the seconds the
    training thread was blocked in each save call ("blocked"): the stall. An async save waits for the
    previous one first, and that wait counts as stall too.
    """
    rank, world_size = _rank_world()
    root = Path(root) / mode
    model = sharded_mlp(**mlp_kwargs)
    optimizer = make_optimizer(model)
    app = AppState(model, optimizer)
    d_in, d_out = mlp_kwargs.get("d_in", 32), mlp_kwargs.get("d_out", 8)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, d_in, generator=generator), torch.randn(64, d_out, generator=generator)
    checkpointer = AsyncCheckpointer(root) if mode == "async" else None
    times: dict[str, list[float]] = {"step": [], "blocked": []}
    for step in range(steps):
        _barrier()
        begin = time.perf_counter()
        train_step(model, optimizer, x, y)
        app.step = step + 1
        if mode != "none" and app.step % every == 0:
            save_begin = time.perf_counter()
            if mode == "sync":
                dcp_save(root, app.step, app)
            else:
                assert checkpointer is not None
                checkpointer.save(app.step, app)
            times["blocked"].append(time.perf_counter() - save_begin)
        times["step"].append(time.perf_counter() - begin)
    if checkpointer is not None:
        checkpointer.wait()
    _barrier()
    return times


# ---------------------------------------------------------------------------
# Exercise: find the newest complete checkpoint


def _exercise_fixtures(base: Path) -> list[tuple[str, Path, str | None]]:
    """Directories of checkpoints, good and bad, each with the expected answer (a directory name or None)."""

    def save(root: Path, step: int) -> Path:
        return save_sharded(root, step, {"weights": torch.arange(6.0) + step, "step": step}, no_dist=True)

    cases: list[tuple[str, Path, str | None]] = []
    root = base / "newest_truncated"
    for step in (2, 9, 10):
        save(root, step)
    shard = root / "step_10" / "shard_0.pt"
    shard.write_bytes(shard.read_bytes()[:-20])
    save(root, 11).rename(root / "step_11.tmp")  # committed name removed: never finished
    (root / "step_12").mkdir()  # a directory with no metadata
    (root / "notes.txt").write_text("not a checkpoint")
    cases.append(("the newest is truncated, newer ones are partial", root, "step_9"))
    root = base / "numeric_order"
    for step in (9, 10):
        save(root, step)
    cases.append(("step_10 is newer than step_9", root, "step_10"))
    root = base / "all_bad"
    save(root, 4)
    (root / "step_4" / METADATA).unlink()
    save(root, 5)
    (root / "step_5" / "shard_0.pt").write_bytes(b"garbage")
    cases.append(("no complete checkpoint", root, None))
    cases.append(("the directory does not exist yet", base / "missing", None))
    return cases


def check_find_latest_complete(find_latest_complete) -> None:
    """Exercise checker: run on every rank against fixtures in a private directory."""
    from course_lib.exercises import ExerciseFailed

    with tempfile.TemporaryDirectory() as base:
        for what, root, expected in _exercise_fixtures(Path(base)):
            try:
                got = find_latest_complete(str(root))
            except Exception as error:
                raise ExerciseFailed(f"{what}: raised {type(error).__name__}: {error}") from None
            got_name = None if got is None else Path(got).name
            if got_name != expected:
                raise ExerciseFailed(f"{what}: expected {expected!r}, got {got_name!r}")


def full_state(model, optimizer) -> dict[str, Any]:
    """The whole model and optimizer state as flat {name: tensor} on rank 0 ({} elsewhere): for comparisons."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return flat_tensors({"model": model_state, "optimizer": optimizer_state})


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a nested state, by flattened name ("model/0.weight")."""
    return {k: v for k, v in _flatten(state).items() if isinstance(v, torch.Tensor)}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (or present in only one)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]
