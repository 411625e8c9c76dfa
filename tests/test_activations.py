"""course_lib.activations: the formulas against the tensors autograd really saves (one process and N gloo ranks),
recomputation (from scratch, torch's full and selective, under FSDP2), the out-of-memory limit, the ladder, and
notebook 05's exercise checkers against their solutions and wrong answers.
"""

from __future__ import annotations

import itertools
import re
import resource
import runpy
from pathlib import Path

import pytest
import torch

from course_lib import activations, compare, memory
from course_lib.exercises import ExerciseFailed, check, check_prediction
from course_lib.launch import launch
from course_lib.models import BLOCK, TransformerBlock
from tests.rank_programs import assert_checker, quiet, world_sizes

SOLUTIONS_PATH = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "05_activation_memory.py"


def solutions(on_gpu: bool = False) -> dict:
    """The solution blocks, with what the notebook defines above them (the prediction reads LAYERS, BATCH, SEQ)."""
    names = {"LAYERS": 4, "BATCH": 2, "SEQ": 128, "BLOCK": BLOCK, "ON_GPU": on_gpu}
    return runpy.run_path(str(SOLUTIONS_PATH), init_globals=names)


SOLUTIONS = solutions()
CPU = torch.device("cpu")

# ------------------------------------------------------------------------------------------------
# formulas
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_terms_add_up_to_the_papers_closed_forms(t):
    s, b, h, a = 2048, 2, 4096, 32
    for sp in (False, True):
        closed = s * b * h * ((34 + 5 * a * s / h) / t if sp else 10 + 24 / t + 5 * a * s / (h * t))
        assert activations.korthikanti_bytes(s, b, h, a, t, sp) == pytest.approx(closed, rel=1e-12)
    assert activations.korthikanti_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    selective = sum(activations.korthikanti_terms(s, b, h, a, t, True, selective=True).values())
    assert selective == pytest.approx(34 * s * b * h / t)  # the paper's TP + SP + selective recomputation


@pytest.mark.parametrize("t", [1, 2, 3, 4, 6])
def test_course_block_closed_forms(t):
    s, b, h, a = 96, 3, 48, 12
    tp = activations.course_block_bytes(s, b, t=t)
    sp = activations.course_block_bytes(s, b, t=t, sequence_parallel=True)
    c = 2  # LayerNorm statistics in bf16
    assert tp == pytest.approx(s * b * h * (8 + 24 / t) + 4 * a * s * b / t + 4 * c * s * b)
    assert sp == pytest.approx(s * b * h * (4 + 28 / t) + (4 * a * s * b + 4 * c * s * b) / t)
    math = activations.course_block_bytes(s, b, attention="math")
    assert math == 38 * s * b * h + 4 * a * s * s * b + 4 * c * s * b
    padded = activations.course_block_bytes(s, b, head_multiple=8)  # CUDA: heads of 4 values padded to 8
    assert activations.attention_width(h, a, 8) == 2 * h and activations.attention_width(4096, 32, 8) == 4096
    assert padded == 42 * s * b * h + 4 * a * s * b + 4 * c * s * b
    with pytest.raises(ValueError, match="flash' or 'math"):
        activations.course_block_terms(s, b, attention="sparse")


# ------------------------------------------------------------------------------------------------
# measured in one process
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["flash", "math"])
@pytest.mark.parametrize(("s", "b"), [(16, 1), (40, 3), (96, 2)])
def test_saved_bytes_per_layer_equal_the_derivation(s, b, attention, dtype):
    r = activations.layer_bytes(s, b, attention=attention, dtype=dtype)
    assert r["measured"] == r["derived"]


def test_saved_tensor_listing_counts_what_the_hooks_count():
    block, x = TransformerBlock(), torch.randn(2, 24, 48, requires_grad=True)
    with activations.attention_backend("flash"):
        rows = activations.saved_tensors(block(x), block.parameters())
        hooked = compare.saved_activation_bytes(block, x)
    assert sum(r["bytes"] for r in rows) == hooked == activations.course_block_bytes(24, 2, element_bytes=4)
    assert {r["node"] for r in rows} >= {"NativeLayerNormBackward0", "GeluBackward0", "AddmmBackward0"}
    assert any(r["name"] == "logsumexp" and r["dtype"] == "fp32" for r in rows)


def test_live_bytes_counts_new_storage_once_and_forgets_the_dead():
    before = torch.randn(1000)  # made before the mode: never counted
    with activations.LiveBytes() as live:
        a = torch.ones(256)
        views = [a[1:], a.view(16, 16), before * 2]
        assert live.now() == 256 * 4 + 1000 * 4
        del views
        assert live.now() == 256 * 4
        del a
        assert live.now() == 0
    assert live.peak == 256 * 4 + 1000 * 4


@pytest.mark.parametrize("mode", activations.RECOMPUTE_MODES)
def test_recomputation_keeps_the_derived_bytes_and_the_same_gradients(mode):
    layers, b, s = 3, 2, 32
    x = torch.randn(b, s, 48, generator=torch.Generator().manual_seed(0))
    plain = activations.block_stack(layers)
    reference = activations.measure_step(plain, x) | activations.step_flops(plain, x)
    model = activations.block_stack(layers, mode)
    got = activations.measure_step(model, x) | activations.step_flops(model, x)
    assert got["held"] == activations.derived_held(mode, layers, s, b, torch.float32, CPU)
    assert compare.max_difference(got["gradients"], reference["gradients"]) == 0
    forward, extra = reference["forward flops"], got["step flops"] - reference["step flops"]
    expected_extra = {
        "none": 0,
        "from scratch": forward,
        "full": forward - layers * 2 * b * s * 48 * 192,  # early_stop: the last matmul is not run again
        "selective": 0,
    }
    assert extra == expected_extra[mode]
    assert got["peak"] <= reference["peak"]


def test_checkpoint_from_scratch_leaves_nothing_behind_and_handles_inputs_that_need_grad():
    block = TransformerBlock()
    for needs_grad in (False, True):
        x = torch.randn(2, 16, 48, requires_grad=needs_grad)
        with activations.LiveBytes() as live:
            y = activations.checkpoint_from_scratch(block, x)
            y.square().sum().backward()
            del y
            left = live.now()
        grads = [p.grad.clone() for p in block.parameters()]
        x_grad = x.grad.clone() if needs_grad else None
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x).square().sum().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(grads, block.parameters()))
        assert not needs_grad or torch.equal(x_grad, x.grad)
        gradient_bytes = sum(p.numel() * 4 for p in block.parameters()) + (x.numel() * 4 if needs_grad else 0)
        assert left == gradient_bytes  # the gradients, nothing recomputed is left
        block.zero_grad(set_to_none=True)


def test_checkpointed_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be"):
        activations.Checkpointed(TransformerBlock(), "sometimes")
    with pytest.raises(ValueError, match="mode must be"):
        activations.block_stack(2, "sometimes")


# ------------------------------------------------------------------------------------------------
# out of memory, the estimate and the ladder
# ------------------------------------------------------------------------------------------------


def test_memory_limit_gives_a_real_out_of_memory_and_is_lifted_after():
    soft_before = resource.getrlimit(resource.RLIMIT_AS)
    torch.ones(2**20, dtype=torch.uint8).sum()  # thread pools start at the first use: not under the limit
    with activations.memory_limit(32 * 2**20):
        outcome = activations.attempt(lambda: torch.ones(64 * 2**20, dtype=torch.uint8).sum())
        small = activations.attempt(lambda: torch.ones(2**20, dtype=torch.uint8).sum().item())
    assert outcome == {"ok": False, "error": "RuntimeError: DefaultCPUAllocator: can't allocate memory", "value": None}
    assert small == {"ok": True, "error": "", "value": 2**20}
    assert resource.getrlimit(resource.RLIMIT_AS) == soft_before
    assert torch.ones(64 * 2**20, dtype=torch.uint8).sum() == 64 * 2**20
    with pytest.raises(ZeroDivisionError):  # only out-of-memory errors are caught
        activations.attempt(lambda: 1 / 0)


def test_train_step_micro_batches_give_the_batch_gradients():
    model, x = activations.block_stack(2), torch.randn(8, 16, 48)
    whole = activations.train_step(model, x)
    grads = [p.grad.clone() for p in model.parameters()]
    split = activations.train_step(model, x, micro_batches=4)  # replaces the gradients, does not add to them
    assert split == pytest.approx(whole, rel=1e-6)
    assert max(compare.relative_error(p.grad, g) for p, g in zip(model.parameters(), grads)) < 1e-5


def test_estimate_is_the_calculator_plus_the_activations_and_every_rung_helps():
    setup = activations.Setup()
    estimate = activations.estimate(setup)
    states = memory.zero_bytes_per_gpu(setup.parameters, setup.gpus, 0)
    per_layer = activations.course_block_bytes(4096, 4, 4096, 32, 4 * 4096, stats_bytes=4, sequence_parallel=True)
    assert estimate["optimizer"] == states["optimizer"] and estimate["activations"] == 32 * per_layer
    rows = activations.ladder(setup)
    assert [r["rung"] for r in rows][1:] == [name for name, _, _ in activations.RUNGS]
    assert all(b["total"] < a["total"] for a, b in itertools.pairwise(rows))
    assert [r["fits"] for r in rows] == [False, False, False, True, True, True]


# ------------------------------------------------------------------------------------------------
# N ranks
# ------------------------------------------------------------------------------------------------

TP_BODY = """
from torch.distributed.device_mesh import init_device_mesh
from course_lib import activations
from course_lib.compare import saved_activation_bytes
from course_lib.tensor_parallel import torch_parallel_block

mesh = init_device_mesh("cpu", (world_size,))
s, b = 24 * 2, 3
x = torch.randn(b, s, 48, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
mine = slice(rank * s // world_size, (rank + 1) * s // world_size)
result = {}
for sp in (False, True):
    block = torch_parallel_block(mesh, sequence_parallel=sp).to(torch.bfloat16)
    with activations.attention_backend("flash"):
        measured = saved_activation_bytes(block, (x[:, mine] if sp else x).clone().requires_grad_())
    result[sp] = (measured, activations.course_block_bytes(s, b, t=world_size, sequence_parallel=sp))
"""


@pytest.mark.parametrize("nproc", world_sizes(2, 3, 4))
def test_tensor_and_sequence_parallel_bytes_per_rank_equal_the_derivation(nproc):
    done = launch(TP_BODY, nproc, backend="gloo", out=["result"], write=quiet)
    for rank, result in enumerate(done.values["result"]):
        for sp, (measured, derived) in result.items():
            assert measured == derived, (rank, sp, measured, derived)


FSDP_BODY = """
from course_lib import activations, compare
from course_lib.models import shard_layers_then_root

x = torch.randn(2, 32, 48, generator=torch.Generator().manual_seed(rank))
steps = {}
for mode in ("none", "full", "selective"):
    model = activations.block_stack(3, mode)
    shard_layers_then_root(model, list(model))
    steps[mode] = activations.measure_step(model, x)
result = {mode: {"held": r["held"], "same": compare.max_difference(r["gradients"], steps["none"]["gradients"])}
          for mode, r in steps.items()}
with activations.LiveBytes() as live:
    buffer, kept = torch.ones(1000), torch.ones(10)
    dist.all_reduce(buffer)
    counted = {"all": live.now(), "without communication": live.now(communication=False)}
"""


def test_fsdp2_on_checkpointed_blocks_same_gradients_same_activations_per_rank():
    """`held` leaves out FSDP's all-gather buffer, which gloo's thread releases a moment after the collective:
    counted, it made `held` one block's parameters larger in about one step of ten under load."""
    done = launch(FSDP_BODY, 2, backend="gloo", out=["result", "counted"], write=quiet)
    assert done.values["counted"] == [{"all": 4040, "without communication": 40}] * 2
    for result in done.values["result"]:
        for mode, r in result.items():
            assert r["held"] == activations.derived_held(mode, 3, 32, 2, torch.float32, CPU), mode
            assert r["same"] == 0, mode


OOM_BODY = """
from course_lib import activations

torch.set_num_threads(1)
activations.unmap_freed_memory()
x = torch.randn(32, 64, 48, generator=torch.Generator().manual_seed(rank))
plain, checkpointed = activations.block_stack(4), activations.block_stack(4, "full")
for model in (plain, checkpointed):
    activations.train_step(model, x[:2])
steps = {"none": lambda: activations.train_step(plain, x), "micro": lambda: activations.train_step(plain, x, 4),
         "full": lambda: activations.train_step(checkpointed, x)}
result = {}
for name, step in steps.items():
    with activations.memory_limit(16 * 2**20):
        result[name] = activations.attempt(step)["ok"]
"""


def test_out_of_memory_on_ranks_and_two_rungs_that_fix_it():
    done = launch(OOM_BODY, 2, backend="gloo", out=["result"], write=quiet)
    assert done.values["result"] == [{"none": False, "micro": True, "full": True}] * 2


# ------------------------------------------------------------------------------------------------
# exercises
# ------------------------------------------------------------------------------------------------


def test_prediction_exercise():
    measured = activations.derived_held("full", 4, 128, 2, torch.float32, CPU)  # what the notebook measures
    assert check_prediction("held", SOLUTIONS["predicted_fsdp_held"], measured, rtol=0.05)
    for wrong in (measured / 2, measured / 4, 2 * 4 * 2 * 128 * 48, measured * 16):  # / N, bf16, one layer, no AC
        assert check_prediction("held", wrong, measured, rtol=0.05) is False


def checkpoint_all(blocks, x, k):
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def checkpoint_none(blocks, x, k):
    for block in blocks:
        x = block(x)
    return x


def checkpoint_reentrant(blocks, x, k):
    from torch.utils.checkpoint import checkpoint

    for i, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=True) if i % k == 0 else block(x)
    return x


def checkpoint_with_the_course_wrapper(blocks, x, k):
    """The shortcut: the course's own Checkpointed module around the chosen blocks."""
    for i, block in enumerate(blocks):
        x = activations.Checkpointed(block, "full")(x) if i % k == 0 else block(x)
    return x


def checkpoint_shifted(blocks, x, k):
    from torch.utils.checkpoint import checkpoint

    for i, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if i % k == k - 1 else block(x)
    return x


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (checkpoint_all, "k=2: 61,440 bytes held after the forward, expected 438,272"),
        (checkpoint_none, "k=1: 1,003,520 bytes held after the forward, expected 61,440"),
        (checkpoint_shifted, "k=2: 626,688 bytes held after the forward, expected 438,272"),
        (checkpoint_reentrant, "does not require grad"),
        (checkpoint_with_the_course_wrapper, "this wraps blocks in the course's Checkpointed"),
    ],
)
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the reentrant answer's own warning
def test_checkpoint_every_checker_rejects_wrong_answers_in_process(wrong, says):
    with pytest.raises((ExerciseFailed, RuntimeError), match=says):
        activations.check_checkpoint_every(wrong)


def test_checkpoint_every_checker_accepts_the_solution_on_ranks(capsys):
    assert check(SOLUTIONS["checkpoint_every"], activations.check_checkpoint_every, nproc=3, backend="gloo")
    assert check(checkpoint_shifted, activations.check_checkpoint_every, nproc=2, backend="gloo") is False
    out = capsys.readouterr().out
    assert "✓ checkpoint_every: correct on 3 ranks" in out
    assert re.search(r"✗ checkpoint_shifted: rank \d: k=2: [\d,]+ bytes held after the forward", out)


def evaluate_broken(model, batches):
    losses = [model(x).float().square().mean() for x in batches]
    return (sum(losses) / len(losses)).item()


def evaluate_with_grad(model, batches):
    return sum(model(x).float().square().mean().item() for x in batches) / len(batches)


def evaluate_sum(model, batches):
    import torch

    with torch.no_grad():
        return sum(model(x).float().square().mean().item() for x in batches)


def evaluate_tensor(model, batches):
    import torch

    with torch.no_grad():
        return sum(model(x).float().square().mean() for x in batches) / len(batches)


def evaluate_stub(model, batches):
    raise NotImplementedError


def evaluate_solution(model, batches):
    """The solution, reached through this module: the ranks import it by name (the solution file alone does not run
    outside the notebook, whose variables its prediction reads)."""
    return SOLUTIONS["evaluate"](model, batches)


def test_evaluate_checker_on_ranks(capsys):
    assert check(evaluate_stub, activations.check_evaluate, nproc=2, backend="gloo") is None
    assert "evaluate_stub: not attempted yet" in capsys.readouterr().out
    wrong = {
        evaluate_broken: "evaluating 8 batches ran out of memory under a 16 MiB limit",
        evaluate_with_grad: re.compile(r"the evaluation saved [\d,]+ bytes of activations for a backward that never"),
        evaluate_sum: re.compile(r"mean loss [\d.]+, expected"),
        evaluate_tensor: "return the mean loss as a Python float, got Tensor",
    }
    assert_checker(activations.check_evaluate, evaluate_solution, wrong, nproc=2)


def test_out_of_memory_messages_are_short_and_the_same_on_every_run():
    """The CPU allocator's error and CUDA's (faked here: a GPU run raises it) shorten to oom_message(device)."""
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 25690112 bytes. Error code 12 (Cannot allocate memory)"
    )
    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 24.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which "
        "138.51 GiB is free. Process 4242 has 1.29 GiB memory in use. Of the allocated memory 16.20 MiB is "
        "allocated by PyTorch, and 3.80 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
        "See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    for error, device in ((cpu, "cpu"), (cuda, "cuda"), (cuda, torch.device("cuda", 3))):
        assert activations.oom.is_out_of_memory(error)
        assert activations.oom.short_message(error) == activations.oom_message(device)

        def step(error=error):
            raise error

        assert activations.attempt(step) == {"ok": False, "error": activations.oom_message(device), "value": None}
    assert activations.oom_message("cpu") == "RuntimeError: DefaultCPUAllocator: can't allocate memory"
    assert activations.oom_message("cuda") == "OutOfMemoryError: CUDA out of memory."
    assert activations.allocation_scale("cpu") == 1 and activations.allocation_scale("cuda:1") == 16


def test_evaluate_checker_scales_its_batches_and_limit_with_the_device(monkeypatch):
    """On CUDA the checker limits the caching allocator, 16 times larger (allocation_scale); faked here with 2."""
    from contextlib import contextmanager

    from course_lib.activations import checkers

    limits, shapes = [], []
    real_limit = checkers.memory_limit

    @contextmanager
    def recorded_limit(extra_bytes, device=None):
        limits.append((extra_bytes, device))
        with real_limit(extra_bytes, device):
            yield

    def evaluate(model, batches):
        shapes.extend({tuple(x.shape) for x in batches})
        return SOLUTIONS["evaluate"](model, batches)

    monkeypatch.setattr(checkers, "allocation_scale", lambda device: 2)
    monkeypatch.setattr(checkers, "memory_limit", recorded_limit)
    checkers.check_evaluate(evaluate)
    assert limits == [(2 * checkers.BUDGET_MIB * 2**20, CPU)]
    assert shapes == [(16, 64, 48)]
