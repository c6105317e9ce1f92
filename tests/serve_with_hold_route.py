"""`python -m vramledger.worker serve` wrapped for the tests: one more route, POST /test/hold?mib=N, holds memory
that the ledger does not declare (the exporter must then report it as unaccounted).

    python tests/serve_with_hold_route.py [serve flags...]
"""
from __future__ import annotations

import sys

from fastapi import FastAPI

from vramledger.worker import cli
from vramledger.worker.http import server


def with_hold_route(app: FastAPI) -> FastAPI:
    held: list[bytearray] = []

    @app.post("/test/hold", include_in_schema=False)
    async def hold(mib: int) -> dict:
        held.append(bytearray(b"\x01") * (mib << 20))  # filled, so every page is resident
        return {"held_mib": sum(len(b) for b in held) >> 20}

    return app


if __name__ == "__main__":
    real_create_app = server.create_app
    server.create_app = lambda *args, **kwargs: with_hold_route(real_create_app(*args, **kwargs))
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
