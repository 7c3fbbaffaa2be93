"""JSON shapes of the API, separate from the daemon's views so the wire format is explicit."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from traind.daemon.service import RunView


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    state: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None
    summary: dict[str, Any]

    @field_validator("created_at", "started_at", "finished_at")
    @classmethod
    def _utc(cls, t: datetime | None) -> datetime | None:
        # SQLite returns naive datetimes (written in UTC); without an offset a browser's
        # Date.parse would read them as local time.
        return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t

    @classmethod
    def of(cls, run: RunView) -> RunOut:
        return cls.model_validate(run)


class SampleOut(BaseModel):
    """One exported series' current value, as a scrape shows it (counters end in _total)."""

    model_config = ConfigDict(from_attributes=True)

    name: str
    labels: dict[str, str]
    value: float
