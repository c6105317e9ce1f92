"""GET /health: 200 once the worker serves, 503 while it loads or after its engine failed."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from vramledger.worker.http.errors import ErrorResponse, error_body
from vramledger.worker.http.state import StateDep

router = APIRouter()


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(state: StateDep):
    """200 once the engine is loaded; 503 while loading or after it failed."""
    if state.ready:
        return {"status": "ok"}
    status = "failed" if state.engine_loop.error is not None else "loading"
    return JSONResponse({"status": status, **error_body(f"the worker is {status}", "server_error",
                                                         None, f"model_{status}")}, status_code=503)
