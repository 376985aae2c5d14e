"""Requests to the server app in this process, with no socket: httpx's ASGI transport.

What the batch runners are handed as their line handler (`batch.executor.Handler`): the Batch
API's jobs (`server.batches`), `run-batch` (`server.offline`) and its Ray Data actors.
"""

from __future__ import annotations

from typing import Any

import httpx

from batchinfer.server.errors import APIError


class AppClient:
    """Requests to an ASGI app in this process; `headers` go with each (auth, tier)."""

    def __init__(self, app: Any, headers: dict[str, str] | None = None) -> None:
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                        base_url="http://batch", timeout=None)
        self.headers = headers or {}

    async def __call__(self, url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
        response = await self.client.post(url, json=body, headers=self.headers)
        try:
            payload = response.json()
        except ValueError:
            payload = APIError(response.status_code, response.text[:500]).body()
        return response.status_code, payload, response.headers.get("x-request-id")

    async def get(self, url: str) -> httpx.Response:
        return await self.client.get(url, headers=self.headers)

    async def aclose(self) -> None:
        await self.client.aclose()
