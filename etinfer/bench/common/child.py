"""A benchmark's measurement in a process of its own (its memory, its instruction set, its
engine alone, or another program's Python): the child prints its figures as one JSON line, the
last it writes."""

from __future__ import annotations

import json
import subprocess
import sys


def run_child(command: list[str], name: str, env: dict[str, str] | None = None) -> str | None:
    """What ``command`` printed, or None (its error told on stderr) if it failed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"{name} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return done.stdout


def child_figures(command: list[str], name: str, env: dict[str, str] | None = None) -> dict | None:
    """The figures ``command`` printed last, or None if it failed."""
    out = run_child(command, name, env)
    return None if out is None else json.loads(out.splitlines()[-1])
