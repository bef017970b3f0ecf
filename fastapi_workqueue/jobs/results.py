"""A job's stored result: what a job declared ``store_result=True`` returned, kept as JSON.

The store keeps it with the job's message, written in the transaction that completes the job
(:attr:`~fastapi_workqueue.core.transport.Settlement.result_json`) and purged with the job by the
retention. The stored text wraps the value, ``{"value": ...}``, or for an ``encrypted=True`` job
the value encrypted with the app key, ``{"encrypted": "<token>"}``; it is at most
:data:`MAX_RESULT_BYTES` bytes.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from pydantic_core import PydanticSerializationError, to_jsonable_python

from ..core.errors import ConfigurationError
from .encryption import PayloadUndecryptable

if TYPE_CHECKING:
    from .definition import Job
    from .encryption import PayloadCipher

MAX_RESULT_BYTES = 65536
"""The largest stored result (its stored JSON text, in bytes): a result is a summary, an id or a
count; keep larger data in your own storage and return where it is."""


class ResultNotStorable(ValueError):
    """A job declared ``store_result=True`` returned what cannot be stored: not JSON, or too large.
    The attempt fails for good (a dead letter): another run would return the same."""


def encode_result(job: Job, value: Any, cipher: PayloadCipher | None) -> str:
    """The stored text of ``value`` returned by ``job`` (raises :class:`ResultNotStorable`)."""
    try:
        plain = to_jsonable_python(value)
        text = json.dumps({"value": plain}, separators=(",", ":"), allow_nan=False)
    except (PydanticSerializationError, TypeError, ValueError) as exc:
        raise ResultNotStorable(
            f"job {job.name!r} returned {type(value).__name__}, which is not JSON ({exc}); a job declared "
            "store_result=True must return strings, numbers, booleans, lists, dicts, pydantic models or None"
        ) from None
    if job.encrypted:
        if cipher is None:
            raise ConfigurationError(f"job {job.name!r} is encrypted=True but no app key is set: set WORKQUEUE_APP_KEY")
        text = json.dumps({"encrypted": cipher.encrypt(plain)}, separators=(",", ":"))
    size = len(text.encode())
    if size > MAX_RESULT_BYTES:
        raise ResultNotStorable(
            f"job {job.name!r} returned a result of {size} bytes as stored; a stored result holds at most "
            f"{MAX_RESULT_BYTES} bytes: return a summary or an id, and keep the data in storage of your own"
        )
    return text


def decode_result(text: str, cipher: PayloadCipher | None, job_id: uuid.UUID, *, reveal_encrypted: bool = True
                  ) -> Any:
    """The value of a stored result. An encrypted one is decrypted with the app key (None when
    ``reveal_encrypted`` is False: the REST API never shows it)."""
    stored = json.loads(text)
    if not isinstance(stored, dict):
        return stored
    if "encrypted" in stored:
        if not reveal_encrypted:
            return None
        if cipher is None:
            raise ConfigurationError(
                f"the result of job {job_id} is encrypted (the job is encrypted=True): reading it needs the app key, "
                "set WORKQUEUE_APP_KEY"
            )
        try:
            return cipher.decrypt(stored["encrypted"])
        except PayloadUndecryptable:
            raise PayloadUndecryptable(
                f"the result of job {job_id} was encrypted with a key this process does not hold: give it that key "
                "(WORKQUEUE_APP_KEY, or WORKQUEUE_PREVIOUS_KEYS during a rotation)"
            ) from None
    return stored.get("value")
