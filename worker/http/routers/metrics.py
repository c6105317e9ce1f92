"""GET /metrics: the app's Prometheus registry, in the exposition format the scraper asks for."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client.exposition import choose_encoder

from vramledger.worker.http.errors import APIError
from vramledger.worker.http.state import StateDep

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: StateDep):
    if not state.settings.metrics:
        raise APIError(404, "metrics are disabled on this worker", code="metrics_disabled")
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(state.registry), headers={"Content-Type": content_type})
