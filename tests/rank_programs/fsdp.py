"""Rank programs for tests/test_fsdp.py: ZeRO 0-3 from scratch and fully_shard against one process."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

UNIT_NUMELS = [1485, 2070, 322]
STEPS, CLIP = 3, 0.5

# Two optimizers: Adam with clipping (sharded optimizer state of 2 tensors per parameter and the
# sharded gradient norm, one extra all-reduce) and SGD with momentum without clipping (1 state
# tensor per parameter, no all-reduce at all in ZeRO-2/3 and fully_shard).
OPTIMIZERS: dict[str, tuple[Callable, float | None, int]] = {  # name: (make, clip, state tensors per parameter)
    "adam+clip": (lambda ps: torch.optim.Adam(ps, lr=1e-2), CLIP, 2),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), None, 1),
}


def _solutions() -> dict:
    """notebooks/solutions/03_fsdp2.py's functions (the prediction needs the notebook's P_WIDE)."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "notebooks" / "solutions" / "03_fsdp2.py"
    return runpy.run_path(str(path), init_globals={"P_WIDE": 1.0})


def equality(rank: int, world_size: int) -> dict:
    """Every stage and fully_shard against one process, for both optimizers; collective counts and
    bytes held against the formulas; sub-groups; the exercise checker against wrong answers."""
    from course_lib import comms, compare, fsdp, memory
    from course_lib.exercises import ExerciseFailed
    from course_lib.models import shard_layers_then_root

    problems: list[str] = []

    def expect(condition: bool, what: str) -> None:
        if not condition:
            problems.append(f"rank {rank}: {what}")

    expect(any(n % world_size for n in UNIT_NUMELS), "some unit size must not divide by N")
    total = sum(UNIT_NUMELS)
    shard = memory.zero_numel(UNIT_NUMELS, world_size, rank)
    for name, (make_opt, clip, states) in OPTIMIZERS.items():
        single = fsdp.make_model()
        opt = make_opt(single.parameters())

        def single_clip(model=single, clip=clip):
            return torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

        fsdp.train(single, opt, STEPS, micro_batch=8 * world_size, clip=single_clip if clip else None)
        reference = compare.full_parameters(single)
        for stage in range(4):
            model = fsdp.ZeroModel(fsdp.make_model(), stage)
            opt = make_opt(model.parameters())

            def zero_clip(model=model, clip=clip):
                return model.clip_grad_norm_(clip)

            with comms.Recorder() as rec:
                fsdp.train(model, opt, STEPS, world_size=world_size, rank=rank, clip=zero_clip if clip else None)
            calls = {k: v // STEPS for k, v in rec.counts().items()}
            want_calls = fsdp.zero_collectives(stage, 3, clip=clip is not None)
            expect(calls == want_calls, f"{name} ZeRO-{stage} calls {calls}, expected {want_calls}")
            diff = compare.max_difference(model.full_state(), reference)
            expect(diff < 1e-6, f"{name} ZeRO-{stage} differs from one process by {diff}")
            optimizer_elements = states * (total if stage == 0 else shard)
            want = {
                0: (total, total),
                1: (total, total),
                2: (total, shard),
                3: (shard, shard),
            }[stage] + (optimizer_elements,)
            held = memory.held_bytes(model, opt)
            expect(
                (held["params"], held["grads"], held["optimizer"]) == tuple(4 * w for w in want),
                f"{name} ZeRO-{stage} bytes {held} vs elements {want}",
            )
            # a shard is local: no rank may hold another's elements
            expect(
                sum(u.shard.numel() for u in model.units) == (total if stage == 0 else shard),
                f"{name} ZeRO-{stage} shard sizes",
            )
        model = fsdp.make_model()  # a unit per hidden layer; the root holds the head
        shard_layers_then_root(model, [m for m in model if isinstance(m, torch.nn.Linear)][:-1])
        opt = make_opt(model.parameters())

        def torch_clip(model=model, clip=clip):
            return torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

        with comms.Recorder() as rec:
            fsdp.train(model, opt, STEPS, world_size=world_size, rank=rank, clip=torch_clip if clip else None)
        counts = {k: v // STEPS for k, v in rec.counts().items()}
        want_counts = {"all_gather": 5, "reduce_scatter": 3, **({"all_reduce": 1} if clip else {})}
        expect(counts == want_counts, f"{name} fully_shard counts {counts}, expected {want_counts}")
        diff = compare.max_difference(compare.full_parameters(model), reference)
        expect(diff < 1e-6, f"{name} fully_shard differs from one process by {diff}")

    # sub-groups: ZeRO-3 on the first n ranks only
    for n in range(1, world_size + 1):
        group = dist.new_group(list(range(n)))
        if rank < n:
            model = fsdp.ZeroModel(fsdp.make_model(), 3, group=group)
            expect(
                sum(u.shard.numel() for u in model.units) == memory.zero_numel(UNIT_NUMELS, n, rank),
                f"sub-group of {n}: shard size",
            )

    # the exercise checkers, in-process: the solutions pass, wrong answers fail
    solution = _solutions()
    fsdp.check_shard_with_adam_state(solution["shard_with_adam_state"])
    fsdp.check_reduce_gradient(solution["reduce_gradient"])

    def split(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.tensor_split(t.reshape(-1), world_size)

    def chunked(t: torch.Tensor) -> torch.Tensor:
        chunks = t.reshape(-1).chunk(world_size)
        return chunks[rank].clone() if rank < len(chunks) else t.new_empty(0)

    wrong = {
        "torch.chunk (ceil-sized chunks)": lambda p, m, v: tuple(chunked(t) for t in (p, m, v)),
        "rank 0's chunk everywhere": lambda p, m, v: tuple(split(t)[0] for t in (p, m, v)),
        "not flattened": lambda p, m, v: tuple(torch.tensor_split(t, world_size)[rank] for t in (p, m, v)),
        "states swapped": lambda p, m, v: tuple(split(t)[rank] for t in (p, v, m)),
    }
    wrong_failed = {}
    for what, fn in wrong.items():
        try:
            fsdp.check_shard_with_adam_state(fn)
            wrong_failed[what] = False
        except ExerciseFailed:
            wrong_failed[what] = True
    reduce_messages = {}
    wrong_numbers = (reduce_own_chunk, reduce_local_only, reduce_sum_not_mean, reduce_rank0_chunk, reduce_not_flat)
    for fn in (*wrong_numbers, reduce_all_then_slice, reduce_gather_then_sum, reduce_to_each_rank):
        try:
            fsdp.check_reduce_gradient(fn)
            reduce_messages[fn.__name__] = "passed"
        except ExerciseFailed as failure:
            reduce_messages[fn.__name__] = str(failure)
    return {"problems": problems, "wrong_failed": wrong_failed, "reduce_messages": reduce_messages}


# ---- wrong answers to the diagnose exercise (reduce_gradient) -------------------------------------


def reduce_own_chunk(full_grad: torch.Tensor) -> torch.Tensor:  # the notebook's broken function
    n = dist.get_world_size()
    shard = torch.tensor_split(full_grad.reshape(-1), n)[dist.get_rank()].clone()
    dist.all_reduce(shard)
    return shard / n


def reduce_local_only(full_grad: torch.Tensor) -> torch.Tensor:  # no communication at all
    return torch.tensor_split(full_grad.reshape(-1), dist.get_world_size())[dist.get_rank()].clone()


def reduce_sum_not_mean(full_grad: torch.Tensor) -> torch.Tensor:
    total = full_grad.reshape(-1).clone()
    dist.all_reduce(total)
    return torch.tensor_split(total, dist.get_world_size())[dist.get_rank()]


def reduce_rank0_chunk(full_grad: torch.Tensor) -> torch.Tensor:
    total = full_grad.reshape(-1).clone()
    dist.all_reduce(total)
    return torch.tensor_split(total / dist.get_world_size(), dist.get_world_size())[0]


def reduce_not_flat(full_grad: torch.Tensor) -> torch.Tensor:
    total = full_grad.clone()
    dist.all_reduce(total)
    return torch.tensor_split(total / dist.get_world_size(), dist.get_world_size())[dist.get_rank()]


# the shortcuts: right numbers with DDP's traffic (or more), where ZeRO-2 reduce-scatters


def reduce_all_then_slice(full_grad: torch.Tensor) -> torch.Tensor:  # all-reduce everything, keep a chunk
    total = full_grad.reshape(-1).clone()
    dist.all_reduce(total)
    return torch.tensor_split(total / dist.get_world_size(), dist.get_world_size())[dist.get_rank()]


def reduce_gather_then_sum(full_grad: torch.Tensor) -> torch.Tensor:  # every rank's whole gradient, summed here
    everyone = [torch.empty_like(full_grad) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, full_grad.contiguous())
    mean = torch.stack(everyone).mean(0).reshape(-1)
    return torch.tensor_split(mean, dist.get_world_size())[dist.get_rank()]


def reduce_to_each_rank(full_grad: torch.Tensor) -> torch.Tensor:  # N reduces of the whole gradient, one per rank
    n, rank = dist.get_world_size(), dist.get_rank()
    for root in range(n):
        total = full_grad.reshape(-1).clone()
        dist.reduce(total, dst=root)
        if root == rank:
            mine = torch.tensor_split(total / n, n)[rank].clone()
    return mine
