from __future__ import annotations

import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import torch

from traind.trainer.checkpoint import (
    latest,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

if TYPE_CHECKING:
    from pathlib import Path


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


def test_keep_zero_keeps_all(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _state(step), keep_last=0)
    assert len(list_checkpoints(tmp_path)) == 5


def test_retention_counts_complete_checkpoints_only(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, _state(step), keep_last=5)
    torn = save_checkpoint(tmp_path, 40, _state(40), keep_last=5)
    torn.write_bytes(torn.read_bytes()[:-100])
    # Keeping 2 of (10, 20, 30, torn 40): the torn one is not one of them, and it goes.
    save_checkpoint(tmp_path, 35, _state(35), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000030.pt",
                                                            "step_00000035.pt"]
    assert latest(tmp_path) == tmp_path / "step_00000035.pt"


def test_pruning_never_deletes_a_file_being_written(tmp_path: Path) -> None:
    host = socket.gethostname().replace("~", "-")
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        live_tmp = tmp_path / f".tmp-step_00000030~{host}~{writer.pid}~abc.pt"
        dead_tmp = tmp_path / f".tmp-step_00000020~{host}~{dead.pid}~abc.pt"
        remote_tmp = tmp_path / ".tmp-step_00000025~other-node~1~abc.pt"
        for tmp in (live_tmp, dead_tmp, remote_tmp):
            tmp.write_bytes(b"half a checkpoint")
        live_dcp = tmp_path / ".tmp-dcp_step_00000030"
        live_dcp.mkdir()
        (live_dcp / "OWNER").write_text(f"{host}~{writer.pid}")
        for step in range(1, 4):
            save_checkpoint(tmp_path, step, _state(step), keep_last=1)
        assert live_tmp.exists() and remote_tmp.exists() and live_dcp.is_dir()
        assert not dead_tmp.exists()
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003.pt"]
    finally:
        writer.kill()
        writer.wait()
    save_checkpoint(tmp_path, 4, _state(4), keep_last=1)  # its writer is gone now
    assert not live_tmp.exists() and not live_dcp.exists() and remote_tmp.exists()


def test_a_writer_killed_mid_write_leaves_no_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _state(1), keep_last=3)
    code = ("import os, sys, torch\n"
            "from traind.trainer import checkpoint as c\n"
            "def die(*a, **k): os._exit(9)\n"
            "os.replace = die\n"  # killed after the temp file is written, before the rename
            f"c.save_checkpoint({str(tmp_path)!r}, 2, {{'w': torch.ones(3)}}, keep_last=3)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert list(tmp_path.glob(".tmp-step_00000002~*"))  # the half-written one is left
    assert latest(tmp_path) == tmp_path / "step_00000001.pt"
    save_checkpoint(tmp_path, 3, _state(3), keep_last=3)
    assert not list(tmp_path.glob(".tmp-*"))  # its writer is gone: cleaned up
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt",
                                                            "step_00000003.pt"]
