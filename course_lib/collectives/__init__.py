"""Notebook 01: collectives from point-to-point messages, their cost model, and a benchmark.

    p2p        send_recv (both neighbours at once); course_lib.comms counts the bytes
    ring       chunks, the ring schedule, one ring step, ring reduce-scatter / all-gather / all-reduce,
               the naive all-reduce
    cost       bytes sent per rank, bus factor, the alpha-beta model and its fit
    lab        on the session's ranks, a collective by name on example data (the explorer) and the 2^r
               encoding that names the ranks a value contains; timing collectives on every rank, the table;
               kernel-only, the ring simulated step by step, who holds what before and after
    checkers   the exercises' checkers (solutions: notebooks/solutions/01_collectives.py)

The notebook shows the two in-place ring phases from their module: collectives.ring._ring_reduce_scatter_.
"""

from course_lib.collectives.checkers import check_all_gather, check_pass_right, check_reduce_scatter, waiting_forever
from course_lib.collectives.cost import alpha_beta_time, bus_factor, bytes_sent_per_rank, fit_alpha_beta
from course_lib.collectives.lab import (
    COLLECTIVES,
    benchmark,
    contribution_label,
    contributors,
    describe_chunks,
    draw_all_holdings,
    draw_bandwidth,
    draw_before_after,
    draw_bytes_per_rank,
    draw_deadlock,
    draw_ring_step,
    example_data,
    format_table,
    human_bytes,
    ring_all_reduce_states,
    run_collective,
)
from course_lib.collectives.p2p import peer
from course_lib.collectives.ring import (
    all_gather_step_,
    chunk_offsets,
    chunk_sizes,
    naive_all_reduce,
    reduce_scatter_step_,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_step,
)
