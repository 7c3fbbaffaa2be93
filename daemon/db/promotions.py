"""Keyword-only queries on the promotions table; each function is one short transaction and
returns plain values or frozen views (``PromotionView``), never a live row.

What a promotion means, when it is kept or rolled back and what the job is told are
``daemon/promotions.py``'s. A control message and the row that says it was sent must not
disagree, so the functions that number a message take ``send(seq, ...)`` and call it inside
their transaction: if writing the message fails, nothing is recorded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from traind.daemon.db.models import Promotion, utcnow
from traind.daemon.service import PromotionView

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(frozen=True, slots=True)
class Stamp:
    """What a promotion rests on (``daemon/provenance.py``): the target job's config hash and
    versions, and its evidence's (None: no measured evidence, as a hand-made promotion)."""

    config_hash: str | None = None
    versions: dict[str, str] | None = None
    evidence_config_hash: str | None = None
    evidence_versions: dict[str, str] | None = None


def list_promotions(engine: Engine, *, run_id: int | None = None,
                    autotune_id: int | None = None, limit: int | None = None,
                    offset: int = 0) -> list[PromotionView]:
    """Promotions, newest first (one page with ``limit``)."""
    q = select(Promotion).order_by(Promotion.id.desc()).limit(limit).offset(offset)
    if run_id is not None:
        q = q.where(Promotion.run_id == run_id)
    if autotune_id is not None:
        q = q.where(Promotion.autotune_id == autotune_id)
    with Session(engine) as s:
        return [_view(p) for p in s.scalars(q)]


def last_setting(engine: Engine, *, run_id: int) -> dict[str, Any] | None:
    """The setting of the run's last applied or kept promotion, or None if it has none."""
    with Session(engine) as s:
        last = s.scalars(select(Promotion).where(
            Promotion.run_id == run_id, Promotion.state.in_(("applied", "kept")))
            .order_by(Promotion.id.desc())).first()
        return None if last is None else dict(last.setting)


def create_promotion(engine: Engine, *, run_id: int, setting: dict[str, Any],
                     previous: dict[str, Any], evidence: dict[str, Any],
                     autotune_id: int | None, send: Callable[[int], None],
                     stamp: Stamp = Stamp()) -> int:
    """A pending promotion with the run's next message number, ``send(seq)`` called before
    it commits; an older one still pending is superseded. Returns its id."""
    with Session(engine) as s, s.begin():
        seq = _next_seq(s, run_id)
        s.execute(update(Promotion).where(Promotion.run_id == run_id,
                                          Promotion.state == "pending")
                  .values(state="superseded", ended_at=utcnow()))
        row = Promotion(run_id=run_id, autotune_id=autotune_id, seq=seq, state="pending",
                        setting=setting, previous=previous, evidence=evidence, **asdict(stamp))
        s.add(row)
        s.flush()
        send(seq)
        return row.id


def record_unsent(engine: Engine, *, run_id: int, state: str, setting: dict[str, Any],
                  previous: dict[str, Any], evidence: dict[str, Any],
                  autotune_id: int | None, reason: str, stamp: Stamp = Stamp()) -> int:
    """A promotion that sent the job nothing (``unchanged``, ``refused``): ended as it is
    written, with no message number, so it neither supersedes a pending one nor takes a
    number from the run's sequence. Returns its id."""
    with Session(engine) as s, s.begin():
        now = utcnow()
        row = Promotion(run_id=run_id, autotune_id=autotune_id, seq=None, state=state,
                        setting=setting, previous=previous, evidence=evidence, reason=reason,
                        created_at=now, ended_at=now, **asdict(stamp))
        s.add(row)
        s.flush()
        return row.id


def mark_applied(engine: Engine, *, run_id: int, seq: int, step: int,
                 error: str | None) -> PromotionView | None:
    """The job applied (or refused, with ``error``) message ``seq`` at ``step``: the promotion
    it carried is applied (refused), or the one it rolled back is rolled back. None if no
    promotion of the run sent that message."""
    with Session(engine) as s, s.begin():
        row = s.scalars(select(Promotion).where(Promotion.run_id == run_id, (
            (Promotion.seq == seq) | (Promotion.rollback_seq == seq)))).first()
        if row is None:
            return None
        if row.rollback_seq == seq:
            row.state, row.ended_at = "rolled_back", utcnow()
        elif error is not None:
            row.state, row.reason, row.ended_at = "refused", error, utcnow()
        else:
            row.state, row.applied_step, row.applied_at = "applied", step, utcnow()
        return _view(row)


def mark_kept(engine: Engine, *, promotion_id: int, reason: str) -> None:
    """An applied promotion stays (anything else is left as it is: it ended meanwhile)."""
    with Session(engine) as s, s.begin():
        row = s.get(Promotion, promotion_id)
        if row is not None and row.state == "applied":
            row.state, row.reason, row.ended_at = "kept", reason, utcnow()


def mark_rolling_back(engine: Engine, *, promotion_id: int, reason: str,
                      send: Callable[[int, dict[str, Any]], None]) -> None:
    """An applied promotion is being undone: ``send(seq, previous setting)`` is called with
    the run's next message number before the row commits (nothing happens to a promotion
    that is no longer applied)."""
    with Session(engine) as s, s.begin():
        row = s.get(Promotion, promotion_id)
        if row is None or row.state != "applied":
            return
        seq = _next_seq(s, row.run_id)
        row.state, row.reason, row.rollback_seq = "rolling_back", reason, seq
        send(seq, dict(row.previous))


def _next_seq(s: Session, run_id: int) -> int:
    # One numbering for promotions and their rollbacks: the job applies only a higher number.
    return 1 + (s.scalar(select(func.max(func.coalesce(Promotion.rollback_seq, Promotion.seq)))
                         .where(Promotion.run_id == run_id)) or 0)


def _view(p: Promotion) -> PromotionView:
    return PromotionView(p.id, p.run_id, p.autotune_id, p.seq, p.state, p.setting, p.previous,
                         p.evidence, p.applied_step, p.reason, p.created_at, p.applied_at,
                         p.ended_at, p.config_hash, p.versions, p.evidence_config_hash,
                         p.evidence_versions)
