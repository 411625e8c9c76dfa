"""The course's shared models: seeded weights that leave the global generator alone."""

import torch

from course_lib.ddp import MLPWithBranches
from course_lib.expert_parallel import TopKRouter, make_experts
from course_lib.models import MLP, TransformerBlock
from course_lib.rpc.remote_functions import RemoteModel


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_constructors_draw_from_their_seed_and_leave_the_global_generator_as_it_was():
    builders = {
        "MLP": lambda seed: MLP(seed=seed),
        "TransformerBlock": lambda seed: TransformerBlock(seed=seed),
        "RemoteModel": lambda seed: RemoteModel(seed=seed),
        "TopKRouter": lambda seed: TopKRouter(8, 4, seed=seed),
        "make_experts": lambda seed: make_experts(4, 8, 16, seed=seed),
        "MLPWithBranches": lambda seed: MLPWithBranches(seed=seed),
    }
    for name, build in builders.items():
        torch.manual_seed(123)
        first = weights(build(0))
        data = torch.rand(4)  # drawn after the constructor: the same as with no constructor before it
        torch.manual_seed(123)
        assert torch.equal(data, torch.rand(4)), f"{name} moved the global generator"
        torch.manual_seed(7)  # another global state: the same weights
        again = weights(build(0))
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{name}'s weights depend on the global state"
        other = weights(build(1))
        assert not all(torch.equal(a, b) for a, b in zip(first, other)), f"{name} ignores its seed"
