"""The playground page at ``/``: static files inside the package, no build step, nothing
fetched from the network. The page talks to the server's own OpenAI endpoints, like any
client, so it needs nothing else from the server."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from etinfer.config import EngineConfig

STATIC = Path(__file__).parent / "static"


def add_playground(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html")


def control_layers(config: EngineConfig) -> dict:
    """Which control layers the engine runs, for ``/v1/models`` (the page shows them)."""
    control = config.control
    return {
        "sampling": control.sampling and f"target {control.entropy_target} nats",
        "pruning": bool(control.pruning),
        "scheduling": bool(control.scheduling) or config.scheduling_policy == "entropy",
        "switching": bool(control.switching),
        "speculative": config.speculative.as_flag() if config.speculative else False,
        "sparse_prefill": bool(control.sparse_prefill),
        "kv_compression": bool(control.kv_compression),
        "entropy_target": control.entropy_target if control.sampling else None,
    }
