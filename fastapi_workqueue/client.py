"""A REST publisher for producers outside the app: IDs assigned up front, safe retries.

``WorkQueueApiPublisher`` gives every message a MessageID before the first attempt and retries
transport errors and 5xx answers with the same IDs, so a publish that did reach the queue before
the connection dropped answers ``Duplicate`` on the retry instead of publishing twice.
Needs ``httpx`` (``pip install 'fastapi-workqueue[client]'``).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from .core.envelope import PublishRequest, PublishResult, RequestRejected, canonical_json, uuid7
from .core.errors import WorkQueueError

RETRYABLE_STATUS = {429, 500, 502, 503, 504}


class PublishApiError(WorkQueueError):
    """The API refused a publish (4xx, or 5xx after every retry); nothing of the call was published."""

    def __init__(self, status_code: int, detail: Any, results: list[PublishResult] | None = None) -> None:
        super().__init__(f"publish refused with HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail
        self.results = results or []


class WorkQueueApiPublisher:
    """Publishes through ``POST {base_url}{prefix}/topics/{topic}/messages`` with an API key."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        prefix: str = "/work-queue",
        timeout: float = 10.0,
        retries: int = 5,
        backoff_seconds: float = 0.2,
        client: Any = None,
    ) -> None:
        try:
            import httpx
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ImportError("WorkQueueApiPublisher needs httpx: pip install 'fastapi-workqueue[client]'") from exc
        self._httpx = httpx
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(base_url=base_url, timeout=timeout)
        self._base_url = base_url.rstrip("/") if client is not None else ""
        self._prefix = prefix.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._retries = retries
        self._backoff = backoff_seconds

    async def __aenter__(self) -> WorkQueueApiPublisher:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the HTTP client, unless it was given (``client=``); ``async with`` does it too."""
        if self._owns_client:
            await self._client.aclose()

    @staticmethod
    def with_ids(requests: Sequence[PublishRequest | Mapping[str, Any]]) -> list[PublishRequest]:
        """The requests, each with a MessageID (kept when it has one)."""
        out = []
        for raw in requests:
            request = raw if isinstance(raw, PublishRequest) else PublishRequest.model_validate(raw)
            if request.message_id is None:
                request = request.model_copy(update={"message_id": uuid7()})
            out.append(request)
        return out

    async def publish(
        self, topic: str, requests: Sequence[PublishRequest | Mapping[str, Any]]
    ) -> list[PublishResult]:
        """Publishes in one call (all or nothing); retries with the same MessageIDs when it may.

        Raises :class:`PublishApiError` for a refusal (401, 403, 404, 409, 413, 422) or when
        every retry failed.
        """
        prepared = self.with_ids(requests)
        body = [_body(r) for r in prepared]
        url = f"{self._base_url}{self._prefix}/topics/{topic}/messages"
        last_error: Any = None
        for attempt in range(self._retries + 1):
            try:
                response = await self._client.post(url, json=body, headers=self._headers)
            except self._httpx.TransportError as exc:
                last_error = exc
            else:
                if response.status_code == 200:
                    return [PublishResult.model_validate(item) for item in response.json()]
                if response.status_code not in RETRYABLE_STATUS:
                    raise _refusal(response)
                last_error = _refusal(response)
            if attempt < self._retries:
                await asyncio.sleep(self._backoff * 2**attempt * random.uniform(0.5, 1.0))
        if isinstance(last_error, PublishApiError):
            raise last_error
        raise PublishApiError(0, f"the API could not be reached: {last_error}")


def _body(request: PublishRequest) -> dict[str, Any]:
    """One item of the call's body: the request's fields by their wire names, and its payload as
    ``queue.publish`` stores it (:func:`.core.envelope.canonical_json`: a model by its field names,
    None fields kept; NaN, infinities and what is not JSON refused here, as the API would with 422)."""
    item = request.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"payload"})
    try:
        payload_json, _ = canonical_json(request.payload)
    except RequestRejected as exc:
        raise PublishApiError(422, exc.error.message) from None
    item["Payload"] = json.loads(payload_json)
    return item


def _refusal(response: Any) -> PublishApiError:
    try:
        payload = response.json()
    except ValueError:
        payload = {"detail": response.text}
    detail = payload.get("detail", payload) if isinstance(payload, dict) else payload
    results = payload.get("results") if isinstance(payload, dict) else None
    parsed = [PublishResult.model_validate(r) for r in results] if isinstance(results, list) else None
    return PublishApiError(response.status_code, detail, parsed)
