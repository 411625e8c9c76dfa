"""course_lib.training: the one step and the one loop the lessons' training runs go through."""

import contextlib

import torch

from course_lib import training
from course_lib.data import batch_for_step, regression
from course_lib.models import MLP


def model_and_optimizer():
    model = MLP(seed=0)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def test_step_is_zero_grad_forward_backward_hook_step():
    model, optimizer = model_and_optimizer()
    x, y = batch_for_step(regression(), 0, 16)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def before_step():  # after backward, before the update: gradients there, parameters unchanged
        seen.append(all(p.grad is not None for p in model.parameters()))
        seen.append(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))

    expected = torch.nn.functional.mse_loss(model(x), y)
    loss = training.step(model, optimizer, x, y, before_step=before_step)
    assert seen == [True, True]
    assert not loss.requires_grad and torch.equal(loss, expected.detach())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_stale_gradient_does_not_leak_into_the_next_step():
    model, optimizer = model_and_optimizer()
    x, y = batch_for_step(regression(), 0, 16)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e3)  # left over from elsewhere: the step must clear it
    training.step(model, optimizer, x, y)
    reference, reference_optimizer = model_and_optimizer()
    training.step(reference, reference_optimizer, x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_train_is_the_step_on_each_global_batch_and_continues_where_it_stopped():
    data = regression()
    model, optimizer = model_and_optimizer()
    calls = []
    hooks = {"around_step": lambda: _recording(calls), "after_step": lambda step, _: calls.append(step)}
    losses = training.train(model, optimizer, data, 3, 16, **hooks)
    losses += training.train(model, optimizer, data, 2, 16, first_step=3)
    assert calls == ["enter", "exit", 0, "enter", "exit", 1, "enter", "exit", 2]

    by_hand, by_hand_optimizer = model_and_optimizer()
    expected = [training.step(by_hand, by_hand_optimizer, *batch_for_step(data, s, 16)).item() for s in range(5)]
    assert losses == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), by_hand.parameters()))


def test_a_rank_trains_on_its_rows_only():
    data = regression()
    model, optimizer = model_and_optimizer()
    mine = training.train(model, optimizer, data, 2, 16, rank=1, world_size=2)
    by_hand, by_hand_optimizer = model_and_optimizer()
    rows = [batch_for_step(data, s, 16, 1, 2) for s in range(2)]
    assert all(len(x) == 8 for x, _ in rows)
    assert mine == [training.step(by_hand, by_hand_optimizer, x, y).item() for x, y in rows]


@contextlib.contextmanager
def _recording(calls):
    calls.append("enter")
    yield
    calls.append("exit")
