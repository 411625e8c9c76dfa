"""Notebook 01: collectives from point-to-point messages, their cost model, and a benchmark."""

from course_lib.collectives.checkers import check_all_gather, check_pass_right, check_reduce_scatter, waiting_forever
from course_lib.collectives.lab import (
    EXPLORER_COLLECTIVES,
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
from course_lib.collectives.ring import (
    all_gather_step_,
    alpha_beta_time,
    bus_factor,
    bytes_sent_per_rank,
    chunk_offsets,
    chunk_sizes,
    fit_alpha_beta,
    naive_all_reduce,
    peer,
    reduce_scatter_step_,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_step,
)
