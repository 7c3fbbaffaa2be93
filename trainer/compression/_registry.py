"""Compression methods by name: the values of ``compression.method``."""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from traind.trainer.compression._cast import Bf16, Fp16, NoCompression
from traind.trainer.compression._powersgd import PowerSGD
from traind.trainer.compression._sparse import Int8, TopK

if TYPE_CHECKING:
    from collections.abc import Mapping

    from traind.trainer.compression._base import Compressor

# Read-only: a mapping of classes, not a registry of live objects, so nothing is shared
# between hooks or tests.
METHODS: Mapping[str, type[Compressor]] = MappingProxyType(
    {cls.name: cls for cls in (NoCompression, Fp16, Bf16, Int8, TopK, PowerSGD)}
)
