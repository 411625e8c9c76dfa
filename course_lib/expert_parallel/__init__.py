"""course_lib.expert_parallel (notebook 11): a mixture-of-experts layer with its experts over the ranks."""

from course_lib.expert_parallel.checkers import check_capacity_mask, check_dispatch
from course_lib.expert_parallel.dispatch import (
    AllToAll,
    all_to_all,
    all_to_all_bytes_by_kind,
    exchange_counts,
    torch_all_to_all,
)
from course_lib.expert_parallel.lab import (
    all_to_all_bytes_balanced,
    all_to_all_bytes_bound,
    balanced_batch,
    draw_dispatch,
    draw_ep_dp_mesh,
    draw_ep_explorer,
    draw_load_balance,
    draw_tokens_per_expert,
    dropped,
    imbalance,
    token_batch,
    train_load_balance,
)
from course_lib.expert_parallel.moe import (
    ExpertParallelMoE,
    MoE,
    TopKRouter,
    capacity,
    keep_within_capacity,
    load_balancing_loss,
    make_experts,
)
