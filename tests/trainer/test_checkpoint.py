from __future__ import annotations

from pathlib import Path

import pytest
import torch

from traind.trainer.checkpoint import (
    latest,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _state(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.full((4,), float(step)), "meta": {"a": [1, 2]}}


def test_round_trip(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 7, _state(7), keep_last=3)
    assert path.name == "step_00000007.pt"
    state = load_checkpoint(path)
    assert state["step"] == 7 and torch.equal(state["w"], torch.full((4,), 7.0))
    assert latest(tmp_path) == path


def test_torn_and_temp_files_are_never_returned(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, 1, _state(1), keep_last=5)
    torn = save_checkpoint(tmp_path, 2, _state(2), keep_last=5)
    torn.write_bytes(torn.read_bytes()[:-100])  # a write cut short
    (tmp_path / "step_00000003.pt").write_bytes(b"not a checkpoint")
    (tmp_path / ".tmp-step_abc.pt").write_bytes(good.read_bytes())  # a writer died here
    (tmp_path / "step_00000009.pt.partial").write_bytes(good.read_bytes())
    assert latest(tmp_path) == good
    with pytest.raises(ValueError, match="incomplete or corrupt"):
        load_checkpoint(torn)


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, 1, _state(1), keep_last=5)
    bad = save_checkpoint(tmp_path, 2, _state(2), keep_last=5)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert latest(tmp_path) == good


def test_keep_last_k(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, step * 10, _state(step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000040.pt", "step_00000050.pt"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_empty_or_missing_folder(tmp_path: Path) -> None:
    assert latest(tmp_path) is None
    assert latest(tmp_path / "missing") is None
