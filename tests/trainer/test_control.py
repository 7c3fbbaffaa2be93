"""Settings the daemon hands a running job through the control file."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from traind.contracts.control import FILENAME, Control, read_control, write_control
from traind.contracts.events import Event, LifecycleEvent, StepEvent
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from traind.trainer.config import TrainConfig


def test_control_round_trip_and_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "run" / FILENAME
    assert read_control(path) is None
    write_control(path, Control(seq=3, setting={"precision": "bf16"}))
    assert read_control(path) == Control(seq=3, setting={"precision": "bf16"})
    assert [p.name for p in path.parent.iterdir()] == [FILENAME]  # no temp file left
    path.write_text('{"seq": "x"}')
    with pytest.raises(ValueError, match="control message is"):
        read_control(path)
    path.write_text("{")
    with pytest.raises(ValueError, match=FILENAME):
        read_control(path)


class _WriteAt(ListSink):
    """Writes a control message when the job reports ``step`` (as the daemon would, while
    the job runs)."""

    def __init__(self, path: Path, step: int, control: Control) -> None:
        super().__init__()
        self.path, self.step, self.control = path, step, control

    def emit(self, event: Event) -> None:
        super().emit(event)
        if isinstance(event, StepEvent) and event.step == self.step:
            write_control(self.path, self.control)


def _promoted(events: list[Event]) -> list[LifecycleEvent]:
    return [e for e in events if isinstance(e, LifecycleEvent) and e.phase == "promoted"]


def test_a_setting_takes_effect_at_the_next_checkpoint_boundary(
        tmp_path: Path, make_config: Callable[..., TrainConfig]) -> None:
    cfg = make_config(tmp_path, steps=30, checkpoint_every=10)
    sink = _WriteAt(tmp_path / FILENAME, 13, Control(seq=1, setting={"precision": "bf16"}))
    train(cfg, sink)
    promoted = _promoted(sink.events)
    assert [(e.step, e.detail["seq"], e.detail["error"]) for e in promoted] == [(20, 1, None)]
    # The same job without the message: identical up to the boundary, bf16 after it.
    plain = ListSink()
    train(make_config(tmp_path / "plain", steps=30, checkpoint_every=10), plain)

    def losses(events: list[Event]) -> dict[int, float]:
        return {e.step: e.loss for e in events if isinstance(e, StepEvent)}

    got, ref = losses(sink.events), losses(plain.events)
    assert all(got[s] == ref[s] for s in range(1, 21))
    assert all(got[s] != ref[s] for s in range(21, 31))

    # A resumed job takes the latest setting again at its start (its config says fp32).
    again = ListSink()
    train(make_config(tmp_path, steps=40, checkpoint_every=10), again)
    assert [(e.step, e.detail["seq"]) for e in _promoted(again.events)] == [(30, 1)]


def test_a_setting_the_job_cannot_take_is_refused_and_the_job_goes_on(
        tmp_path: Path, make_config: Callable[..., TrainConfig]) -> None:
    write_control(tmp_path / FILENAME, Control(seq=1, setting={
        "compression": {"method": "int8"}}))
    sink = ListSink()
    result = train(make_config(tmp_path, steps=12, checkpoint_every=5), sink)
    assert result.step == 12
    (refused,) = _promoted(sink.events)
    assert refused.step == 0 and "needs DDP" in refused.detail["error"]
    # The same message is not tried again at later boundaries.
    write_control(tmp_path / FILENAME, Control(seq=2, setting={"precision": "fp16"}))
    sink = ListSink()
    train(make_config(tmp_path, steps=20, checkpoint_every=5), sink)
    (refused,) = _promoted(sink.events)
    assert refused.detail["seq"] == 2 and "setting.precision" in refused.detail["error"]


def test_a_malformed_control_file_is_reported_not_fatal(
        tmp_path: Path, make_config: Callable[..., TrainConfig]) -> None:
    (tmp_path / FILENAME).write_text(json.dumps({"setting": {}}))
    sink = ListSink()
    assert train(make_config(tmp_path, steps=5, checkpoint_every=5), sink).step == 5
    assert all("control message" in e.detail["error"] for e in _promoted(sink.events))
