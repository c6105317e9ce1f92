"""Test-only routes, mounted only when VRAMLEDGER_TEST_HOOKS=1: memory held outside the ledger."""
from __future__ import annotations

import os

from fastapi import FastAPI

ENV = "VRAMLEDGER_TEST_HOOKS"


def install_test_hooks(app: FastAPI) -> None:
    if os.environ.get(ENV) != "1":
        return
    held: list[bytearray] = []

    @app.post("/test/hold", include_in_schema=False)
    async def hold(mib: int) -> dict:
        held.append(bytearray(b"\x01") * (mib << 20))  # filled, so every page is resident
        return {"held_mib": sum(len(b) for b in held) >> 20}
