"""daemon/ingest/messages.py and router.py: each event kind's hub message and database row,
and the router's rank filter and order."""

from __future__ import annotations

import math

from traind.contracts.events import (
    ArmEvent,
    EvalEvent,
    LifecycleEvent,
    LinkEvent,
    NumericsEvent,
    PrecisionEvent,
    SNREvent,
    StepEvent,
)
from traind.daemon.ingest import messages
from traind.daemon.ingest.router import HubFeed, Router

STEP = StepEvent(rank=0, step=7, loss=2.5, lr=1e-3, grad_norm=0.5, tokens=128,
                 step_seconds=0.25, data_seconds=0.0, forward_seconds=0.1,
                 backward_seconds=0.1, optimizer_seconds=0.05, time=12.0)


def test_a_step_goes_to_the_hub_with_the_summarys_throughput_and_not_to_the_database():
    assert messages.hub_message(3, STEP, tokens_per_second=1024.0) == {
        "type": "step", "run": 3, "step": 7, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5,
        "tokens_per_second": 1024.0, "goodput": None, "ettr": None, "step_seconds": 0.25,
        "time": 12.0}
    assert messages.row(STEP) is None
    # the run's goodput as the summary holds it, for the overview's header
    with_goodput = messages.hub_message(3, STEP, tokens_per_second=1.0,
                                        goodput={"ratio": 0.5, "ettr": 0.75})
    assert with_goodput is not None
    assert (with_goodput["goodput"], with_goodput["ettr"]) == (0.5, 0.75)


def test_an_eval_goes_to_both():
    e = EvalEvent(rank=0, step=10, val_loss=2.0, batches=4, time=5.0)
    assert messages.hub_message(1, e, tokens_per_second=0.0) == {
        "type": "eval", "run": 1, "step": 10, "val_loss": 2.0, "time": 5.0}
    assert messages.row(e) == {"kind": "eval", "step": 10, "value": 2.0,
                               "data": {"batches": 4}}


def test_a_lifecycle_phase_is_a_row_of_its_own_kind():
    e = LifecycleEvent(rank=0, phase="checkpoint", step=15, detail={"path": "p"})
    assert messages.hub_message(1, e, tokens_per_second=0.0) is None
    assert messages.row(e) == {"kind": "checkpoint", "step": 15, "data": {"path": "p"}}


def test_an_arm_block_is_a_row_with_its_rate_and_no_nan():
    e = ArmEvent(rank=0, step=20, arm="bf16", block=3, steps=4, tokens=400, seconds=2.0,
                 loss=math.nan, grad_error=math.inf)
    assert messages.hub_message(1, e, tokens_per_second=0.0) is None
    assert messages.row(e) == {"kind": "arm", "step": 20, "value": 200.0, "data": {
        "arm": "bf16", "block": 3, "steps": 4, "tokens": 400, "seconds": 2.0,
        "loss": None, "grad_error": None}}
    stalled = ArmEvent(rank=0, step=20, arm="a", block=0, steps=0, tokens=0, seconds=0.0,
                       loss=1.0)
    assert messages.row(stalled)["value"] is None  # type: ignore[index]


def test_a_precision_switch_goes_to_both_with_a_json_safe_snr():
    e = PrecisionEvent(rank=0, step=5, group="head", before="fp32", after="bf16",
                       snr=math.nan, time=1.0)
    assert messages.hub_message(2, e, tokens_per_second=0.0) == {
        "type": "precision", "run": 2, "step": 5, "group": "head", "before": "fp32",
        "after": "bf16", "snr": None}
    row = messages.row(e)
    assert row is not None and row["kind"] == "precision" and row["data"] == {
        "group": "head", "before": "fp32", "after": "bf16"}


def test_an_snr_report_goes_to_the_hub_only():
    e = SNREvent(rank=0, step=6, window_step=5, groups=["head"], snr=[math.inf],
                 modes=["bf16"])
    assert messages.hub_message(2, e, tokens_per_second=0.0) == {
        "type": "snr", "run": 2, "step": 5, "groups": ["head"], "snr": [None],
        "modes": ["bf16"]}
    assert messages.row(e) is None


def test_a_numerics_action_is_kept_for_the_run_page():
    e = NumericsEvent(rank=0, step=9, action="rollback", reason="loss_spike", value=math.inf,
                      limit=3.5, resume_step=5, skipped_batches=4)
    assert messages.hub_message(2, e, tokens_per_second=0.0) is None
    assert messages.row(e) == {"kind": "numerics", "step": 9, "value": None, "data": {
        "action": "rollback", "reason": "loss_spike", "limit": 3.5, "resume_step": 5,
        "skipped_batches": 4}}


def test_the_router_calls_observers_in_order_and_lead_only_ones_for_the_lead_rank():
    seen: list[tuple[str, int]] = []
    router = Router(lead=lambda _run, rank: rank == 0)
    router.add(lambda _r, e: seen.append(("all", e.rank)))
    router.add(lambda _r, e: seen.append(("lead", e.rank)), lead_only=True)
    router.route(1, EvalEvent(rank=1, step=1, val_loss=1.0, batches=1))
    router.route(1, EvalEvent(rank=0, step=1, val_loss=1.0, batches=1))
    assert seen == [("all", 1), ("all", 0), ("lead", 0)]


class _Hub:
    def __init__(self) -> None:
        self.sent: list[dict[str, object]] = []

    def publish(self, message: dict[str, object]) -> None:
        self.sent.append(message)


def test_the_hub_gets_each_snr_window_once():
    hub = _Hub()
    feed = HubFeed(hub, lambda _run: 0.0)  # type: ignore[arg-type]
    for step, window in [(6, 5), (7, 5), (11, 10)]:
        feed(1, SNREvent(rank=0, step=step, window_step=window, groups=[], snr=[], modes=[]))
    assert [m["step"] for m in hub.sent] == [5, 10]


def test_the_link_matrix_is_kept_for_the_run_and_not_charted_live():
    e = LinkEvent(rank=0, step=0, latency=[[0.0, 2e-5], [3e-5, 0.0]],
                  bandwidth=[[0.0, 1e9], [4e8, 0.0]], latency_bytes=8, bandwidth_bytes=1 << 20,
                  seconds=0.05, placement="auto", order=[1, 0])
    assert messages.hub_message(2, e, tokens_per_second=0.0) is None
    assert messages.row(e) == {"kind": "link", "step": 0, "value": 0.05, "data": {
        "placement": "auto", "order": [1, 0], "latency": [[0.0, 2e-5], [3e-5, 0.0]],
        "bandwidth": [[0.0, 1e9], [4e8, 0.0]]}}
