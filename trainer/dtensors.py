"""DTensor helpers shared by the optimizer, clipping and per-layer telemetry: one home for
turning a DTensor figure into a whole one, and for keeping tensors of different meshes apart
(foreach kernels and fused AdamW refuse to mix DTensors with plain tensors, or meshes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (``full_tensor()`` sums a partial norm's shards; a replicated
    one is whole already); any other tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def by_mesh(items: list[Any], of: Callable[[Any], Any] = lambda t: t) -> list[list[Any]]:
    """``items`` by the device mesh of ``of(item)`` (None: a plain tensor), in first-seen
    order; one empty part when there are none. A factory model's tp plan leaves its other
    layers plain tensors, and FSDP2 over dp x tp puts its tp-sharded parameters on another
    mesh than its dp-only ones."""
    # keyed by the mesh itself: equal meshes are one (FSDP2's parameters carry equal mesh
    # objects that are not the same object)
    parts: dict[Any, list[Any]] = {}
    for item in items:
        parts.setdefault(getattr(of(item), "device_mesh", None), []).append(item)
    return list(parts.values()) or [[]]
