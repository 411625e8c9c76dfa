"""Rank programs of tests/test_pipeline.py: from-scratch pipelines against torch's, and the exercise checker."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import pipeline as pp


def equality(rank: int, world_size: int) -> dict:
    """Every schedule on 2..world_size ranks against one process and torch; a side group; naive MP; timings."""
    pair = dist.new_group([0, 1])
    torch.manual_seed(1)
    x, y = torch.randn(48, 64), torch.randn(48, 8)
    report = []
    for p in range(2, world_size + 1):
        group = dist.new_group(list(range(p)))  # every rank must create every group
        if rank < p:
            for schedule in pp.SCHEDULES:
                v = 2 if schedule == "interleaved 1F1B" else 1
                # torch's Schedule1F1B needs m >= p; interleaved here needs m to be a multiple of p
                for m in {"GPipe": (1, 4, 12), "1F1B": (4, 12), "interleaved 1F1B": (p, 4 * p)}[schedule]:
                    ref_loss, expected = pp.reference_stage_gradients(pp.course_model(), p * v, x, y)
                    record, ours = pp.schedule_step(schedule, m, x, y, stage_ranks=range(p))
                    torch_losses, theirs, _ = pp.torch_schedule_step(schedule, m, x, y, group=group)
                    versus_torch = pp.max_gradient_error(ours, pp.gradients_by_stage(theirs))
                    report.append(
                        dict(
                            p=p,
                            schedule=schedule,
                            m=m,
                            versus_single=pp.max_gradient_error(ours, expected),
                            versus_torch=versus_torch,
                            mean_loss=sum(record.losses.values()) / m if record.losses else None,
                            ref_loss=ref_loss,
                            torch_losses=torch_losses,
                            our_losses=[record.losses.get(i) for i in range(m)],
                            peak=record.peak,
                            expected_peak=pp.peak_in_flight(pp.schedule_actions(schedule, p, m)[rank]),
                        )
                    )
        dist.barrier()

    # messages through a separate gloo group (the path NCCL jobs take)
    side = dist.new_group(backend="gloo")
    _, expected = pp.reference_stage_gradients(pp.course_model(), world_size, x, y)
    _, ours = pp.schedule_step("1F1B", 8, x, y, group=side)
    side_group_error = pp.max_gradient_error(ours, expected)

    # naive model parallelism over all ranks
    ref_loss, expected = pp.reference_stage_gradients(pp.course_model(), world_size, x, y)
    mine = pp.split_into_stages(pp.course_model(), world_size)[rank]
    naive_loss = pp.naive_model_parallel(mine, x, y, pp.mse_loss, (48, 64))
    naive = dict(error=pp.max_gradient_error({rank: mine}, expected), loss=naive_loss, ref_loss=ref_loss)

    # GPipe on 2 ranks with 1 and 8 micro-batches: what each rank ran, in order, with its wall times
    runs = {}
    for m in (1, 8):
        dist.barrier()
        if rank < 2:
            pad = {"F": 0.004, "B": 0.008}
            record, _ = pp.schedule_step("GPipe", m, x, y, stage_ranks=[0, 1], min_seconds=pad)
            both: list = [None, None]
            dist.all_gather_object(both, record.events, group=pair)
            runs[m] = both[0] + both[1]
    return dict(report=report, naive=naive, runs=runs, side_group_error=side_group_error)
