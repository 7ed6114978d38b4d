"""``etinfer serve`` in a subprocess on a free loopback port, for benchmarks and tests that
want the server in its own interpreter, as in a real deployment (its own memory, its own GIL;
on a small machine it still shares the cores)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

SERVER_START_S = 300.0  # reading the model and building the engine on a loaded machine


@dataclass
class LocalServer:
    url: str
    process: subprocess.Popen


@contextlib.contextmanager
def local_server(
    flags: list[str], *, pythonpath: str | None = None, env: dict[str, str] | None = None
) -> Iterator[LocalServer]:
    """Start ``etinfer serve`` with ``flags`` and wait until /health answers; stop it on exit.
    ``pythonpath`` puts another checkout of etinfer first (a side-by-side comparison)."""
    import httpx2  # the test extra's client: only benchmarks and tests start servers

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "etinfer.cli", "serve", "--port", str(port), *flags]
    environment = {**os.environ, **(env or {})}
    if pythonpath:
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (pythonpath, environment.get("PYTHONPATH")) if p
        )
    # `python -m` puts the working directory first on the path: run in the tree measured.
    server = subprocess.Popen(command, env=environment, cwd=pythonpath)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        with httpx2.Client() as http:  # one client: each new one builds an SSL context
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"etinfer serve exited with {server.returncode}")
                with contextlib.suppress(httpx2.TransportError):
                    if http.get(f"{url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("etinfer serve did not come up")
                time.sleep(0.5)
        yield LocalServer(url, server)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
