"""A benchmark's measurement in a process of its own (its memory, its instruction set, its
engine alone): the child prints its figures as one JSON line, the last it writes."""

from __future__ import annotations

import json
import subprocess
import sys


def child_figures(command: list[str], name: str, env: dict[str, str] | None = None) -> dict | None:
    """The figures ``command`` printed last, or None (its error told on stderr) if it failed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"{name} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.splitlines()[-1])
