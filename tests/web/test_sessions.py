"""Sessions and one-time login codes (web/sessions.py), on a fake clock."""

from __future__ import annotations

from traind.web.sessions import Sessions


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_expires() -> None:
    clock = Clock()
    sessions = Sessions(seconds=60, clock=clock)
    s = sessions.create()
    assert sessions.get(s.id) == s
    clock.now += 59
    assert sessions.get(s.id) == s
    clock.now += 1
    assert sessions.get(s.id) is None
    assert len(sessions) == 0  # dropped, not kept


def test_sessions_are_bounded_oldest_first() -> None:
    sessions = Sessions(limit=3)
    made = [sessions.create() for _ in range(5)]
    assert len(sessions) == 3
    assert [sessions.get(s.id) is not None for s in made] == [False, False, True, True, True]


def test_each_session_has_its_own_random_tokens() -> None:
    sessions = Sessions()
    a, b = sessions.create(), sessions.create()
    assert len({a.id, a.csrf, a.live, b.id, b.csrf, b.live}) == 6
    assert all(len(t) >= 40 for t in (a.id, a.csrf, a.live))


def test_a_login_code_opens_one_session_once() -> None:
    sessions = Sessions()
    code = sessions.login_code()
    first = sessions.redeem(code)
    assert first is not None and sessions.get(first.id) == first
    assert sessions.redeem(code) is None
    assert sessions.redeem("") is None and sessions.redeem(None) is None
    assert sessions.redeem(code[:-1] + "x") is None


def test_ending_a_session() -> None:
    sessions = Sessions()
    s = sessions.create()
    sessions.end(s.id)
    assert sessions.get(s.id) is None
    sessions.end(s.id)  # twice is fine
    assert sessions.get(None) is None and sessions.get("") is None
