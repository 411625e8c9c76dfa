"""torch.compile against eager: steady-state step time for one process, DDP and FSDP2 (notebook 03, section 8).

    .venv/bin/python benchmarks/compile.py [--nproc 2] [--layers 3] [--width 48]

The model is a small GPT (course_lib.gpt.GPT: embeddings, identical transformer blocks, head). Each setup trains
the same weights on the same batches eager and compiled by Inductor, the two taking turns
(course_lib.ddp.compiled_against_eager): the first step of each (compilation), then the fastest of 10 steps. One
process runs alone on rank 0 while the other ranks wait; DDP is `DDP(torch.compile(model))`; FSDP2 compiles each
block, then shards (torchtitan's order), or shards, then compiles the whole model. No goal: the ratio depends on the
machine and its load (on a CPU, compiling removes per-operation overhead; on a GPU it fuses memory-bound kernels).
Inductor's cache lives under /tmp (its default), outside the repository.
"""

from __future__ import annotations

import argparse

from _report import report  # benchmarks/ is the script's directory: on sys.path

from course_lib.launch import launch

BODY = r"""
from course_lib import ddp, fsdp
from course_lib.gpt.model import GPT, GPTConfig, loss_fn

torch.set_num_threads(1)
config = GPTConfig(vocab=16, d_model=width, n_heads=4, n_layers=layers, seq=16)
generator = torch.Generator().manual_seed(rank)
tokens = [torch.randint(config.vocab, (4, config.seq + 1), generator=generator) for _ in range(3)]
batches = [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def one_process(model, backend):
    return model if backend is None else torch.compile(model, backend=backend)


setups = {"DDP": ddp.compile_then_ddp}
setups.update({f"FSDP2, {name}": order for name, order in fsdp.COMPILE_ORDERS.items()})
results = {}
if rank == 0:
    results["one process"] = ddp.compiled_against_eager(
        lambda: GPT(config).to(device), batches, parallelize=one_process, loss_fn=loss_fn)
dist.barrier()
for name, parallelize in setups.items():
    results[name] = ddp.compiled_against_eager(
        lambda: GPT(config).to(device), batches, parallelize=parallelize, loss_fn=loss_fn)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=3, help="transformer blocks")
    parser.add_argument("--width", type=int, default=48, help="d_model, a multiple of 4")
    args = parser.parse_args()
    run = launch(
        BODY,
        args.nproc,
        backend="gloo",
        out=["results"],
        push={"layers": args.layers, "width": args.width},
        env={"OMP_NUM_THREADS": "1"},
        timeout=900,
        write=lambda text, stream: None,
    )
    results = run.values["results"][0]
    print(f"GPT, {args.layers} blocks of width {args.width}; DDP and FSDP2 on {args.nproc} gloo ranks (rank 0's times)")
    print(f"{'setup':36} {'first step s':>20} {'fastest step ms':>20} {'compiled':>9}")
    print(f"{'':36} {'eager':>9} {'compiled':>10} {'eager':>9} {'compiled':>10} {'/ eager':>9}")
    for name, result in results.items():
        first, steady = result["first step s"], result["step s"]
        ratio = steady["compiled"] / steady["eager"]
        print(
            f"{name:36} {first['eager']:>9.2f} {first['compiled']:>10.1f} {steady['eager'] * 1e3:>9.2f} "
            f"{steady['compiled'] * 1e3:>10.2f} {ratio:>9.2f}"
        )
        report(f"compiled / eager steady step time, {name}", ratio, "measured, no goal")
    print("(a first compiled step after the first setup's finds the same kernels in Inductor's cache: it is shorter)")


if __name__ == "__main__":
    main()
