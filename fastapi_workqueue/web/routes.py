"""The REST API: publish for producers outside the app, and the operator endpoints.

``app.include_router(queue.router)`` mounts it under ``/work-queue``. Every route names the scope
it needs; see :mod:`fastapi_workqueue.web.auth` for how callers are checked.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures, whose
# annotations name aliases local to build_router.

import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Body, HTTPException, Path, Query, Request, Response, Security, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.attempts import AttemptInfo
from ..core.envelope import PublishRequest, PublishResult
from ..core.errors import (
    ActionRefused,
    ConfigurationError,
    TransportCannot,
    TransportError,
    TransportUnavailable,
    UnknownTopic,
)
from ..core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_PUBLISH, SCOPE_READ, Principal
from ..core.operator import MAX_NOTE_LENGTH
from ..core.processes import ProcessInfo
from ..core.reports import (
    ActionResult,
    Backlog,
    BindingReport,
    DeliveryInfo,
    DeliveryStatus,
    PartitionCondition,
    PartitionInfo,
    SubscriptionStats,
)
from ..core.retirement import DeleteResult, RetireResult, TopicStatusChange
from ..core.search import SEARCH_LIMIT, FoundDelivery
from ..core.topology import is_name
from ..core.wire import WireModel
from .auth import Authorizer
from .fastapi_internals import scopes_of, set_request_body
from .limits import DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY_BYTES
from .operator_view import found_deliveries, kept_attempts, shown, shown_all
from .topic_access import require_topic

if TYPE_CHECKING:
    from ..core.kernel import Kernel

T = TypeVar("T")


_CURSOR = r"^([0-9]+|aws:[A-Za-z0-9_.:\-]{1,400})$"
"""A paging cursor: a delivery id as the listings write it (digits; ``aws:...`` on an aws subscription)."""



def _storable_text(value: str | None) -> str | None:
    """Text the stores can keep: no NUL character, valid Unicode (no lone surrogate), at most
    :data:`MAX_NOTE_LENGTH` characters."""
    if value is None:
        return value
    if "\x00" in value:
        raise ValueError("contains a NUL character; remove it")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode ({exc.reason}); send UTF-8 text") from exc
    if len(value) > MAX_NOTE_LENGTH:
        raise ValueError(f"is {len(value)} characters; at most {MAX_NOTE_LENGTH} are allowed")
    return value


class ReplayBody(WireModel):
    """What the operator says about a replay (kept on the delivery)."""

    note: str | None = None

    _note = field_validator("note")(_storable_text)


class DiscardBody(WireModel):
    """Why the operator drops the delivery (kept on it)."""

    reason: str | None = None

    _reason = field_validator("reason")(_storable_text)


class RetireBody(WireModel):
    discard_pending: bool = False
    """Discard the Pending deliveries at once instead of letting them drain."""
    reason: str | None = None
    """Kept with each discarded delivery (at most 2,000 characters)."""
    _reason = field_validator("reason")(_storable_text)


class StatusChange(WireModel):
    subscription: str
    status: Literal["Active", "Paused"]
    changed: bool


class PublishProblem(WireModel):
    """One refused item: its index in the array, the field, and what to change."""

    index: int
    code: str
    message: str
    field: str | None = None


class PublishRefused(WireModel):
    """422/409 answer: nothing of the call was published. ``detail`` as in FastAPI's own errors."""

    detail: list[PublishProblem] = Field(alias="detail")
    results: list[PublishResult] = Field(alias="results")


class RequestProblem(BaseModel):
    """One error of a body that is not an array of publish requests, as FastAPI words it."""

    model_config = ConfigDict(extra="allow")

    loc: list[str | int]
    msg: str
    type: str


class RequestInvalid(BaseModel):
    """422 answer to a body that does not validate (FastAPI's own shape): nothing was published."""

    detail: list[RequestProblem]


def _renderable(exc: RequestValidationError) -> RequestValidationError:
    """``exc``, or the same errors without the inputs when an input cannot be sent back as JSON.

    FastAPI's 422 echoes each offending input; a JSON string with a lone surrogate escape
    (``"\\ud800"``) parses into a str that UTF-8 cannot encode, and ``NaN`` or ``Infinity`` (which
    Python's parser reads) into a float that strict JSON cannot write: either 422 would fail as a 500.
    """
    try:
        json.dumps(jsonable_encoder(exc.errors()), ensure_ascii=False, allow_nan=False).encode()
        return exc
    except ValueError:  # UnicodeEncodeError is one; so is "Out of range float values"
        pass
    except (RecursionError, TypeError):
        return exc

    def printable(value: Any) -> Any:
        return value.encode("utf-8", "backslashreplace").decode() if isinstance(value, str) else value

    errors = [
        {"type": e.get("type"), "loc": [printable(part) for part in e.get("loc", ())], "msg": printable(e.get("msg"))}
        for e in exc.errors()
    ]
    return RequestValidationError(errors)


class _BoundedBodyRoute(APIRoute):
    """Refuses a body over ``max_body_bytes`` with 413 before anything parses it."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        limit = self.max_body_bytes

        async def bounded(request: Request) -> Response:
            declared = request.headers.get("content-length")
            advice = ("publish in smaller calls" if request.url.path.endswith("/messages")
                      else "send a shorter note or reason")
            too_large = JSONResponse(
                status_code=status.HTTP_413_CONTENT_TOO_LARGE,
                content={"detail": f"the body is larger than {limit} bytes; {advice}"},
            )
            if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
                return too_large
            if request.method in ("POST", "PUT", "PATCH"):
                chunks: list[bytes] = []
                size = 0
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        return too_large
                    chunks.append(chunk)
                set_request_body(request, b"".join(chunks))
            try:
                return await handler(request)
            except RequestValidationError as exc:
                raise _renderable(exc) from None
            except StarletteHTTPException as exc:  # what FastAPI raises when it cannot parse the body
                if exc.status_code == status.HTTP_400_BAD_REQUEST and isinstance(exc.__cause__, RecursionError):
                    raise HTTPException(
                        status.HTTP_400_BAD_REQUEST,
                        detail="the JSON body is nested too deeply to parse; send flatter JSON "
                        "(a few hundred levels are fine)",
                    ) from exc
                cause = exc.__cause__
                if (exc.status_code == status.HTTP_400_BAD_REQUEST and isinstance(cause, ValueError)
                        and "integer string conversion" in str(cause)):  # (Python's int_max_str_digits)
                    raise HTTPException(
                        status.HTTP_400_BAD_REQUEST,
                        detail="the JSON body holds an integer of more than 4,300 digits, which cannot be read; "
                        "send it as a string",
                    ) from exc
                if exc.status_code == status.HTTP_400_BAD_REQUEST and isinstance(cause, UnicodeDecodeError):
                    bad = cause
                    raise HTTPException(
                        status.HTTP_400_BAD_REQUEST,
                        detail=f"the body is not UTF-8 (byte 0x{bad.object[bad.start]:02x} at offset {bad.start} "
                        "cannot be read); send the JSON encoded as UTF-8",
                    ) from exc
                raise

        return bounded


def build_router(
    kernel: "Kernel",
    authorize: Authorizer,
    *,
    prefix: str = "/work-queue",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> APIRouter:
    """The publish and operator routes of the queue of ``kernel``, checked by ``authorize``."""

    class Route(_BoundedBodyRoute):
        pass

    Route.max_body_bytes = max_body_bytes
    router = APIRouter(prefix=prefix, tags=["work queue"], route_class=Route)

    def caller(scope: str) -> Any:
        return Security(authorize, scopes=[scope])

    Publisher = Annotated[Principal, caller(SCOPE_PUBLISH)]
    Reader = Annotated[Principal, caller(SCOPE_READ)]
    Operator = Annotated[Principal, caller(SCOPE_OPERATE)]
    Admin = Annotated[Principal, caller(SCOPE_ADMIN)]
    Sub = Annotated[str, Path(description="The subscription's name.")]

    def name_exists_or_404(kind: str, name: str) -> None:
        # A name no topic or subscription can have is not sent to the store (where a NUL byte, say,
        # is an encoding error rather than "no such row").
        if not is_name(name):
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"{kind} {name!r} does not exist")

    async def known_subscription(name: str) -> None:
        name_exists_or_404("subscription", name)
        try:
            names = {s.name for s in await kernel.transport.list_subscriptions()}
        except TransportError as exc:
            raise _unavailable(exc) from exc
        if name not in names:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"subscription {name!r} does not exist")

    @router.post(
        "/topics/{topic}/messages",
        response_model=list[PublishResult],
        summary="Publish messages",
        responses={
            403: {"description": "The credential lacks `workqueue:publish`; or the topic is a job queue's "
                  "(`jobs.*`) and it lacks `workqueue:jobs`; or the key is limited to other topics."},
            404: {"description": "The topic does not exist."},
            409: {"model": PublishRefused, "description": "A MessageID was reused for other content."},
            413: {"description": "The body or the batch is too large."},
            422: {"model": PublishRefused | RequestInvalid,
                  "description": "An item is invalid (PublishRefused), or the body is not an array of publish "
                                 "requests (FastAPI's validation errors); nothing was published."},
            503: {"description": "The store is unavailable; retry with the same MessageIDs."},
        },
    )
    async def publish(
        topic: Annotated[str, Path(description="The topic to publish to.")],
        requests: Annotated[list[PublishRequest], Body(description="Messages, published in array order.")],
        principal: Publisher,
        response: Response,
    ) -> Any:
        """Publishes an array of messages in one transaction: all of them or none.

        One result per message, in order: Accepted, Duplicate (same MessageID and content, or a
        live DeduplicationKey) with the stored MessageID. PascalCase and snake_case are accepted.
        A job queue's topic (`jobs.*`) also needs `workqueue:jobs`, and a key limited to topics
        reaches only those.
        """
        require_topic(principal, topic)
        name_exists_or_404("topic", topic)
        if len(requests) > max_batch:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE,
                detail=f"{len(requests)} messages in one call; at most {max_batch} are accepted",
            )
        try:
            results = await kernel.publish(topic, requests)
        except UnknownTopic as exc:  # (its text says why: not declared, not in this store, or not synced)
            why = str(exc).split(": ", 1)[-1]
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"topic {topic!r} does not exist ({why})") from None
        except TransportError as exc:
            raise _unavailable(exc) from exc
        problems = [
            PublishProblem(index=i, code=r.error.code, message=r.error.message, field=r.error.field)
            for i, r in enumerate(results)
            if r.error is not None and r.error.code != "BatchAborted"
        ]
        if problems:
            conflict = all(p.code == "MessageIDConflict" for p in problems)
            code = status.HTTP_409_CONFLICT if conflict else status.HTTP_422_UNPROCESSABLE_CONTENT
            body = PublishRefused(detail=problems, results=results)
            return JSONResponse(status_code=code, content=body.model_dump(mode="json", by_alias=True))
        return results

    @router.get("/stats", response_model=list[SubscriptionStats], summary="Delivery counts by state",
                responses={404: {"description": "No subscription has this name."}})
    async def stats(
        principal: Reader, subscription: Annotated[str | None, Query(description="One subscription.")] = None
    ) -> list[SubscriptionStats]:
        """Pending, claimable, InFlight, DeadLettered, Completed and Discarded per subscription."""
        if subscription is not None:
            await known_subscription(subscription)
        return await _call(kernel.operator.stats(subscription))

    @router.get("/processes", response_model=list[ProcessInfo], summary="The processes that run a host")
    async def processes(principal: Reader) -> list[ProcessInfo]:
        """Each process that runs a host on this store (an app or ``workqueue work``): host, pid,
        start, version, what it runs, busy slots, what it holds InFlight and its state (Running,
        Stopped, or Gone once it missed three beats); live ones first. Empty when the store keeps
        no process registry."""
        registry = kernel.ports.processes
        return [] if registry is None else await _call(registry.list_processes())

    @router.get("/subscriptions/{subscription}/backlog", response_model=Backlog, summary="Backlog for autoscalers")
    async def backlog(subscription: Sub, principal: Reader) -> Backlog:
        """Claimable Pending (single flight per key applied) plus InFlight: exact."""
        await known_subscription(subscription)
        result = await _call(kernel.operator.backlog(subscription))
        if result is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"subscription {subscription!r} does not exist")
        return result

    @router.get(
        "/subscriptions/{subscription}/dead-letters", response_model=list[DeliveryInfo], summary="Dead letters"
    )
    async def dead_letters(
        subscription: Sub,
        principal: Reader,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        after: Annotated[str | None, Query(description="Page after this delivery id (the last of the page before).",
                                              pattern=_CURSOR)] = None,
    ) -> list[DeliveryInfo]:
        """Dead-lettered deliveries, oldest first, with reason and last error (payloads for admins)."""
        await known_subscription(subscription)
        return shown_all(await _call(kernel.operator.dead_letters(
            subscription, limit=limit, after=after, include_payload=principal.has(SCOPE_ADMIN)
        )))

    @router.get(
        "/subscriptions/{subscription}/deliveries", response_model=list[DeliveryInfo], summary="Deliveries by state"
    )
    async def deliveries(
        subscription: Sub,
        principal: Reader,
        status_: Annotated[DeliveryStatus, Query(alias="status")] = "InFlight",
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        after: Annotated[str | None, Query(description="Page after this delivery id (the last of the page before).",
                                              pattern=_CURSOR)] = None,
    ) -> list[DeliveryInfo]:
        """Deliveries of one state, oldest first (payloads for admins)."""
        await known_subscription(subscription)
        return shown_all(await _call(kernel.operator.deliveries(
            subscription, status_, limit=limit, after=after, include_payload=principal.has(SCOPE_ADMIN)
        )))

    @router.get(
        "/subscriptions/{subscription}/deliveries/{delivery_id}", response_model=DeliveryInfo, summary="One delivery"
    )
    async def delivery(subscription: Sub, delivery_id: str, principal: Reader) -> DeliveryInfo:
        """A delivery with its state, attempts, progress, reason and last error (payload for admins)."""
        info = await _call(kernel.operator.get_delivery(delivery_id, include_payload=principal.has(SCOPE_ADMIN)))
        if info is None or info.subscription != subscription:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, detail=f"delivery {delivery_id!r} of {subscription!r} not found"
            )
        return shown(info)

    @router.get(
        "/deliveries/{delivery_id}",
        response_model=DeliveryInfo,
        summary="One delivery, by its id alone",
        responses={404: {"description": "No delivery has this id."}},
    )
    async def delivery_by_id(
        delivery_id: Annotated[str, Path(description="The delivery's id, as the listings show it.")],
        principal: Reader,
    ) -> DeliveryInfo:
        """A delivery whole: subscription, topic, state, attempts, lease, progress, reason, last error,
        timestamps and attributes (the payload for admins)."""
        info = await _call(kernel.operator.get_delivery(delivery_id, include_payload=principal.has(SCOPE_ADMIN)))
        if info is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"delivery {delivery_id!r} does not exist")
        return shown(info)

    @router.get(
        "/deliveries/{delivery_id}/attempts",
        response_model=list[AttemptInfo],
        summary="A delivery's kept attempts",
        responses={404: {"description": "No delivery has this id."},
                   501: {"description": "The transport keeps no attempt history (aws)."}},
    )
    async def delivery_attempts(
        delivery_id: Annotated[str, Path(description="The delivery's id, as the listings show it.")],
        principal: Reader,
    ) -> list[AttemptInfo]:
        """The attempts of a delivery that did not simply complete, oldest first: each one's start,
        end, outcome (Failed, DeadLettered, Discarded, LeaseExpired, Replayed), reason, error and
        holder. A delivery that completed on its first try has none."""
        if await _call(kernel.operator.get_delivery(delivery_id)) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"delivery {delivery_id!r} does not exist")
        attempts = await _call(kept_attempts(kernel.ports, delivery_id))
        if attempts is None:
            raise HTTPException(status.HTTP_501_NOT_IMPLEMENTED,
                                detail=f"the transport of delivery {delivery_id!r} keeps no attempt history")
        return attempts

    @router.get(
        "/search",
        response_model=list[FoundDelivery],
        summary="Find deliveries",
        responses={501: {"description": "The transport cannot search (aws)."}},
    )
    async def search(
        principal: Reader,
        q: Annotated[str, Query(min_length=1, max_length=512,
                                description="A delivery id, MessageID, partition key, correlation ID or job name.")],
        limit: Annotated[int, Query(ge=1, le=SEARCH_LIMIT)] = 25,
    ) -> list[FoundDelivery]:
        """The deliveries whose id, MessageID, partition key, correlation ID or job name is ``q``
        (exactly), newest first, each with what matched (payloads left out)."""
        found = await _call(found_deliveries(kernel.ports, q, limit))
        if found is None:
            raise HTTPException(status.HTTP_501_NOT_IMPLEMENTED, detail="this queue's transport cannot search")
        return found

    @router.get(
        "/subscriptions/{subscription}/partitions", response_model=list[PartitionInfo], summary="Keys and their state"
    )
    async def partitions(
        subscription: Sub,
        principal: Reader,
        condition: Annotated[PartitionCondition | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[PartitionInfo]:
        """Keys of an Exclusive or Ordered subscription: Blocked, InFlight or Idle, with head and waiting count."""
        await known_subscription(subscription)
        return await _call(kernel.operator.partitions(subscription, condition, limit=limit))

    @router.get("/validate-bindings", response_model=BindingReport, summary="Check the queue's bindings")
    async def validate_bindings(principal: Reader) -> BindingReport:
        """Schema version, transport capabilities and what they leave out."""
        return await _call(kernel.operator.validate_bindings())

    @router.post(
        "/subscriptions/{subscription}/deliveries/{delivery_id}/replay",
        response_model=ActionResult,
        summary="Replay a dead letter",
        responses={409: {"model": ActionResult, "description": "The delivery is not DeadLettered; nothing changed."}},
    )
    async def replay(
        subscription: Sub, delivery_id: str, principal: Operator, body: ReplayBody | None = None
    ) -> Any:
        """DeadLettered → Pending, same MessageID and Ordered position, attempts reset, note kept."""
        name_exists_or_404("subscription", subscription)
        result = await _call(kernel.operator.replay(subscription, delivery_id, body.note if body else None))
        if result.result == "NotFound":
            await known_subscription(subscription)  # (a 404 that names the subscription when it is the one missing)
        return _action_response(result)

    @router.post(
        "/subscriptions/{subscription}/deliveries/{delivery_id}/discard",
        response_model=ActionResult,
        summary="Discard a delivery, or cancel it while it runs",
        responses={409: {"model": ActionResult, "description": "The delivery is already terminal; nothing changed."}},
    )
    async def discard(
        subscription: Sub, delivery_id: str, principal: Operator, body: DiscardBody | None = None
    ) -> Any:
        """Pending/DeadLettered → Discarded. InFlight → cancel requested (CancelRequested): the handler
        is aborted with Cancelled and the delivery becomes Discarded when it returns."""
        name_exists_or_404("subscription", subscription)
        result = await _call(kernel.operator.discard(subscription, delivery_id, body.reason if body else None))
        if result.result == "NotFound":
            await known_subscription(subscription)  # (a 404 that names the subscription when it is the one missing)
        return _action_response(result)

    @router.post("/subscriptions/{subscription}/pause", response_model=StatusChange, summary="Pause a subscription",
                 responses={409: {"description": "The subscription is retired: a pause is refused (it would show "
                                                 "Paused while it takes no deliveries)."}})
    async def pause(subscription: Sub, principal: Operator) -> StatusChange:
        """Stops claiming; deliveries still accrue."""
        return await _status(subscription, "Paused")

    @router.post("/subscriptions/{subscription}/resume", response_model=StatusChange, summary="Resume a subscription")
    async def resume(subscription: Sub, principal: Operator) -> StatusChange:
        """Claims again."""
        return await _status(subscription, "Active")

    @router.post(
        "/subscriptions/{subscription}/retire", response_model=RetireResult, summary="Retire a subscription",
    )
    async def retire(subscription: Sub, principal: Operator, body: RetireBody | None = None) -> RetireResult:
        """Stops the fan-out to a subscription removed from the code: new messages give it no
        delivery; what it holds drains, or with ``DiscardPending`` its Pending deliveries are
        discarded with ``Reason``. Its counts stay readable; resume takes it back."""
        await known_subscription(subscription)
        options = body or RetireBody()
        return await _call(kernel.operator.retire(subscription, discard_pending=options.discard_pending,
                                                  reason=options.reason))

    @router.delete(
        "/subscriptions/{subscription}", response_model=DeleteResult, summary="Delete a retired subscription",
        responses={409: {"model": DeleteResult, "description": "Not retired, or it still holds deliveries."}},
    )
    async def delete_subscription(subscription: Sub, principal: Admin) -> Any:
        """Deletes a retired subscription once nothing is Pending, InFlight or DeadLettered; 409
        with ``Result`` (NotRetired, HasDeliveries) and ``Remaining`` otherwise."""
        name_exists_or_404("subscription", subscription)
        return _deleted(await _call(kernel.operator.delete_subscription(subscription)))

    @router.post("/topics/{topic}/retire", response_model=TopicStatusChange, summary="Retire a topic")
    async def retire_topic(topic: Annotated[str, Path(description="The topic's name.")],
                           principal: Operator) -> TopicStatusChange:
        """A retired topic refuses new messages (TopicRetired); its subscriptions drain."""
        name_exists_or_404("topic", topic)
        if topic not in {t.name for t in await _call(kernel.transport.list_topics())}:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"topic {topic!r} does not exist")
        return await _call(kernel.operator.set_topic_status(topic, "Retired"))

    def _deleted(result: DeleteResult) -> Any:
        if result.result == "NotFound":
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"{result.name!r} does not exist")
        if not result.ok:
            return JSONResponse(status_code=status.HTTP_409_CONFLICT,
                                content=result.model_dump(mode="json", by_alias=True))
        return result

    async def _status(subscription: str, new: Literal["Active", "Paused"]) -> StatusChange:
        name_exists_or_404("subscription", subscription)
        try:
            changed = await _call(kernel.operator.set_status(subscription, new))
        except ActionRefused as exc:  # (a pause of a retired subscription)
            raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
        if changed is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"subscription {subscription!r} does not exist")
        return StatusChange(subscription=subscription, status=new, changed=changed)

    document_errors(router)
    return router


def document_errors(router: APIRouter) -> None:
    """Adds to every route's OpenAPI entry the answers it can give besides its own: 401 and 403
    with the scope it needs (also in ``x-required-scopes``), 404 for an unknown subscription, 503
    while the store is away."""
    for route in router.routes:
        if not isinstance(route, APIRoute):
            continue
        scopes = scopes_of(route.dependant)
        if scopes:
            needed = ", ".join(f"`{s}`" for s in scopes)
            route.responses.setdefault(401, {"description": "No API key, or one that is unknown, expired or revoked."})
            route.responses.setdefault(403, {"description": f"The credential lacks the scope {needed}."})
            route.description = f"{route.description}\n\nRequires the scope {needed}.".strip()
            route.openapi_extra = {**(route.openapi_extra or {}), "x-required-scopes": scopes}
        if "{subscription}" in route.path:
            route.responses.setdefault(404, {"description": "The subscription (or delivery) does not exist."})
        elif "{topic}" in route.path:
            route.responses.setdefault(404, {"description": "The topic does not exist."})
        if route.body_field is not None:  # (the route class reads the body first, whoever sends it)
            route.responses.setdefault(400, {"description": "The body cannot be read: not UTF-8, nested too deeply, "
                                                            "or an integer of more than 4,300 digits."})
            route.responses.setdefault(413, {"description": "The body is larger than the REST API reads."})
        route.responses.setdefault(503, {"description": "The store is unavailable; retry (see Retry-After)."})


def _action_response(result: ActionResult) -> Any:
    if result.result == "NotFound":
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            detail=f"delivery {result.delivery_id!r} of subscription {result.subscription!r} not found",
        )
    if not result.ok:
        return JSONResponse(status_code=status.HTTP_409_CONFLICT, content=result.model_dump(mode="json", by_alias=True))
    return result


async def _call(awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except ConfigurationError as exc:
        raise cannot_serve(exc) from exc
    except TransportError as exc:
        raise _unavailable(exc) from exc


def cannot_serve(exc: ConfigurationError) -> HTTPException:
    """503 saying why this app cannot do what an authenticated caller asked: its database role
    lacks a privilege (the message names the role script), or the schema is out of date."""
    return HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail=f"this app cannot do that now: {exc}")


def _unavailable(exc: TransportError) -> HTTPException:
    if isinstance(exc, TransportCannot):
        return HTTPException(status.HTTP_501_NOT_IMPLEMENTED, detail=str(exc))
    if isinstance(exc, TransportUnavailable) or exc.retryable:
        return HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, detail=f"the queue's store is unavailable: {exc}",
            headers={"Retry-After": "1"},
        )
    return HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, detail=str(exc))

