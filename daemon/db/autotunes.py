"""Keyword-only queries on the autotunes table; each function is one short transaction and
returns plain values or frozen records, never a live row.

A search's row holds its ``plan`` (rewritten after every round) and, in ``spec``, what was
submitted and the round in flight (``{"submitted": ..., "current": ...}``, a layout only this
module writes). What the search does next is ``daemon/autotune/``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from traind.daemon.db.models import Autotune, utcnow
from traind.daemon.service import AutotuneInfo

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a search stands, as the runner reads it back before each round."""

    state: str
    submitted: dict[str, Any]  # the AutotuneSpec's fields, as JSON
    plan: dict[str, Any]  # Plan.as_dict()
    current: dict[str, Any] | None  # Round.as_dict() of the round in flight, if any


def create_autotune(engine: Engine, *, name: str, space: dict[str, Any],
                    submitted: dict[str, Any], infeasible: Sequence[dict[str, Any]],
                    plan: dict[str, Any], target_run_id: int | None, config_hash: str,
                    traind_version: str, torch_version: str, device: str) -> int:
    """A running search with no round in flight; returns its id."""
    with Session(engine) as s, s.begin():
        row = Autotune(
            name=name, state="running", space=space,
            spec={"submitted": submitted, "current": None}, infeasible=list(infeasible),
            plan=plan, best=None, target_run_id=target_run_id, config_hash=config_hash,
            traind_version=traind_version, torch_version=torch_version, device=device)
        s.add(row)
        s.flush()
        return row.id


def save_round(engine: Engine, *, tune_id: int, plan: dict[str, Any],
               current: dict[str, Any] | None, best: dict[str, Any]) -> None:
    """The plan, the round now in flight (None: between rounds) and the best so far; a search
    no longer running is left as it is (cancelled meanwhile: keep what the user sees)."""
    with Session(engine) as s, s.begin():
        row = s.get(Autotune, tune_id)
        assert row is not None
        if row.state != "running":
            return
        row.plan = plan
        row.spec = {**row.spec, "current": current}
        row.best = best


def end_autotune(engine: Engine, *, tune_id: int, state: str, error: str | None = None,
                 plan: dict[str, Any] | None = None, best: dict[str, Any] | None = None) -> None:
    """The search ended in ``state`` now; ``error``, ``plan`` and ``best`` are written only
    when given (a failed search keeps its best so far)."""
    given = {"error": error, "plan": plan, "best": best}
    with Session(engine) as s, s.begin():
        row = s.get(Autotune, tune_id)
        if row is None:
            return
        row.state, row.finished_at = state, utcnow()
        for k, v in given.items():
            if v is not None:
                setattr(row, k, v)


def progress(engine: Engine, *, tune_id: int) -> Progress | None:
    with Session(engine) as s:
        row = s.get(Autotune, tune_id)
        return None if row is None else Progress(
            row.state, row.spec["submitted"], row.plan, row.spec.get("current"))


def get_autotune(engine: Engine, *, tune_id: int) -> AutotuneInfo | None:
    with Session(engine) as s:
        row = s.get(Autotune, tune_id)
        return None if row is None else _info(row)


def list_autotunes(engine: Engine, *, limit: int | None = None,
                   offset: int = 0) -> list[AutotuneInfo]:
    """Searches, newest first (one page with ``limit``)."""
    with Session(engine) as s:
        return [_info(r) for r in s.scalars(select(Autotune).order_by(Autotune.id.desc())
                                            .limit(limit).offset(offset))]


def running_autotunes(engine: Engine) -> list[int]:
    """Ids of the searches still running (a daemon that restarts carries them on)."""
    with Session(engine) as s:
        return list(s.scalars(select(Autotune.id).where(Autotune.state == "running")))


def _info(row: Autotune) -> AutotuneInfo:
    rounds = list(row.plan.get("rounds", []))
    if (current := row.spec.get("current")) is not None:
        rounds.append(current)
    return AutotuneInfo(
        id=row.id, name=row.name, state=row.state, best=row.best, infeasible=row.infeasible,
        rounds=rounds, error=row.error, target_run_id=row.target_run_id,
        config_hash=row.config_hash,
        versions={"traind": row.traind_version, "torch": row.torch_version,
                  "device": row.device},
        created_at=row.created_at, finished_at=row.finished_at)
