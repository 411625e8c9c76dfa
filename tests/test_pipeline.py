"""course_lib.pipeline: schedules on paper, from-scratch pipelines on real gloo ranks, torch's schedules, exercises."""

import re
import runpy
from pathlib import Path

import pytest
import torch

from course_lib import pipeline as pp
from course_lib.exercises import check
from tests.rank_programs import assert_checker, judge, run, run_source, world_sizes
from tests.rank_programs import pipeline as rank_programs

SOLUTION_FILE = str(Path(__file__).parents[1] / "notebooks" / "solutions" / "09_pipeline_parallel.py")
SOLUTIONS = runpy.run_path(SOLUTION_FILE, init_globals={"NPROC": 2})

# ---- on paper (no processes) ----------------------------------------------------------


@pytest.mark.parametrize("schedule", pp.SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_simulated_bubble_is_the_formula(schedule, p):
    v = 2 if schedule == "interleaved 1F1B" else 1
    for m in [p, 2 * p, 3 * p] if v == 2 else [1, 2, 3, 5, 8]:
        actions = pp.schedule_actions(schedule, p, m)
        pp.validate(actions, p * v, m)
        events = pp.simulate(actions, p * v, t_forward=1.0, t_backward=2.0)
        assert pp.bubble_fraction(events, p) == pytest.approx(pp.ideal_bubble(p, m, v)), (schedule, p, m)


def test_activations_in_flight():
    for p in (2, 3, 4):
        for m in (1, 3, 8):
            for s in range(p):
                assert pp.peak_in_flight(pp.gpipe_actions(s, p, m)) == {s: m}
                assert pp.peak_in_flight(pp.schedule_actions("1F1B", p, m)[s]) == {s: min(p - s, m)}


def interleaved_state(n_local_stages, n_ranks, n_microbatches):
    """What ScheduleInterleaved1F1B's per-rank generator reads from the schedule object, without building one."""
    from types import SimpleNamespace

    rounds = max(1, n_microbatches // n_ranks)
    return SimpleNamespace(
        n_local_stages=n_local_stages,
        pp_group_size=n_ranks,
        microbatches_per_round=n_microbatches // rounds,
        number_of_rounds=rounds,
        _n_microbatches=n_microbatches,
    )


def test_action_lists_match_torch_schedules():
    # torch's schedule classes compute the same per-rank action lists (their "pipeline order")
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def torch_actions(order):
        return [
            (a.computation_type.value, a.microbatch_index, a.stage_index)
            for a in order
            if a is not None and a.computation_type.value in ("F", "B")
        ]

    for p in (2, 3, 4):
        for m in (p, 2 * p, 2 * p + 1):
            gpipe = ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
            one_f_one_b = Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
            for r in range(p):
                assert torch_actions(gpipe[r]) == [tuple(a) for a in pp.gpipe_actions(r, p, m)]
                if r < p - 1:  # torch 2.13's order for the last rank is off by one micro-batch (display only)
                    assert torch_actions(one_f_one_b[r]) == [tuple(a) for a in pp.schedule_actions("1F1B", p, m)[r]]
            if m % p == 0:
                state = interleaved_state(2, p, m)
                for r in range(p):
                    ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(state, r)
                    assert torch_actions(ops) == [tuple(a) for a in pp.interleaved_actions(r, p, 2, m)], (p, m, r)


def test_simulate_reports_deadlock_with_the_waiting_ranks():
    # stage 0 waits for B0 before sending F1; stage 1 needs F1 before its B0: a cycle
    actions = {
        0: [pp.Action("F", 0, 0), pp.Action("B", 0, 0), pp.Action("F", 1, 0), pp.Action("B", 1, 0)],
        1: [pp.Action("F", 0, 1), pp.Action("F", 1, 1), pp.Action("B", 0, 1), pp.Action("B", 1, 1)],
        2: pp.schedule_actions("1F1B", 3, 2)[2],
    }
    with pytest.raises(pp.Deadlock) as caught:
        pp.simulate(actions, 3)
    assert set(caught.value.waiting) == {0, 1, 2}  # rank 2 waits downstream of the cycle
    assert "rank 0 waits at B0@0" in str(caught.value) and "rank 1 waits at F1@1" in str(caught.value)


def test_validate_rejects_missing_and_misplaced_actions():
    actions = pp.schedule_actions("1F1B", 2, 3)
    actions[1] = actions[1][:-1]
    with pytest.raises(ValueError, match="missing"):
        pp.validate(actions, 2, 3)
    actions = pp.schedule_actions("1F1B", 2, 3)
    actions[0] = actions[0] + [pp.Action("F", 0, 1)]
    with pytest.raises(ValueError, match="held by rank 1"):
        pp.validate(actions, 2, 3)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 5, 8, 16])
def test_split_into_stages_is_the_whole_model(n_stages):
    model = pp.course_model()
    stages = pp.split_into_stages(model, n_stages)
    x = torch.randn(5, 64)
    out = x
    for stage in stages:
        out = stage(out)
    assert torch.equal(out, model(x))
    sizes = [sum(isinstance(m, torch.nn.Linear) for m in s) for s in stages]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 16
    assert pp.stage_boundaries(model, n_stages)[0] == 0


def test_split_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot cut 16 Linear layers into 17 stages"):
        pp.split_into_stages(pp.course_model(), 17)


# ---- zero bubble: the backward split into B and W ----------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_zero_bubble_lists_run_every_action_once_and_have_the_formulas_bubble(p):
    for m in (p, p + 1, 2 * p, 3 * p + 1):
        actions = pp.schedule_actions(pp.ZERO_BUBBLE, p, m)
        pp.validate(actions, p, m)  # every F, B and W once, on its stage's rank
        events = pp.simulate(actions, p)  # no deadlock; t_F = t_B = t_W = 1
        assert pp.bubble_fraction(events, p) == pytest.approx(pp.zero_bubble_ideal(p, m), abs=1e-12), (p, m)
        one_f_one_b = pp.schedule_actions("1F1B", p, m)
        most = max(max(pp.peak_in_flight(a).values()) for a in one_f_one_b.values())
        assert max(max(pp.peak_in_flight(a).values()) for a in actions.values()) == most  # 1F1B's peak
        # with W's removed it is 1F1B's order: B keeps its place
        assert {r: [a for a in todo if a.kind != "W"] for r, todo in actions.items()} == one_f_one_b


def test_zero_bubble_is_at_most_half_of_1f1b_at_the_issues_figure():
    ours = pp.bubble_fraction(pp.simulate(pp.schedule_actions(pp.ZERO_BUBBLE, 4, 8), 4), 4)
    assert ours == pytest.approx(3 / 27) and ours <= pp.ideal_bubble(4, 8) / 2
    with pytest.raises(ValueError, match="m >= p"):
        pp.zero_bubble_ideal(4, 3)


def test_split_backward_b_computes_no_weight_gradient_and_w_completes_it():
    torch.manual_seed(0)
    whole = pp.split_into_stages(pp.course_model(), 4)[1]
    split = pp.split_into_stages(pp.course_model(), 4)[1]
    x, grad = torch.randn(4, 64), torch.randn(4, 64)
    x_whole = x.clone().requires_grad_()
    whole(x_whole).backward(grad)
    x_split = x.clone().requires_grad_()
    with pp.recording_layer_outputs(split) as layers:
        out = split(x_split)
    input_grad, output_grads = pp.backward_input(x_split, out, grad, layers)
    assert torch.allclose(input_grad, x_whole.grad, atol=1e-6)
    assert all(param.grad is None for param in split.parameters())  # B left every weight gradient to W
    pp.backward_weight(layers, output_grads)
    for mine, want in zip(split.parameters(), whole.parameters()):
        assert torch.allclose(mine.grad, want.grad, atol=1e-6)


def zero_bubble_program(rank, world_size):  # sent to the ranks by run_source
    import torch

    from course_lib import pipeline as pp

    torch.manual_seed(1)
    x, y = torch.randn(48, 64), torch.randn(48, 8)
    report = {}
    for m in (world_size, 12):
        ref_loss, expected = pp.reference_stage_gradients(pp.course_model(), world_size, x, y)
        record, ours = pp.schedule_step(pp.ZERO_BUBBLE, m, x, y)
        report[m] = dict(
            error=pp.max_gradient_error(ours, expected),
            peak=record.peak,
            expected_peak=pp.peak_in_flight(pp.schedule_actions(pp.ZERO_BUBBLE, world_size, m)[rank]),
            mean_loss=sum(record.losses.values()) / m if record.losses else None,
            ref_loss=ref_loss,
        )
    return report


def test_zero_bubble_on_two_ranks_equals_single_process():
    for rank, report in enumerate(run_source(zero_bubble_program, 2)):
        for m, r in report.items():
            assert r["error"] < 1e-5, (rank, m, r["error"])
            assert r["peak"] == r["expected_peak"], (rank, m)
            if rank == 1:
                assert r["mean_loss"] == pytest.approx(r["ref_loss"], abs=1e-6)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_torch_two_stage_schedules_simulated_have_their_formulas_bubble(p):
    for m in (2 * p, 3 * p):
        for name in pp.TORCH_SCHEDULES:
            actions = pp.torch_schedule_order(name, p, m)  # in a fake process group of p ranks
            forwards = sorted(a.stage for a in pp.actions_of(actions[0]) if a.kind == "F")
            assert forwards[::m] == pp.stages_of_rank(name, 0, p)
            bubble = pp.bubble_fraction(pp.simulate(actions, 2 * p), p)
            assert bubble == pytest.approx(pp.published_bubble(name, p, m), abs=1e-12), (name, p, m)


def idle_per_rank(events, p):
    span = max(e.end for e in events) - min(e.start for e in events)
    return [span - sum(e.end - e.start for e in events if e.rank == r) for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_published_bubbles_with_unequal_times(p):
    # idle time per rank, in the papers' own forms, for t_F, t_B (whole backward), t_W not all equal
    for t_f, t_b, t_w in ((1, 2, 1), (1, 3, 1), (2, 3, 0.5)):
        times = dict(t_forward=t_f, t_backward=t_b, t_weight=t_w)
        for m in (p, 2 * p):
            one_f_one_b = pp.simulate(pp.schedule_actions("1F1B", p, m), p, **times)
            assert idle_per_rank(one_f_one_b, p) == pytest.approx([(p - 1) * (t_f + t_b)] * p)  # Qi et al. Table 2
            zb = pp.simulate(pp.schedule_actions(pp.ZERO_BUBBLE, p, m), p, **times)
            t_input = t_b - t_w  # Qi et al.'s T_B: the input gradient only
            if t_input >= t_w:  # ZB-H1's W fits in the slot of the B it waits for (the paper assumes it)
                assert max(idle_per_rank(zb, p)) == pytest.approx((p - 1) * (t_f + t_input - t_w))
        # Narayanan et al. (2021): interleaving divides the idle time by v, (p - 1) / (v m) of the ideal time
        for m in (p, 2 * p):
            events = pp.simulate(pp.schedule_actions("interleaved 1F1B", p, m), 2 * p, **times)
            assert max(idle_per_rank(events, p)) / (m * (t_f + t_b)) == pytest.approx((p - 1) / (2 * m))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_dualpipev_bubble_is_deepseeks_formula_with_the_overlapped_pair_as_one_unit(p):
    m = 3 * p
    actions = pp.torch_schedule_order("ScheduleDualPipeV", p, m)
    assert any(isinstance(unit, pp.Overlapped) for unit in actions[0])
    # DeepSeek's (PP/2 - 1)(F&B + B - 3W) holds where the input gradient takes as long as the forward
    for t_f, t_b, t_w in ((1, 2, 1), (1, 1.5, 0.5), (3, 5, 2)):
        events = pp.simulate(actions, 2 * p, t_forward=t_f, t_backward=t_b, t_weight=t_w)
        want = pp.dualpipev_bubble(p, m, t_f, t_b, t_w)
        assert pp.bubble_fraction(events, p) == pytest.approx(want, abs=1e-12), (t_f, t_b, t_w)
    # run as two independent actions, F's output leaving before the pair ends, the bubble halves: not DualPipeV's
    split = {r: pp.actions_of(todo) for r, todo in actions.items()}
    halved = pp.bubble_fraction(pp.simulate(split, 2 * p), p)
    assert halved == pytest.approx(pp.zero_bubble_ideal(p, m, 2)) and halved < pp.dualpipev_bubble(p, m)
    with pytest.raises(ValueError, match="m >= 2p"):
        pp.dualpipev_bubble(p, 2 * p - 1)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_simultaneous_peak_is_the_published_per_device_memory(p):
    # per device, in micro-batches of one whole stage (a rank's share of the model); m >= 2p
    def worst_rank(actions, v):
        return max(pp.simultaneous_peak(todo) for todo in actions.values()) / v

    for m in (2 * p, 3 * p):
        assert worst_rank(pp.schedule_actions("GPipe", p, m), 1) == m
        assert worst_rank(pp.schedule_actions("1F1B", p, m), 1) == p
        assert worst_rank(pp.schedule_actions(pp.ZERO_BUBBLE, p, m), 1) == p  # Qi et al.: ZB-H1 at 1F1B's
        interleaved = pp.schedule_actions("interleaved 1F1B", p, m)
        assert worst_rank(interleaved, 2) == p * (1 + (p - 1) / (2 * p))  # Korthikanti et al. 2022, section 4.2.3
        assert worst_rank(pp.torch_schedule_order("ScheduleZBVZeroBubble", p, m), 2) == p  # Qi et al.: 1F1B's
        assert worst_rank(pp.torch_schedule_order("ScheduleDualPipeV", p, m), 2) == p + 0.5  # DeepSeek: PP + 1 stages
        # the sum of each stage's own peak counts more than a rank ever holds
        summed = max(sum(pp.peak_in_flight(todo).values()) for todo in interleaved.values()) / 2
        assert summed > worst_rank(interleaved, 2)


def torch_schedules_program(rank, world_size):  # sent to the ranks by run_source
    import torch

    from course_lib import pipeline as pp

    torch.manual_seed(1)
    x, y = torch.randn(48, 64), torch.randn(48, 8)
    _, expected = pp.reference_stage_gradients(pp.course_model(), 2 * world_size, x, y)
    report = {}
    for name in pp.TORCH_SCHEDULES:
        _, modules, ran = pp.torch_schedule_step(name, 4 * world_size, x, y)
        report[name] = dict(error=pp.max_gradient_error(modules, expected), stages=sorted(modules), ran=ran)
    return report


def test_torch_two_stage_schedules_on_two_ranks_equal_single_process():
    reports = run_source(torch_schedules_program, 2)
    for rank, report in enumerate(reports):
        for name, r in report.items():
            assert r["error"] < 1e-5, (rank, name, r["error"])
            assert r["stages"] == sorted(pp.stages_of_rank(name, rank, 2))
            assert r["ran"] == pp.torch_schedule_order(name, 2, 8)  # the lists the ranks ran, rebuilt on paper


# ---- real ranks -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_rank_run():
    results = run(rank_programs.equality, 4, timeout=240)
    return {key: [r[key] for r in results] for key in ("report", "naive", "runs", "side_group_error")}


def test_from_scratch_equals_single_process_and_torch(four_rank_run):
    seen = set()
    for rank, report in enumerate(four_rank_run["report"]):
        for r in report:
            seen.add((r["p"], r["schedule"]))
            what = f"rank {rank}: {r['schedule']} p={r['p']} m={r['m']}"
            assert r["versus_single"] < 1e-5, what
            assert r["versus_torch"] < 1e-5, what
            assert r["peak"] == r["expected_peak"], what
            if r["mean_loss"] is not None:
                assert r["mean_loss"] == pytest.approx(r["ref_loss"], abs=1e-6), what
                assert r["torch_losses"] == pytest.approx(r["our_losses"], abs=1e-6), what
    assert seen == {(p, s) for p in (2, 3, 4) for s in pp.SCHEDULES}
    # the last rank of each pipeline reported the losses
    assert any(r["mean_loss"] is not None for r in four_rank_run["report"][3])


def test_gpipe_and_1f1b_memory(four_rank_run):
    for rank, report in enumerate(four_rank_run["report"]):
        for r in report:
            if r["schedule"] == "GPipe":
                assert r["peak"] == {rank: r["m"]}
            if r["schedule"] == "1F1B":
                assert r["peak"] == {rank: min(r["p"] - rank, r["m"])}


def test_messages_through_a_side_group(four_rank_run):
    assert all(error < 1e-5 for error in four_rank_run["side_group_error"])


def test_naive_model_parallel(four_rank_run):
    naive = four_rank_run["naive"]
    assert all(n["error"] < 1e-5 for n in naive)
    assert naive[3]["loss"] == pytest.approx(naive[3]["ref_loss"], abs=1e-6)
    assert all(n["loss"] is None for n in naive[:3])


def test_the_schedule_ranks_ran_has_the_formulas_bubble(four_rank_run):
    """Asserted on what load cannot change: the order each rank ran its actions in, simulated, has the bubble
    (p-1)/(m+p-1); latency and other work only add idle time, so the wall-time bubble is not far below it."""
    for m, events in four_rank_run["runs"][0].items():
        ran = {r: [e.action for e in sorted(events, key=lambda e: e.start) if e.rank == r] for r in (0, 1)}
        assert ran == pp.schedule_actions("GPipe", 2, m), m
        simulated = pp.bubble_fraction(pp.simulate(ran, 2, t_forward=1, t_backward=2), 2)
        assert simulated == pytest.approx(pp.ideal_bubble(2, m), abs=1e-12), (m, simulated)
        assert pp.bubble_fraction(events, 2) >= pp.ideal_bubble(2, m) - 0.05, (m, pp.bubble_fraction(events, 2))


# ---- exercise 2: 1F1B's action list, judged by its properties ------------------------------------------
# Wrong answers, each a shortcut or a slip; their messages say why without giving the order.


def one_f_one_b_library(stage, n_stages, n_microbatches):  # the shortcut: the course's own 1F1B
    from course_lib import pipeline as pp

    return [(a.kind, a.microbatch) for a in pp.schedule_actions("1F1B", n_stages, n_microbatches)[stage]]


def one_f_one_b_private(stage, n_stages, n_microbatches):  # the same, reached past the public names
    from course_lib.pipeline import schedules

    return [(a.kind, a.microbatch) for a in schedules._one_f_one_b_actions(stage, n_stages, n_microbatches)]


def torch_order(stage, n_stages, n_microbatches):  # torch's 1F1B order, read out of its schedule class
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import Schedule1F1B

    order = Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=n_stages, _n_microbatches=n_microbatches))
    kinds = [(a.computation_type.value, a.microbatch_index) for a in order[stage] if a is not None]
    return [(kind, i) for kind, i in kinds if kind in ("F", "B")]


def torch_rank_ops(stage, n_stages, n_microbatches):  # torch's generator behind its interleaved schedules, v = 1
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops

    warmup = min(n_stages - 1 - stage, n_microbatches)
    ops = _get_1f1b_rank_ops(
        1, n_stages, warmup, n_microbatches - warmup, warmup, stage, lambda step: stage, lambda step: stage
    )
    return [(a.computation_type.value, a.microbatch_index) for a in ops if a is not None]


def torch_interleaved_one_stage(stage, n_stages, n_microbatches):  # ScheduleInterleaved1F1B with one stage per rank
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    state = interleaved_state(1, n_stages, n_microbatches)
    ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(state, stage)
    return [(a.computation_type.value, a.microbatch_index) for a in ops if a is not None]


def gpipe_order(stage, n_stages, n_microbatches):  # runs, same bubble, but holds all m activations
    return [("F", i) for i in range(n_microbatches)] + [("B", i) for i in range(n_microbatches)]


def one_at_a_time(stage, n_stages, n_microbatches):  # holds one activation, but the pipeline never fills
    return [(kind, i) for i in range(n_microbatches) for kind in "FB"]


def warmup_one_too_many(stage, n_stages, n_microbatches):  # p - s warm-up forwards: one activation too many
    warmup = min(n_stages - stage, n_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, n_microbatches):
        order += [("F", i), ("B", i - warmup)]
    return order + [("B", i) for i in range(n_microbatches - warmup, n_microbatches)]


def warmup_reversed(stage, n_stages, n_microbatches):  # stage s warms up like stage p-1-s: deadlock
    return SOLUTIONS["one_f_one_b"](n_stages - 1 - stage, n_stages, n_microbatches)


def copied_for_the_printed_m(stage, n_stages, n_microbatches):  # the order section 2 printed, for m = 2p only
    return SOLUTIONS["one_f_one_b"](stage, n_stages, 2 * n_stages)


def forgets_last_backward(stage, n_stages, n_microbatches):
    return SOLUTIONS["one_f_one_b"](stage, n_stages, n_microbatches)[:-1]


def backward_first(stage, n_stages, n_microbatches):
    order = SOLUTIONS["one_f_one_b"](stage, n_stages, n_microbatches)
    return [order[1], order[0], *order[2:]] if stage == n_stages - 1 and n_microbatches > 1 else order


def strings(stage, n_stages, n_microbatches):
    return [f"{k}{i}" for k, i in SOLUTIONS["one_f_one_b"](stage, n_stages, n_microbatches)]


ONE_F_ONE_B_WRONG = {
    one_f_one_b_library: "your function calls schedule_actions (recorded)",
    one_f_one_b_private: "your function calls _one_f_one_b_actions (recorded)",
    torch_order: "your function calls Schedule1F1B._get_pipeline_order (recorded)",
    torch_rank_ops: "your function calls torch's _get_1f1b_rank_ops (recorded)",
    torch_interleaved_one_stage: "your function calls ScheduleInterleaved1F1B (recorded)",
    gpipe_order: re.compile(r"stage \d of \d, n_microbatches=2: holds 2 micro-batches' activations at once"),
    one_at_a_time: re.compile(r"n_microbatches=2: the lists run and hold little, but .* a bubble of 0\.\d+ where"),
    warmup_one_too_many: re.compile(r"stage \d of \d, n_microbatches=2: holds 2 micro-batches' activations"),
    warmup_reversed: "deadlock",
    copied_for_the_printed_m: "n_microbatches=1: stage 0: micro-batch 1 does not exist",
    forgets_last_backward: "missing B",
    backward_first: "B0 comes before F0",
    strings: "is not a",
}


@pytest.mark.parametrize("nproc", world_sizes(2, 3))
def test_one_f_one_b_checker_rejects_each_shortcut(nproc):
    assert_checker(pp.check_one_f_one_b, SOLUTIONS["one_f_one_b"], ONE_F_ONE_B_WRONG, nproc=nproc)


def test_check_reports_rank_and_not_attempted(capsys):
    assert check(gpipe_order, pp.check_one_f_one_b, nproc=2, backend="gloo") is False
    assert "✗ gpipe_order: rank 1: stage 1 of 2, n_microbatches=2: holds 2" in capsys.readouterr().out

    def stub(stage, n_stages, n_microbatches):
        raise NotImplementedError

    assert check(stub, pp.check_one_f_one_b, nproc=2) is None
    assert "not attempted yet" in capsys.readouterr().out


def test_one_f_one_b_is_neither_shown_nor_exported():
    """The notebook reaches 1F1B only through schedule_actions (which the checker records): no public name, and
    no cell above the exercise shows the generator's code."""
    import json
    from pathlib import Path

    assert not any("one_f_one_b" in name and name != "check_one_f_one_b" for name in dir(pp))
    cells = json.loads((Path(__file__).parents[1] / "notebooks" / "09_pipeline_parallel.ipynb").read_text())["cells"]
    exercise = next(i for i, c in enumerate(cells) if "check(one_f_one_b," in "".join(c["source"]))
    above = json.dumps(cells[:exercise])
    assert "one_f_one_b_actions" not in above and "warmup = min(" not in above


def test_reference_one_f_one_b_is_the_library_order():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 5, 8):
            for s in range(p):
                want = [(a.kind, a.microbatch) for a in pp.schedule_actions("1F1B", p, m)[s]]
                assert SOLUTIONS["one_f_one_b"](s, p, m) == want


# ---- exercise 1: predict the interleaved bubble --------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_bubble_prediction(p, capsys):
    from course_lib.exercises import check_prediction

    m = 2 * p  # the notebook's M_SHOW
    events = pp.simulate(pp.schedule_actions("interleaved 1F1B", p, m), 2 * p, t_forward=1, t_backward=2)
    measured = pp.bubble_fraction(events, p)
    predicted = runpy.run_path(SOLUTION_FILE, init_globals={"NPROC": p})["predicted_bubble"]
    assert check_prediction("bubble", predicted, measured, rtol=0.05) is True
    for wrong in (
        pp.ideal_bubble(p, m),  # forgets v: 1F1B's bubble
        (p - 1) / p,  # naive model parallelism
        (p - 1) / (2 * m),  # forgets the p - 1 in the denominator
        (p - 1) / (m + p - 1) / 2,  # halves 1F1B's bubble
    ):
        assert check_prediction("bubble", wrong, measured, rtol=0.05) is False, (p, wrong)
    assert "too" in capsys.readouterr().out


# ---- exercise 3: diagnose the deadlocking pipeline step ----------------------------------------


def broken_pipeline_step(stage_module, x, y):  # the notebook's broken version
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    inp = x
    if not first:
        inp = torch.empty(x.shape[0], 64)
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_()
    out = stage_module(inp)
    loss = None
    if last:
        loss = F.mse_loss(out, y)
        loss.backward()
    else:
        grad_out = torch.empty_like(out)
        dist.recv(grad_out, src=rank + 1)
        dist.send(out.detach(), dst=rank + 1)
        out.backward(grad_out)
    if not first:
        dist.send(inp.grad, dst=rank - 1)
    return loss


def local_pipeline_step(stage_module, x, y):  # no messages: every rank runs its stage on what it was given
    import torch.nn.functional as F

    out = stage_module(x)
    loss = F.mse_loss(out, y) if out.shape == y.shape else out.sum()
    loss.backward()
    return loss


def no_gradient_sent_back(stage_module, x, y):  # forwards right, but only the last stage gets gradients
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    inp = x
    if rank > 0:
        inp = torch.empty(x.shape[0], 64)
        dist.recv(inp, src=rank - 1)
    out = stage_module(inp)
    if rank == world - 1:
        loss = F.mse_loss(out, y)
        loss.backward()
        return loss
    dist.send(out.detach(), dst=rank + 1)
    return None


def stub_pipeline_step(stage_module, x, y):
    raise NotImplementedError  # your code here


def test_pipeline_step_checker(capsys):
    checker = pp.check_pipeline_step
    wrong = {local_pipeline_step: "sent and received nothing"}
    assert_checker(checker, SOLUTIONS["pipeline_step"], wrong, stub=stub_pipeline_step)
    # each leaves the ranks out of step (waiting in recv, or in the end-of-batch barrier): a launch of its own
    for wrong, says in ((broken_pipeline_step, "deadlock"), (no_gradient_sent_back, "has no gradient")):
        assert check(wrong, checker, nproc=3, backend="gloo", timeout=60) is False, wrong.__name__
        out = capsys.readouterr().out
        assert "rank " in out and says in out, (wrong.__name__, out)


@pytest.mark.parametrize("nproc", world_sizes(2, 4))
def test_solutions_pass_at_other_world_sizes(nproc):
    cases = [(SOLUTIONS["pipeline_step"], pp.check_pipeline_step)]
    assert judge(cases, nproc) == [["ok"] * nproc] * len(cases)
