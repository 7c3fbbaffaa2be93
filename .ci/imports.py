"""Import every module of the installed traind, and run every command's --help.

Run by .ci/newcomer in a venv with only the runtime dependencies: a module that imports a
test-only package (httpx was one) fails here. A module may miss a package only if it is one
of the optional kernel modules, which only ever load where their extra is installed.
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
import subprocess
import sys

import traind
from traind.extras import EXTRAS

# Modules that exist to hold an extra's code; everything else must import without extras.
OPTIONAL = {"traind.kernels._*_triton": "triton", "traind.kernels._triton_util": "triton"}
# Not importable on their own: alembic runs env.py inside its migration context.
SKIP = {"traind.migrations.env"}


def main() -> int:
    failures = []
    names = sorted(m.name for m in pkgutil.walk_packages(traind.__path__, "traind."))
    for name in names:
        if name in SKIP:
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            allowed = next((pkg for pat, pkg in OPTIONAL.items() if fnmatch.fnmatch(name, pat)),
                           None)
            top = (exc.name or "").split(".")[0]
            if allowed is None or top != allowed or allowed not in EXTRAS:
                failures.append(f"{name}: {exc}")
    if failures:
        print("modules that need packages outside the runtime dependencies:", *failures,
              sep="\n  ", file=sys.stderr)
        return 1
    commands = [[], ["db"], ["metrics"], ["grafana"], ["experiments"], ["service"], ["cluster"]]
    for args in commands:
        r = subprocess.run([sys.executable, "-m", "traind.cli.main", *args, "--help"],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            print(f"traind {' '.join(args)} --help exited {r.returncode}:\n{r.stderr}",
                  file=sys.stderr)
            return 1
    print(f"imported {len(names) - len(SKIP)} modules; every command's --help runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
