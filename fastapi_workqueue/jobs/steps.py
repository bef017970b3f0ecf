"""Where durable steps (``job.step(name, fn)``) keep their results: the store, or memory in the fake."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from pydantic_core import PydanticSerializationError, to_jsonable_python

from ..core.context import OnceBusy
from ..core.transport import Transport

if TYPE_CHECKING:
    from .context import OnceRunner, StepStore
    from .encryption import PayloadCipher


LOCAL_STEPS: ContextVar[Transport | None] = ContextVar("workqueue_local_steps", default=None)
"""The store of a run in this process (sync mode): the job it runs is stored there, and so are its
steps' results."""


class TransportSteps:
    """Step results in the queue's store, one per job id and step name, purged with the job (in
    the store of a run in this process while one runs: :data:`LOCAL_STEPS`)."""

    def __init__(self, transport: Callable[[], Transport]) -> None:
        self._transport = transport

    def _store(self) -> Transport:
        return LOCAL_STEPS.get() or self._transport()

    async def get(self, job_id: uuid.UUID, name: str) -> tuple[bool, Any]:
        found, value = await self._store().step_get(job_id, name)
        return found, None if value is None else json.loads(value)

    async def put(self, job_id: uuid.UUID, name: str, value: Any) -> Any:
        """Stores ``value`` as JSON and returns it as JSON gives it back."""
        text = step_json(name, value)
        await self._store().step_put(job_id, name, text)
        return json.loads(text)


class MemorySteps:
    """Step results in a dict (the test fake)."""

    def __init__(self) -> None:
        self.results: dict[tuple[uuid.UUID, str], Any] = {}

    async def get(self, job_id: uuid.UUID, name: str) -> tuple[bool, Any]:
        key = (job_id, name)
        return (True, self.results[key]) if key in self.results else (False, None)

    async def put(self, job_id: uuid.UUID, name: str, value: Any) -> Any:
        stored = self.results[(job_id, name)] = json.loads(step_json(name, value))
        return stored


class SealedSteps:
    """The steps of an ``encrypted=True`` job: each result stored encrypted with the app key, as
    its payload and result are (a result stored in the clear before is read as it is)."""

    def __init__(self, inner: StepStore, cipher: PayloadCipher) -> None:
        self._inner = inner
        self._cipher = cipher

    async def get(self, job_id: uuid.UUID, name: str) -> tuple[bool, Any]:
        found, value = await self._inner.get(job_id, name)
        if found and isinstance(value, dict) and value.keys() == {"encrypted"}:
            return True, self._cipher.decrypt(value["encrypted"])
        return found, value

    async def put(self, job_id: uuid.UUID, name: str, value: Any) -> Any:
        plain = json.loads(step_json(name, value))
        await self._inner.put(job_id, name, {"encrypted": self._cipher.encrypt(plain)})
        return plain


OnceProbe = Callable[[str], Awaitable[str]]
"""Where a once key stands, without taking it: ``"Done"``, ``"Busy"`` (an attempt runs its function
now) or ``"Free"``."""


def sealed_once(once: OnceRunner, cipher: PayloadCipher, probe: OnceProbe) -> OnceRunner:
    """``job.once`` of an ``encrypted=True`` job: its key stored as a keyed hash under the app key
    (``hmac-sha256:<hex>``), as a unique key is, so the key is not stored in the clear. After a key
    rotation the marker an earlier attempt wrote is under a previous key's hash: it is looked for
    there first (``probe``), so the function does not run again."""

    async def run(key: str, fn: Callable[[], Any], *, ttl_seconds: float = 86400) -> bool:
        for older in cipher.previous_digests(key):
            state = await probe(f"hmac-sha256:{older}")
            if state == "Done":
                return False
            if state == "Busy":
                raise OnceBusy(key)
        return await once(f"hmac-sha256:{cipher.digest(key)}", fn, ttl_seconds=ttl_seconds)

    return run


def step_json(name: str, value: Any) -> str:
    """A step's result as JSON (pydantic models, dataclasses, dates and UUIDs as pydantic writes them)."""
    try:
        return json.dumps(to_jsonable_python(value), separators=(",", ":"), allow_nan=False)
    except (PydanticSerializationError, TypeError, ValueError) as exc:
        raise TypeError(
            f"step {name!r} returned {type(value).__name__}, which is not JSON ({exc}); a step's result is "
            "stored as JSON: return strings, numbers, booleans, lists, dicts, pydantic models or None"
        ) from None
