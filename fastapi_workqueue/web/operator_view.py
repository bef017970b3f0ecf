"""What operators are shown of a delivery, over REST, in the CLI and on the dashboard: error text
without secrets.

``reason`` and ``last_error`` hold what handlers raised, and drivers and HTTP clients like to put
credentials into their messages; :func:`~fastapi_workqueue.core.redaction.redact` takes them out
before anyone with ``workqueue:read`` sees them. The stored text is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.attempts import AttemptInfo
from ..core.ports import Ports
from ..core.redaction import redact
from ..core.reports import DeliveryInfo
from ..core.search import FoundDelivery


def shown(info: DeliveryInfo) -> DeliveryInfo:
    """``info`` with its reason and last error redacted."""
    return info.model_copy(update={
        "reason": redact(info.reason) if info.reason else info.reason,
        "last_error": redact(info.last_error) if info.last_error else info.last_error,
    })


def shown_all(infos: Iterable[DeliveryInfo]) -> list[DeliveryInfo]:
    """:func:`shown` for each."""
    return [shown(info) for info in infos]


def shown_attempts(attempts: Iterable[AttemptInfo]) -> list[AttemptInfo]:
    """Kept attempts with their reasons and errors redacted."""
    return [a.model_copy(update={"reason": redact(a.reason) if a.reason else a.reason,
                                 "error": redact(a.error) if a.error else a.error})
            for a in attempts]


def shown_found(found: Iterable[FoundDelivery]) -> list[FoundDelivery]:
    """Search results with each delivery :func:`shown`."""
    return [f.model_copy(update={"delivery": shown(f.delivery)}) for f in found]


async def kept_attempts(ports: Ports, delivery_id: str) -> list[AttemptInfo] | None:
    """The kept attempts of a delivery, oldest first, redacted; None where the transport that holds
    it keeps none (an aws delivery behind the router). Empty for an unknown delivery."""
    reader = ports.ports_for_delivery(delivery_id).attempts
    return None if reader is None else shown_attempts(await reader.delivery_attempts(delivery_id))


async def found_deliveries(ports: Ports, query: str, limit: int) -> list[FoundDelivery] | None:
    """The newest deliveries that match ``query`` exactly, redacted; None where no store searches."""
    searcher = ports.search
    return None if searcher is None else shown_found(await searcher.search_deliveries(query, limit=limit))
