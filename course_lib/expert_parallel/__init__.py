"""course_lib.expert_parallel (notebook 09, part 2): a mixture-of-experts layer with its experts over the ranks.

router     top-k routing, capacity and dropped assignments, the load-balancing loss
dispatch   counts first, then tokens: all_to_all_single with uneven splits, as an autograd function, and the
           same with PyTorch's functional collective; the bytes each rank sends (TRAFFIC)
moe        the experts (the course's FeedForward), the single-process MoE, ExpertParallelMoE
cost       bytes per all-to-all, capacity bound, dropped assignments, imbalance, a balanced batch
train      a short training run that records the load balance
figures    kernel-only pictures and the explorer
checkers   the exercise's checker (solution: notebooks/solutions/09_context_and_expert_parallel.py)
"""

from course_lib.expert_parallel.checkers import check_dispatch
from course_lib.expert_parallel.cost import (
    all_to_all_bytes_balanced,
    all_to_all_bytes_bound,
    balanced_batch,
    dropped,
    imbalance,
)
from course_lib.expert_parallel.dispatch import TRAFFIC, AllToAll, all_to_all, exchange_counts, torch_all_to_all
from course_lib.expert_parallel.figures import draw_ep_explorer, draw_load_balance, draw_tokens_per_expert
from course_lib.expert_parallel.moe import ExpertParallelMoE, MoE, make_experts, run_experts
from course_lib.expert_parallel.router import (
    Routing,
    TopKRouter,
    capacity,
    keep_within_capacity,
    load_balancing_loss,
)
from course_lib.expert_parallel.train import token_batch, train_load_balance

__all__ = [
    "TRAFFIC",
    "AllToAll",
    "ExpertParallelMoE",
    "MoE",
    "Routing",
    "TopKRouter",
    "all_to_all",
    "all_to_all_bytes_balanced",
    "all_to_all_bytes_bound",
    "balanced_batch",
    "capacity",
    "check_dispatch",
    "draw_ep_explorer",
    "draw_load_balance",
    "draw_tokens_per_expert",
    "dropped",
    "exchange_counts",
    "imbalance",
    "keep_within_capacity",
    "load_balancing_loss",
    "make_experts",
    "run_experts",
    "token_batch",
    "torch_all_to_all",
    "train_load_balance",
]
