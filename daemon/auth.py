"""The daemon's token: every state-changing request must carry it.

Generated at first start into ``var_dir/token``, readable by the daemon's user only (created
with mode 0600 in one ``open``, never widened afterwards), and shown once by ``traind serve``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def load_or_create_token(var_dir: Path) -> tuple[str, bool]:
    """The token, and whether it was created just now."""
    path = var_dir / "token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"{path} is empty: delete it to make a new token") from None
        return token, False
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def token_matches(expected: str, given: str | None) -> bool:
    # Constant time: the comparison must not tell an attacker how much of a guess was right.
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())
