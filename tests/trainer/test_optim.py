from __future__ import annotations

import pytest
import torch

from traind.trainer.config import ModelConfig, OptimConfig, TrainConfig
from traind.trainer.model import GPT
from traind.trainer.optim import (
    adamw_kernel,
    build_optimizer,
    clip_grad_norm,
    lr_at,
    param_groups,
)

CFG = TrainConfig.model_validate({"job": {"steps": 110},
                                  "optim": {"lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1}})


@pytest.mark.parametrize(("step", "lr"), [
    (0, 0.0), (1, 0.1), (5, 0.5), (10, 1.0),  # linear warm-up
    (60, 0.55),  # half-way down the cosine: (1 + 0.1) / 2
    (110, 0.1), (500, 0.1),  # floor at min_lr_ratio * lr, also past the end
])
def test_lr_schedule(step: int, lr: float) -> None:
    assert lr_at(step, CFG) == pytest.approx(lr)


def test_no_warmup() -> None:
    cfg = CFG.model_copy(update={"optim": OptimConfig(lr=1.0, warmup_steps=0)})
    assert lr_at(1, cfg) == pytest.approx(1.0, abs=1e-3)


def test_weight_decay_only_on_matrices() -> None:
    model = GPT(ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_clip_returns_the_norm_before_clipping() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)  # norm 6
    norm = clip_grad_norm([p], 1.0)
    assert isinstance(norm, torch.Tensor) and norm.item() == pytest.approx(6.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
    p.grad = torch.full((4,), 3.0)
    assert clip_grad_norm([p], 0.0).item() == pytest.approx(6.0)  # 0 = measure, no clip
    assert p.grad.norm().item() == pytest.approx(6.0)


@pytest.mark.parametrize(("device", "kernel"), [
    ("cpu", {"fused": True}),  # 6x foreach alone on this CPU (bench/optimizer.py)
    ("cuda", {"fused": True}),
    ("meta", {"foreach": True}),  # no fused kernel: the multi-tensor path that runs anywhere
])
def test_adamw_takes_the_fused_kernel_where_torch_has_one(device: str,
                                                          kernel: dict[str, bool]) -> None:
    assert adamw_kernel(torch.device(device)) == kernel


def test_the_fused_cpu_optimizer_steps_as_foreach_does() -> None:
    """The kernel changes the speed, not the update: both reach the same weights."""
    torch.manual_seed(0)
    ref = GPT(ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8))
    fused = GPT(ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8))
    fused.load_state_dict(ref.state_dict())
    cfg = OptimConfig()
    opt = build_optimizer(fused, cfg, torch.device("cpu"))
    assert all(g["fused"] for g in opt.param_groups)
    ref_opt = torch.optim.AdamW(param_groups(ref, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                foreach=True)
    x = torch.randint(0, 256, (2, 8))
    for _ in range(3):
        for model, o in ((ref, ref_opt), (fused, opt)):
            _, loss = model(x, x)
            loss.backward()  # type: ignore[union-attr]
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, a), b in zip(ref.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
