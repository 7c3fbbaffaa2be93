"""Per-layer telemetry: gradient norm, weight norm and update-to-weight ratio per layer.

All norms are computed with fused multi-tensor ops on the device and read to the host in one
transfer, only on report steps. The update ratio needs the weights before the optimizer step,
so on those steps (only) the weights are copied once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from traind.trainer.dtensors import by_mesh, whole
from traind.trainer.model import layer_groups

if TYPE_CHECKING:
    from collections.abc import Sequence


class LayerStats:
    def __init__(self, model: nn.Module) -> None:
        self.names: list[str] = []
        self._params: list[list[nn.Parameter]] = []
        for name, modules in layer_groups(model).items():
            params = [p for m in modules for p in m.parameters() if p.requires_grad]
            if params:
                self.names.append(name)
                self._params.append(params)
        self._before: list[list[torch.Tensor]] | None = None
        self._grad: torch.Tensor | None = None

    def before_step(self) -> None:
        """After backward (and unscaling), before the optimizer: grad norms and a copy of the
        weights. Call on report steps only."""
        self._grad = torch.stack([_group_norm([p.grad for p in ps if p.grad is not None])
                                  for ps in self._params])
        self._before = [[p.detach().clone() for p in ps] for ps in self._params]

    def after_step(self) -> tuple[list[float], list[float], list[float]]:
        """After the optimizer: (grad norm, weight norm, update ratio) per layer."""
        assert self._before is not None and self._grad is not None, "before_step() first"
        weights, updates = [], []
        for ps, old in zip(self._params, self._before, strict=True):
            weights.append(_group_norm([p.detach() for p in ps]))
            updates.append(_group_norm(_differences(ps, old)))
        w = torch.stack(weights)
        ratio = torch.stack(updates) / w.clamp_min(1e-12)
        grad, weight, upd = torch.stack([self._grad, w, ratio]).tolist()  # one host transfer
        self._before = self._grad = None
        return grad, weight, upd


def _group_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(())
    # per mesh: a factory model's layer may hold tp-sharded and plain parameters at once
    norms = [whole(n) for part in by_mesh(list(tensors)) for n in torch._foreach_norm(part)]
    return torch.linalg.vector_norm(torch.stack(norms))


def _differences(params: Sequence[torch.Tensor], old: Sequence[torch.Tensor]
                 ) -> list[torch.Tensor]:
    """``params - old`` elementwise, one foreach per mesh (see _group_norm)."""
    return [d for part in by_mesh(list(zip(params, old, strict=True)), of=lambda po: po[0])
            for d in torch._foreach_sub([p.detach() for p, _ in part], [o for _, o in part])]
