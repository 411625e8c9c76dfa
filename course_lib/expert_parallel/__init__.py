"""course_lib.expert_parallel (notebook 11): a mixture-of-experts layer with its experts over the ranks.

The router (router.py) picks the top-k experts of each token, cuts each expert's queue at its capacity and computes
the load-balancing loss. dispatch.py moves the tokens: an all-to-all of the counts, then all_to_all_single with
uneven splits, as an autograd function (and the same with PyTorch's functional collective); its sent_by_kind reads
the bytes of each kind from a comms.Recorder. moe.py holds the experts (the course's FeedForward), the MoE on one
process and ExpertParallelMoE; train.py a short training run that records the load; lab.py the formulas (bytes per
all-to-all, the capacity bound, drops, imbalance, a perfectly balanced batch), the kernel-only pictures and the
explorer; checkers.py the exercises' checkers (solutions: notebooks/solutions/11_expert_parallel.py).
"""

from course_lib.expert_parallel.checkers import check_capacity_mask, check_dispatch
from course_lib.expert_parallel.dispatch import AllToAll, all_to_all, exchange_counts, sent_by_kind, torch_all_to_all
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
)
from course_lib.expert_parallel.moe import ExpertParallelMoE, MoE, make_experts
from course_lib.expert_parallel.router import TopKRouter, capacity, keep_within_capacity, load_balancing_loss
from course_lib.expert_parallel.train import token_batch, train_load_balance
