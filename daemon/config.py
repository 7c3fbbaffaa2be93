"""The one typed config tree and how it is loaded.

Precedence, lowest first: defaults, a TOML file, ``TRAIND_*`` environment variables, CLI
``--set`` overrides. Environment names spell the field path with double underscores:
``TRAIND_JOB__STEPS=500`` sets ``job.steps``, ``TRAIND_DAEMON__PORT=9000`` sets ``daemon.port``.
Every invalid value, and every unknown key, stops with the field's path and the reason.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from traind.errors import FieldError, FieldErrors, Loc, dotted
from traind.metrics.retention import RETENTION_SECONDS
from traind.trainer.config import COUNT_MAX, STEPS_MAX, Node, TrainConfig
from traind.trainer.vocab import fit_vocab

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

ENV_PREFIX = "TRAIND_"


class DaemonConfig(Node):
    host: str = Field("127.0.0.1", description="Address the web server binds; loopback unless "
                      "you mean to expose it.")
    port: int = Field(8800, ge=0, le=65535, description="Web server port (0 = any free port).")
    var_dir: Path = Field(Path("var"), description="State folder: database, run folders, "
                          "sockets, logs.")
    db_url: str | None = Field(None, description="SQLAlchemy URL; unset = SQLite (WAL) at "
                               "var_dir/traind.db. PostgreSQL: postgresql+psycopg://...")
    default_job: bool = Field(True, description="Start the configured job when serve starts.")
    max_experiment_jobs: int = Field(1, ge=1, le=64, description="Experiment jobs running "
                                     "at once on this node beside the configured job, whatever "
                                     "their mode: interleaved experiments' jobs, forked "
                                     "experiments' base jobs and trials, and so the auto-"
                                     "tuner's rounds. One at a time unless the user allows "
                                     "more (at once they share the cores and measure each "
                                     "other); the rest wait, the oldest experiment first.")
    oversubscribe: bool = Field(False, description="Allow jobs with more ranks than this "
                                "node has GPUs (or CPUs on a CPU node), or more threads than "
                                "CPUs; off, such a job is refused before it launches.")
    open_pages: bool = Field(True, description="Anyone who reaches the port may read the "
                             "pages; false: a browser must log in first. Changing anything "
                             "always needs a session (or the token, for the API).")
    live_points: int = Field(2000, gt=0, le=COUNT_MAX,
                             description="Points per run kept in memory for charts.")
    ws_ping_seconds: float = Field(20.0, gt=0, le=3600, description="Live websockets are "
                                   "pinged this often and closed when a pong is this late: a "
                                   "page that stops reading is let go, with the buffers it "
                                   "held. Raise it behind a proxy that delays frames.")
    log_lines: int = Field(40, gt=0, le=COUNT_MAX,
                           description="Worker log lines kept with a failed run.")
    node_addr: str | None = Field(None, description="This node's address as the other nodes "
                                  "reach it (multi-node jobs: rendezvous and the ranks' store).")
    node_iface: str | None = Field(None, description="Network interface for collectives "
                                   "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME of the jobs).")
    cluster: bool = Field(False, description="Claim node slots of multi-node jobs from the "
                          "shared queue (daemon.db_url naming the cluster's database).")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names (or "
                                     "addresses) requests may name besides the bind address "
                                     "and loopback; any other Host header gets 400 (DNS "
                                     "rebinding). E.g. [\"traind\"] for a scraper in compose.")


class MetricsConfig(Node):
    gpu: bool = Field(True, description="Read NVIDIA GPUs through NVML (a host without them "
                      "says so once and exports nothing more).")
    per_link: bool = Field(True, description="Per-NVLink families (18 links per H100 GPU); "
                           "switch off on large clusters to cut series.")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint for traces "
                                      "(http://collector:4318); unset = no export.")
    trace_steps_every: int = Field(100, gt=0, le=STEPS_MAX,
                                   description="Trace one step in this many (with "
                                   "its phases as child spans).")
    series_retention_seconds: float = Field(RETENTION_SECONDS, ge=0, description="Seconds a "
                                            "finished run's series stay in /metrics (long "
                                            "enough for Prometheus to scrape their final "
                                            "values); its totals stay in the database.")


class Settings(TrainConfig):
    """The whole tree: the trainer's nodes plus the daemon's own."""

    daemon: DaemonConfig = DaemonConfig()
    metrics: MetricsConfig = MetricsConfig()


def train_config(cfg: TrainConfig, *, default_out_dir: Path,
                 default_cache_dir: Path | None = None) -> TrainConfig:
    """The part of ``cfg`` a worker needs (no daemon node), with ``job.out_dir`` filled in,
    and ``data.cache_dir`` too when a default is given (the daemon's state folder: every run
    on the node shares the corpus cache, so a restart reads its corpus from one place)."""
    base = TrainConfig.model_validate(cfg.model_dump(include=set(TrainConfig.model_fields)))
    out_dir = base.job.out_dir or default_out_dir
    cache_dir = base.data.cache_dir or default_cache_dir
    try:  # the model's vocabulary follows the tokenizer (its file, or the shards' manifest)
        base = fit_vocab(base)
    except FieldErrors as exc:
        raise ConfigError.of(exc) from None
    return base.model_copy(update={
        "job": base.job.model_copy(update={"out_dir": out_dir}),
        "data": base.data.model_copy(update={"cache_dir": cache_dir})})


def corpus_cache_dir(var_dir: Path) -> Path:
    """Where the daemon keeps the corpus cache (``data.cache_dir`` when the config has none)."""
    return var_dir / "cache" / "corpus"


class ConfigError(FieldErrors):
    """A config that cannot be used: ``errors`` holds each bad field's path and why, as
    ``(loc, msg)`` pairs (``traind.errors``); ``str()`` is the text the CLI prints."""

    @classmethod
    def from_validation(cls, exc: ValidationError, prefix: Loc = (), *,
                        bare: bool = False) -> ConfigError:
        """pydantic's errors, every one with its loc (under ``prefix``). The text is
        "invalid config:" over an indented ``path: msg`` line each (the loader's wording);
        ``bare``: pydantic's own messages, a line each and no heading (a forked arm's)."""
        errors = pydantic_errors(exc, prefix, detailed=not bare)
        lines = [f"{dotted(loc) or '(root)'}: {msg}" for loc, msg in errors]
        text = "\n".join(lines) if bare else "invalid config:\n  " + "\n  ".join(lines)
        return cls(errors, text)


def load_settings(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
) -> Settings:
    """Settings from ``path`` (TOML), the environment and ``key.path=value`` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_toml(path)
    environ = os.environ if env is None else env
    for name, raw in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and raw != "":
            keys = name[len(ENV_PREFIX):].lower().split("__")
            assign(tree, keys, parse_value(raw), source=name)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        assign(tree, key.strip().split("."), parse_value(raw), source=f"--set {key}")
    return validate(tree)


def validate(tree: Mapping[str, Any], model: type[Node] = Settings) -> Any:
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError.from_validation(exc) from None


def pydantic_errors(exc: ValidationError, prefix: Loc = (), *,
                    detailed: bool = True) -> list[FieldError]:
    """Each of pydantic's errors as ``(loc, msg)``, its loc kept whole under ``prefix``:
    ``(("job", "steps"), "Input should be greater than 0 (got -1)")``. A model check that
    names fields below its model raises ``FieldErrors``; its pairs join in, under the model's
    loc. ``detailed``: quote a bad single value and say "unknown key" for an extra one
    (the loader's wording); off, pydantic's own messages."""
    out: list[FieldError] = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, FieldErrors):
            out += [((*loc, *sub), msg) for sub, msg in inner.errors]
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if detailed:
            # The input is worth repeating when it is one value, not a whole section.
            shown = err["type"] not in ("missing", "extra_forbidden") and not isinstance(
                err.get("input"), dict | list)
            got = f" (got {err.get('input')!r})" if shown else ""
            msg = ("unknown key" if err["type"] == "extra_forbidden" else msg) + got
        out.append((loc, msg))
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"config file {path} cannot be read: permission denied") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{bad:02x} at offset "
                          f"{exc.start}): TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def parse_value(raw: str) -> Any:
    """A JSON list or table (``["a","b"]``) is parsed; anything else stays a string, which
    pydantic converts (``"500"`` -> 500 for an int field) or rejects with the field's name."""
    if raw.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    return raw


def assign(tree: dict[str, Any], keys: list[str], value: Any, *, source: str,
           loc: Loc | None = None) -> None:
    """Set ``keys`` (a path) in ``tree`` to ``value``. ``source`` names where the value came
    from in an error; ``loc``, the field it sets where that is a request's (an API override)."""
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            msg = f"{'.'.join(keys)} goes below a value, not a section"
            text = f"{source}: {msg}"
            raise ConfigError([(loc, msg) if loc else ((), text)], text)
        node = child
    node[keys[-1]] = value
