"""RPC round-trip latency vs tensor size, and the batching vs lock-per-update parameter server.

    .venv/bin/python benchmarks/rpc.py [--nproc 2] [--repeats 5] [--trainers 4] [--steps 20]

One launch: trainer1 times rpc_sync(echo) round trips to the server (sizes visited in
alternating rounds, median per size), then the two parameter servers of course_lib.rpc take
turns `--repeats` times. Prints the latency table with the fitted alpha/beta model and the
throughput ratio batching / lock-per-update (medians).
"""

from __future__ import annotations

import argparse
import statistics

from _report import report  # benchmarks/ is the script's directory: on sys.path

from course_lib import rpc as rpc_lib
from course_lib.launch import launch

BODY = """
import torch.distributed.rpc as rpc
from course_lib import rpc as rpc_lib
rpc_lib.start(rank, world_size)
latency, server_wall = None, {"sync": [], "async": []}
if rank == 0:
    sizes = [2**k for k in range(3, 23)]
    latency = rpc.rpc_sync("trainer1", rpc_lib.rpc_latency, args=("server", sizes, REPEATS_LATENCY))
    for repeat in range(REPEATS):
        for mode in ("sync", "async"):
            server_wall[mode].append(rpc_lib.run_parameter_server(mode, TRAINERS, world_size, steps=STEPS)["wall_s"])
rpc.shutdown()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    body = (
        BODY.replace("REPEATS_LATENCY", str(2 * args.repeats + 1))
        .replace("REPEATS", str(args.repeats))
        .replace("TRAINERS", str(args.trainers))
        .replace("STEPS", str(args.steps))
    )
    result = launch(
        body, args.nproc, backend="gloo", init=False, out=["latency", "server_wall"], write=lambda text, stream: None
    )
    latency, wall = result.values["latency"][0], result.values["server_wall"][0]
    alpha, beta = rpc_lib.fit_latency_model(latency)
    print(f"rpc_sync(echo) round trip, {args.nproc} processes, median of {2 * args.repeats + 1} alternating rounds")
    print(
        f"fit t(n) = alpha + 2n*beta: alpha = {alpha * 1e6:.0f} us, "
        f"beta = {beta * 1e9:.3f} ns/byte (bandwidth 1/beta = {1 / beta / 1e9:.2f} GB/s)"
    )
    print(f"{'bytes':>9} {'measured us':>12} {'model us':>9} {'MB/s both ways':>15}")
    for n in sorted(latency):
        print(
            f"{n:>9} {latency[n] * 1e6:>12.0f} {(alpha + 2 * n * beta) * 1e6:>9.0f} {2 * n / latency[n] / 1e6:>15.3g}"
        )
    updates = args.trainers * args.steps
    sync, lock = statistics.median(wall["sync"]), statistics.median(wall["async"])
    print(
        f"\nparameter servers, {args.trainers} trainers x {args.steps} steps, median of {args.repeats} alternating runs"
    )
    print(f"batching (sync)        : {updates / sync:8.0f} gradients/s")
    print(f"lock per update (async): {updates / lock:8.0f} gradients/s")
    print(f"ratio batching / lock-per-update: {lock / sync:.2f}")
    report(f"batching / lock-per-update server throughput, {args.trainers} trainers", lock / sync, ">= 1.0")


if __name__ == "__main__":
    main()
