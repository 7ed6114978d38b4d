"""A benchmark's measurement in a process of its own (its memory, its instruction set, its
engine alone, or another program's Python): the child prints its figures as one JSON line, the
last it writes, and the parent records the run's one result."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable


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


def with_child(
    child: Callable[[argparse.Namespace], dict],
    command: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """``command``, or where the arguments name a child's part (``--child``) that part alone:
    ``child``'s figures printed as one JSON line for the parent, which records the result."""

    def dispatch(args: argparse.Namespace) -> int:
        if args.child:
            print(json.dumps(child(args)))
            return 0
        return command(args)

    return dispatch
