"""The engine's default SGD: torch's fused kernel for dense models, the same update rule as the loop."""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.sparse import default_sgd

LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_dense_model_gets_fused_sgd_with_the_loops_update() -> None:
    engine_model, loop_model = _mlp(), _mlp()
    opt = default_sgd(engine_model, LR, MOMENTUM, WEIGHT_DECAY)
    assert opt.param_groups[0]["fused"] is True, opt.param_groups[0]
    loop = torch.optim.SGD(loop_model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    assert not loop.param_groups[0]["fused"], "the baseline must be torch's default loop"
    got, want = _train(engine_model, opt, 20), _train(loop_model, loop, 20)
    # Same rule (lr, momentum, weight decay), rounded in another order: equal to float32 rounding.
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), f"max diff {(a - b).abs().max().item():.3g}"
    moved = max((a - p).abs().max().item() for a, p in zip(got, _mlp().parameters(), strict=True))
    assert moved > 1e-3, f"expected training to move the weights, max change {moved:.3g}"


def test_sparse_tables_keep_the_per_tensor_loop() -> None:
    # torch's fused SGD takes no sparse gradients; sparse.py gives such tables their own plain group.
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = default_sgd(model, LR, MOMENTUM, WEIGHT_DECAY)
    assert [bool(g["fused"]) for g in opt.param_groups] == [False, False], opt.param_groups
    assert [g["momentum"] for g in opt.param_groups] == [MOMENTUM, 0.0], opt.param_groups


def test_a_checkpointed_optimizer_resumes_with_the_implementation_it_was_saved_with() -> None:
    model = _mlp()
    saved = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)  # a pre-fused checkpoint
    _train(model, saved, 2)
    resumed = default_sgd(model, LR, MOMENTUM, 0.0)
    resumed.load_state_dict(saved.state_dict())
    assert not resumed.param_groups[0]["fused"], "an older checkpoint resumes with the loop it ran"
