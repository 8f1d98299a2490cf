"""GET /kv: the live KV map page (one self-contained HTML file), and GET /kv/snapshot: the JSON it polls at 2 Hz.
The snapshot is built in the engine loop thread between two steps (engine/kv_snapshot.py); with data-parallel
replicas, /kv?replica=i shows replica i."""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.serving import engine_error

if TYPE_CHECKING:  # Ray is an extra
    from pagedllm.distributed.client import DataParallelEngine


def add_kv_routes(app: FastAPI, engine: AsyncEngine | DataParallelEngine) -> None:
    page = resources.files("pagedllm.entrypoints.openai").joinpath("static/kv.html").read_text(encoding="utf-8")

    @app.get("/kv", response_class=HTMLResponse)
    async def kv_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/kv/snapshot")
    async def kv_snapshot_json(replica: int = 0) -> JSONResponse:
        """?replica=i picks a data-parallel replica's pool (one engine: 0 only)."""
        try:
            snap = await engine.kv_snapshot(replica)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="replica") from None
        except EngineDeadError as e:  # (a data-parallel replica down or restarting: 503, not 500)
            raise engine_error(e) from None
        return JSONResponse(snap, headers={"Cache-Control": "no-store"})
