"""``traind grafana``: write the dashboards as files, or push them to a Grafana server.

Generating needs only the runtime dependencies (grafana-foundation-sdk builds the dashboards);
pushing needs grafana-client, the optional ``grafana`` extra, imported only by ``push``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from traind.cli.console import fail
from traind.extras import require

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

grafana_app = typer.Typer(help="Grafana dashboards as code: generate the files, or push them.",
                          no_args_is_help=True)
console = Console(stderr=True)


class PushError(RuntimeError):
    """A push that Grafana refused or that never reached it; the message names both."""


def push_dashboards(url: str, token: str, dashboards: Iterable[Mapping[str, Any]], *,
                    folder: str = "traind", timeout: float = 10.0) -> list[str]:
    """Create the folder if missing, then create or replace each dashboard (by its uid).

    Returns the uids pushed. ``overwrite`` makes a re-push after a code change replace what
    is there, which is the point of dashboards as code.
    """
    require("grafana_client")
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout)

    def fail(what: str, exc: Exception) -> PushError:
        status = getattr(exc, "status_code", 0)
        # grafana-client reports transport failures (refused, DNS, timeout) as status 0.
        how = f"HTTP {status}" if status else "no HTTP answer"
        detail = getattr(exc, "message", None) or str(exc)
        return PushError(f"Grafana at {url}: {what} failed ({how}): {detail}")

    try:
        try:
            api.folder.get_folder(folder)
        except GrafanaClientError as exc:
            if exc.status_code != 404:
                raise fail(f"reading folder {folder!r}", exc) from exc
            api.folder.create_folder(title=folder, uid=folder)
    except GrafanaException as exc:
        raise fail(f"creating folder {folder!r}", exc) from exc
    except OSError as exc:  # niquests' connection errors are OSErrors
        raise fail(f"reading folder {folder!r}", exc) from exc

    pushed = []
    for dash in dashboards:
        uid = str(dash["uid"])
        body = {"dashboard": {**dash, "id": None}, "folderUid": folder, "overwrite": True,
                "message": "traind grafana push"}
        try:
            api.dashboard.update_dashboard(body)
        except (GrafanaException, OSError) as exc:
            raise fail(f"saving dashboard {uid!r}", exc) from exc
        pushed.append(uid)
    return pushed


@grafana_app.command()
def generate(
    out: Annotated[Path, typer.Option(help="The repository's docker/ folder: grafana/ and "
                                           "prometheus/rules.yml are written under it.")]
    = Path("docker"),
) -> None:
    """Write the dashboards JSON, Grafana provisioning and Prometheus recording rules."""
    from traind.metrics.grafana import generate as write

    for path in write(out):
        console.print(f"wrote {path}", highlight=False)


@grafana_app.command()
def push(
    url: Annotated[str, typer.Option(envvar="GRAFANA_URL",
                                     help="Grafana base URL, e.g. http://grafana:3000.")],
    token: Annotated[str, typer.Option(envvar="GRAFANA_TOKEN", show_default=False,
                                       help="Service-account token (or set GRAFANA_TOKEN, "
                                            "which keeps it out of shell history).")],
    folder: Annotated[str, typer.Option(help="Folder uid and title.")] = "traind",
) -> None:
    """Create or update every traind dashboard on a Grafana server."""
    from traind.metrics.grafana import DASHBOARDS, dashboard

    try:
        uids = push_dashboards(url, token, (dashboard(k) for k in DASHBOARDS), folder=folder)
    except PushError as exc:
        raise fail(exc) from None
    console.print(f"pushed {len(uids)} dashboards to {url} (folder {folder}): "
                  f"{', '.join(uids)}", highlight=False)
