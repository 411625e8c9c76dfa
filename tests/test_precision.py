"""course_lib.precision: the from-scratch loss scaler against torch.amp.GradScaler, on one process and on
N real gloo ranks (FSDP2-sharded gradients, an overflow on one rank only), the exercise checker, and the
number-format helpers. Each multi-rank test is one launch (a few seconds of start-up), so checks share a body.
"""

from __future__ import annotations

import math
import re
import runpy
from pathlib import Path

import pytest
import torch

from course_lib import compare, precision
from course_lib.exercises import check
from course_lib.models import MLP
from tests.rank_programs import precision as rank_programs
from tests.rank_programs import run, world_sizes

SOLUTIONS_PATH = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "04_mixed_precision.py"


def solutions(fsdp_nproc: int = 2) -> dict:
    """The solution blocks run with what the notebook defines above them (exercise 3 reads MLP and FSDP_NPROC)."""
    return runpy.run_path(str(SOLUTIONS_PATH), init_globals={"MLP": MLP, "FSDP_NPROC": fsdp_nproc})


SOLUTIONS = solutions()

# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------


def test_number_formats():
    rows = {r["dtype"]: r for r in precision.finfo_table()}
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    assert list(rows) == list(dtypes)

    def stored(value, dtype):  # what the format really keeps of a value (through float64, exact for these)
        return torch.tensor(value, dtype=torch.float64).to(dtype).item()

    for name, r in rows.items():
        dtype, e, m = dtypes[name], r["exponent bits"], r["mantissa bits"]
        # the table's bit layout is checked against what torch computes in the format, not against itself
        assert 1 + e + m == r["bits"] == torch.finfo(dtype).bits, name
        assert r["eps"] == 2.0**-m and stored(1.0 + 2.0**-m, dtype) == 1.0 + 2.0**-m, name
        assert stored(1.0 + 2.0 ** -(m + 2), dtype) == 1.0, name  # below half an eps: rounds back to 1
        assert r["smallest normal"] == 2.0 ** (2 - 2 ** (e - 1)), name
        tiny = r["smallest subnormal"]
        assert stored(tiny, dtype) == tiny and stored(tiny / 2, dtype) == 0.0, name  # half of it rounds to 0
        assert stored(r["max"], dtype) == r["max"] and math.isinf(stored(r["max"] * (1 + r["eps"]), dtype)), name
        assert r["decimal digits"] == pytest.approx((m + 1) * math.log10(2), abs=0.05), name
    assert rows["fp16"]["max"] == 65504 and rows["fp16"]["smallest subnormal"] == 2.0**-24
    assert rows["bf16"]["smallest subnormal"] == 2.0**-133 and rows["fp32"]["smallest subnormal"] == 2.0**-149
    assert precision.stored_value(2049.0, torch.float16) == 2048.0
    assert math.isinf(precision.stored_value(1e5, torch.float16))
    assert precision.rounding_error(1e5, torch.float16) == math.inf
    assert precision.rounding_error(2049.0, torch.float16) == 1 / 2049
    assert precision.rounding_error(0.0, torch.float16) == 0.0
    assert precision.bit_fields(1.0, torch.float16) == ("0", "01111", "0" * 10)
    assert precision.bit_fields(-2.0, torch.bfloat16) == ("1", "10000000", "0" * 7)
    assert precision.bit_fields(0.1, torch.float32) == ("0", "01111011", "10011001100110011001101")


def test_autocast_inspection_sees_low_precision_matmuls_and_fp32_loss():
    model, x, y = MLP(n_layers=1), torch.randn(4, 32), torch.randn(4, 8)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.mse_loss(model(x), y)

    ops = precision.record_op_dtypes(forward)
    assert [out for op, _, out in ops if op == "addmm"] == ["bf16", "bf16"]
    assert [out for op, _, out in ops if op == "mse_loss"] == ["fp32"]
    assert ("_to_copy", ("fp32",), "bf16") in ops


def _scale_update_reference(flags, init_scale, growth_interval):
    scale, tracker = torch.tensor(init_scale), torch.tensor(0, dtype=torch.int32)
    trajectory = []
    for flag in flags:
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(flag)), 2.0, 0.5, growth_interval)
        trajectory.append((scale.item(), int(tracker)))
    return trajectory


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**126])  # the second grows into fp32's limit: no inf
def test_update_rule_equals_torch_kernel(init_scale):
    flags = [1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    scaler = precision.DynamicLossScaler(init_scale=init_scale, growth_interval=3)
    mine = []
    for flag in flags:
        scaler._found_inf = torch.tensor(float(flag))
        scaler.update()
        mine.append((scaler.get_scale(), scaler._growth_tracker))
    assert mine == _scale_update_reference(flags, init_scale, 3)
    assert all(math.isfinite(scale) for scale, _ in mine)


def _train(scaler, max_norm=1.0):
    model = MLP(n_layers=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    batches = precision.rank_batches(14, 48, torch.device("cpu"))
    run = precision.amp_training_loop(model, optimizer, scaler, batches, poison={7: 0}, max_norm=max_norm)
    return run, [p.detach().clone() for p in model.parameters()]


def test_scaler_equals_gradscaler_single_process_with_overflows_and_clipping():
    settings = dict(init_scale=2.0**24, growth_interval=2)  # far too large: the first steps overflow by themselves
    theirs, their_params = _train(torch.amp.GradScaler("cpu", **settings))
    mine, my_params = _train(precision.DynamicLossScaler(**settings))
    assert mine == theirs
    assert all(torch.equal(a, b) for a, b in zip(my_params, their_params))
    assert theirs["skipped"][0] == 0 and 7 in theirs["skipped"] and len(theirs["skipped"]) >= 4
    assert len(set(theirs["scales"])) >= 4  # backed off and grew again


def test_scaler_api_misuse_raises():
    scaler = precision.DynamicLossScaler()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="needs a step"):
        scaler.update()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(optimizer)


def test_hand_managed_scale_stalls_and_the_right_way_learns():
    batches = precision.rank_batches(40, 48, torch.device("cpu"))
    model = MLP(n_layers=2)
    trainer = precision.MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5))
    hand = [trainer.train_step(x, y) for x, y in batches]
    model = MLP(n_layers=2)
    right = precision.amp_training_loop(
        model, torch.optim.SGD(model.parameters(), lr=0.5), torch.amp.GradScaler("cpu"), batches, max_norm=1.0
    )["losses"]
    assert hand[0] == right[0]
    assert hand[-1] > 1.5 * right[-1] and right[-1] < 0.7 * right[0]


def test_saved_activation_bytes_halve_in_bf16():
    model = MLP(d_hidden=128)
    fp32 = compare.saved_activation_bytes(model, torch.randn(32, 32))
    bf16 = compare.saved_activation_bytes(model.to(torch.bfloat16), torch.randn(32, 32, dtype=torch.bfloat16))
    assert fp32 > 0 and bf16 * 2 == fp32


# ------------------------------------------------------------------------------------------------
# N ranks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nproc", world_sizes(2, 3, 4))
def test_scaler_equals_gradscaler_on_sharded_ranks(nproc):
    results = run(rank_programs.scalers_on_sharded_ranks, nproc)
    values = {key: [r[key] for r in results] for key in ("scales", "skipped", "params_equal", "policy", "verdicts")}
    for rank in range(nproc):
        scales, skipped = values["scales"][rank], values["skipped"][rank]
        assert scales["mine"] == scales["torch"], f"rank {rank}: scale trajectories differ"
        assert skipped["mine"] == skipped["torch"], f"rank {rank}: skipped steps differ"
        assert values["params_equal"][rank], f"rank {rank}: final parameters differ"
        assert scales["torch"] == values["scales"][0]["torch"] and skipped["torch"] == values["skipped"][0]["torch"]
        assert {0, 10, 12} <= set(skipped["torch"]), skipped["torch"]  # natural overflow, then the two poisoned steps
        assert len(set(scales["torch"])) >= 4
        policy = values["policy"][rank]
        assert policy["all_gather input"] == ["bf16"] and policy["reduce_scatter input"] == ["fp32"]
        assert policy["gathered weight"] == "bf16" and policy["sharded gradient"] == "fp32"
    naive = [values["skipped"][r]["naive"] for r in range(nproc)]
    assert any(s != naive[0] for s in naive), "without the all-reduce the ranks should skip different steps"

    verdicts = values["verdicts"][0]
    assert verdicts["found_inf"] == "passed"
    # the shortcut: the course's own function (section 3), handed in or called from the learner's code
    for shortcut in ("found_inf_across_ranks", "calls_the_course_version"):
        assert verdicts[shortcut].startswith("this calls the course's found_inf_across_ranks"), verdicts[shortcut]
    assert verdicts["local_only"].startswith(f"case 'inf on rank {nproc - 1} only': expected 1.0, got 0.0")
    assert verdicts["summed"].startswith(f"case '-inf on every rank': expected 1.0, got {float(nproc)}")
    assert verdicts["misses_nan"].startswith("case 'nan on rank 0 only'")
    # only the last rank's gradients were non-finite in the first bad case, so only it sees them changed
    assert (
        values["verdicts"][nproc - 1]["cleans_gradients"]
        == f"case 'inf on rank {nproc - 1} only': the check changed the gradients; it should only read them"
    )


# exercise candidates for check(): top level, so check() can send their source to the ranks


def found_inf_local_only(grads):
    return torch.tensor(float(any(not torch.isfinite(g).all() for g in grads)))


def found_inf_stub(grads):
    raise NotImplementedError


def test_exercise_check_names_the_rank(capsys):
    assert check(found_inf_stub, precision.check_found_inf, nproc=3, backend="gloo") is None
    assert check(SOLUTIONS["found_inf"], precision.check_found_inf, nproc=3, backend="gloo") is True
    assert check(found_inf_local_only, precision.check_found_inf, nproc=3, backend="gloo") is False
    out = capsys.readouterr().out
    assert "found_inf_stub: not attempted yet" in out
    assert "✓ found_inf: correct on 3 ranks" in out
    # ranks 0 and 1 hold finite gradients in the one-rank case, so one of them reports the failure
    assert (
        "✗ found_inf_local_only: rank 0: case 'inf on rank 2 only': expected 1.0, got 0.0" in out
        or "✗ found_inf_local_only: rank 1: case 'inf on rank 2 only': expected 1.0, got 0.0" in out
    )


def test_clipping_exercise_checker_on_ranks():
    verdicts = run(rank_programs.clipping_verdicts, 3, timeout=240)
    for rank, got in enumerate(verdicts):
        assert got["train_step"] == "passed", (rank, got)
        # every rank's shard differs for these, so every rank reports them
        for wrong in ("clips_scaled", "no_clipping"):
            assert re.fullmatch(r"after 4 steps, \S+ \(this rank's shard\) element .* expected .*", got[wrong]), got
        assert got["no_update"] == "your train_step raised RuntimeError: unscale_() is being called after step().", got
        assert got["fixed_scale"].startswith("after 4 steps the loss scale is 65536, expected"), got
        # the shortcut: the course's own loop, which the checker runs as its reference
        assert got["calls_the_course_loop"].startswith("this calls the course's amp_training_loop"), got
    assert any(got["clips_local_shards"] != "passed" for got in verdicts), verdicts


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_prediction_of_the_policys_shard_bytes(nproc):
    """Exercise 3: 4P/N passes at every FSDP_NPROC against bytes FSDP2 really holds (one process, a fake group of
    nproc ranks, rank 0); the bf16 guess 2P/N, forgetting /N, and N-1 fail."""
    from course_lib.exercises import check_prediction

    parameters = sum(p.numel() for p in MLP(d_hidden=512).parameters())
    measured = _policy_shard_bytes_on_rank0(nproc)
    predicted = solutions(nproc)["predicted_shard_bytes"]
    assert check_prediction("shards", predicted, measured, rtol=0.05) is True
    for wrong in (2 * parameters / nproc, 4 * parameters, 4 * parameters / (nproc - 1)):
        assert check_prediction("shards", wrong, measured, rtol=0.05) is False, wrong


def _policy_shard_bytes_on_rank0(nproc: int) -> int:
    """What section 6's cell measures, in this process as rank 0 of a fake group of nproc ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from course_lib.compare import bytes_per_rank

    dist.init_process_group("fake", rank=0, world_size=nproc, store=FakeStore())
    try:
        model = MLP(d_hidden=512)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
        return bytes_per_rank(model.parameters())
    finally:
        dist.destroy_process_group()


def test_found_inf_checker_builds_the_gradients_on_the_ranks_device(monkeypatch):
    """On a GPU rank the gradients live on its GPU (meta stands in for it), where NCCL can reduce them."""
    from course_lib.precision import checkers
    from tests.device_fakes import META, Reached, on_meta, recorder

    on_meta(monkeypatch, checkers)
    devices: list[torch.device] = []
    with pytest.raises(Reached):
        checkers.check_found_inf(recorder(devices))
    assert devices == [META, META]


# ------------------------------------------------------------------------------------------------
# float8 (section 8)
# ------------------------------------------------------------------------------------------------


def test_float8_formats_against_their_bit_layout():
    rows = {r["dtype"]: r for r in precision.formats_table()}
    assert list(rows) == ["fp32", "fp16", "bf16", "e4m3fn", "e5m2"]

    def stored(value, dtype):
        return torch.tensor(value, dtype=torch.float64).to(dtype).item()

    for dtype in precision.FLOAT8_DTYPES:
        r = rows[precision.DTYPE_NAMES[dtype]]
        e, m = precision.LAYOUT[dtype]
        assert r["bits"] == 1 + e + m == 8 and r["eps"] == 2.0**-m
        assert stored(1.0 + r["eps"], dtype) == 1.0 + r["eps"] and stored(1.0 + r["eps"] / 4, dtype) == 1.0
        assert r["smallest normal"] == 2.0 ** (2 - 2 ** (e - 1))
        tiny = r["smallest subnormal"]
        assert stored(tiny, dtype) == tiny and stored(tiny / 2, dtype) == 0.0
        assert stored(r["max"], dtype) == r["max"]
    assert rows["e4m3fn"]["max"] == 448 and rows["e5m2"]["max"] == 57344
    assert stored(1e6, torch.float8_e4m3fn) == 448  # no inf in e4m3fn: a cast saturates
    assert math.isnan(stored(math.nan, torch.float8_e4m3fn))


def test_scaled_cast_from_scratch_is_torchaos_and_row_wise_beats_an_outlier():
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 1e-3
    x[5] *= 1e5
    for dtype in precision.FLOAT8_DTYPES:
        data, scale = precision.to_float8(x, dtype)
        theirs = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig())
        assert torch.equal(theirs._data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(theirs._scale, scale)
        assert precision.from_float8(data, scale).abs().max() == x.abs().max()  # amax lands on max, and back
    rows, row_scales = precision.to_float8(x, rowwise=True)
    assert row_scales.shape == (8, 1) and (rows.float().abs().amax(dim=1) == 448).all()  # every row uses the range
    ordinary = [r for r in range(8) if r != 5]
    error = {
        rowwise: precision.cast_error(
            precision.from_float8(*precision.to_float8(x, rowwise=rowwise))[ordinary], x[ordinary]
        )
        for rowwise in (False, True)
    }
    assert error[False] > 4 * error[True] and error[True] < 2.0**-4
    zeros, zero_scale = precision.to_float8(torch.zeros(4, 4))
    assert torch.isfinite(zero_scale) and (zeros.float() == 0).all()  # an all-zero tensor: a finite scale, no nan


def test_float8_filter_and_width():
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    assert precision.why_high_precision(torch.nn.Linear(32, 256)) == ""
    assert precision.why_high_precision(torch.nn.Linear(256, 8)) == "dims 256x8 not multiples of 16"
    assert precision.why_high_precision(torch.nn.Linear(24, 32)) == "dims 24x32 not multiples of 16"
    assert (
        precision.why_high_precision(torch.nn.Linear(32, 256), shards=3) == "256 rows do not split evenly over 3 ranks"
    )
    assert precision.why_high_precision(torch.nn.GELU()) == "not a Linear"
    model = convert_to_float8_training(MLP(d_hidden=48), module_filter_fn=precision.float8_filter(shards=3))
    assert [type(m) for m in model if not isinstance(m, torch.nn.GELU)] == [Float8Linear] * 4 + [torch.nn.Linear]
    for world_size in range(1, 9):
        width = precision.float8_width(world_size)
        assert width % 16 == 0 and width % world_size == 0 and 256 <= width < 256 + math.lcm(16, world_size)


def test_torchao_imports_quietly_after_the_course():
    """The course's module drops torchao's load-time lines (and only those); nothing reaches stderr."""
    import logging
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import course_lib.precision, torchao.float8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr

    def record(logger, msg, *args):
        return logging.LogRecord(logger, logging.WARNING, __file__, 1, msg, args, None)

    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert not torchao.filter(record("torchao", "Failed to load /x/site-packages/torchao/_C_mxfp8.so: no CUDA"))
    assert torchao.filter(record("torchao", "Failed to load the checkpoint"))  # other messages pass
    enum_message = "%s is an Enum subclass and is now natively supported by torch.compile"
    assert not pytree.filter(record("torch.utils._pytree", enum_message, KernelPreference))
    assert pytree.filter(record("torch.utils._pytree", enum_message, logging.LogRecord))  # not torchao's: passes


def test_float8_all_gather_and_scales_on_ranks():
    """Section 8's run on 3 ranks (an odd world size: float8_width makes the rows split evenly), 3 steps."""
    from course_lib.launch import launch

    body = (
        "from course_lib.precision import float8_width, rank_batches, train_fsdp\n"
        "batches = rank_batches(3, 48, device)\n"
        "width = float8_width(world_size)\n"
        "kinds = ('fp32', 'float8')\n"
        "result = {kind: train_fsdp(kind, batches, width=width, lr=2.0, device=device) for kind in kinds}\n"
    )
    lines: list[str] = []
    done = launch(body, 3, backend="gloo", out=["result", "width"], write=lambda text, stream: lines.append(text))
    assert not any("Failed to load" in line or "Enum subclass" in line for line in lines), lines
    width = done.values["width"][0]
    assert width == 288
    for rank, result in enumerate(done.values["result"]):
        fp32, float8 = result["fp32"], result["float8"]
        assert float8["float8_modules"] == ["0", "2"], rank
        for unit, (in_features, b) in enumerate([(32, width), (width, width)]):
            w = in_features * width
            assert fp32["forward_all_gather_bytes"][unit] == 4 * (w + b)
            assert float8["forward_all_gather_bytes"][unit] == w + 2 * b  # e4m3 weight, bf16 bias
        assert float8["forward_ops"] == {"all_gather": 3}  # the scales were precomputed: no all-reduce in the forward
        assert [[(c.op, c.nbytes) for c in calls] for calls in float8["precompute_calls"]] == [[("all_reduce", 8)]] * 4
        scales = torch.tensor(float8["scales"])
        assert float8["scales_are_max_over_amax"] and bool((scales[1:] != scales[:-1]).all())
        assert max(abs(a - b) for a, b in zip(float8["losses"], fp32["losses"])) < 2.0**-4 * fp32["losses"][0]


def test_float8_speed_cell_runs_its_code_path_on_cpu():
    """The GPU cell's measurement, on a small CPU matmul: every variant runs (its times mean nothing here)."""
    seconds = precision.matmul_and_linear_seconds(torch.device("cpu"), n=64, repeats=1)
    assert list(seconds) == ["bf16 matmul", "float8 matmul", "bf16 Linear", "float8 Linear"]
    assert all(s > 0 for s in seconds.values())
