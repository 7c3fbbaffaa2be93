"""The daemon's token: every state-changing request must carry it.

Generated at first start into ``var_dir/token``, readable by the daemon's user only (created
with mode 0600 in one ``open``, never widened afterwards). ``traind serve`` names the file and
never prints the token (stdout ends up in the journal under systemd).
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


def write_login_link(var_dir: Path, host: str, port: int, code: str) -> Path:
    """Write the one-time login link to ``var_dir/login-url`` (mode 0600, replaced whole), and
    return its path: the link opens a browser session once, and unlike stdout or the journal
    the file is readable by the daemon's user only."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"  # bound to every address: loopback is one of them
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    path = var_dir / "login-url"
    tmp = path.with_name(f".login-url.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"http://{netloc}/login?token={code}\n")
    os.replace(tmp, path)
    return path


def token_matches(expected: str, given: str | None) -> bool:
    # Constant time: the comparison must not tell an attacker how much of a guess was right.
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())
