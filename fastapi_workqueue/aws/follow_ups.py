"""The follow-ups of a completion on an aws subscription: published first, then the message is deleted.

SQS joins no transaction, so the follow-ups and the delete cannot be one write. They are published
first, and the delivery is deleted only once they are stored: with a database, in one committed
transaction (the aws topics' rows go to the outbox, which the relay forwards; a database topic's
messages are published in that same transaction); without one, straight to SNS. A crash between
the publish and the delete brings the message back; its next attempt publishes the same follow-ups
again under the same MessageIDs, because a follow-up whose MessageID the handler did not set gets
one derived from the delivery's MessageID and its position (:func:`follow_up_id`). FIFO topics
deduplicate the repeat within 5 minutes, a database topic answers Duplicate, and handlers absorb it
otherwise (at-least-once, never lost).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.envelope import PreparedMessage, PublishResult, PublishStatus
from ..core.errors import ConfigurationError, TransportError
from ..core.outcomes import FollowUp
from ..core.transport import Transport

if TYPE_CHECKING:
    from .transport import AwsTransport

FOLLOW_UP_NAMESPACE = uuid.UUID("a437cdc5-0ccf-4ac3-917e-8a53f2acb71e")
"""The uuid5 namespace of derived follow-up MessageIDs (fixed: changing it would break deduplication
across a deploy)."""

STORED = (PublishStatus.ACCEPTED, PublishStatus.DUPLICATE)


def follow_up_id(message_id: uuid.UUID, follow_up: int, position: int) -> uuid.UUID:
    """The MessageID of message ``position`` of follow-up ``follow_up`` of the delivery of ``message_id``."""
    return uuid.uuid5(FOLLOW_UP_NAMESPACE, f"{message_id}/{follow_up}/{position}")


def with_derived_ids(message_id: uuid.UUID, follow_ups: Sequence[FollowUp]) -> list[FollowUp]:
    """``follow_ups`` with a derived MessageID on each message whose MessageID the caller did not set."""
    derived: list[FollowUp] = []
    for index, follow_up in enumerate(follow_ups):
        messages = [
            m
            if m.message_id_given
            else dataclasses.replace(m, message_id=follow_up_id(message_id, index, position), message_id_given=True)
            for position, m in enumerate(follow_up.messages)
        ]
        derived.append(FollowUp(follow_up.topic, messages))
    return derived


def _stored(message: PreparedMessage, answer: PublishResult, derived: set[uuid.UUID]) -> bool:
    """Stored now or by an earlier attempt: a derived MessageID a database topic holds with other
    content was published by an earlier attempt of the same delivery, and that one stands."""
    if answer.status in STORED:
        return True
    return answer.status == PublishStatus.MESSAGE_ID_CONFLICT and message.message_id in derived


def _refused(delivery_id: str, topic: str, message: PreparedMessage, answer: PublishResult) -> TransportError:
    error = answer.error
    why = f"{error.code}: {error.message}" if error is not None else answer.status.value
    return TransportError(
        f"follow-up {message.message_id} to topic {topic!r} was refused ({why}); delivery {delivery_id} is not "
        "settled and nothing of its follow-ups is kept",
        retryable=answer.status == PublishStatus.TOPIC_UNBOUND,
    )


async def publish_follow_ups(
    transport: AwsTransport, delivery_id: str, follow_ups: Sequence[FollowUp], derived: set[uuid.UUID]
) -> None:
    """Publishes ``follow_ups`` so that they are stored when this returns (see the module's text).
    A refused message raises :class:`TransportError` and, with a database, nothing is kept."""
    if transport.settings.database_url:
        async with transport.kernel.sessions.sessionmaker() as session, session.begin():
            for follow_up in follow_ups:
                if follow_up.topic in transport._topics:
                    answers = await transport.publish(follow_up.topic, follow_up.messages, session=session)
                else:
                    database = _database(transport, follow_up.topic)
                    answers = await database.publish(follow_up.topic, follow_up.messages, session=session)
                _check(delivery_id, follow_up, answers, derived)
        return
    for follow_up in follow_ups:
        if follow_up.topic not in transport._topics and follow_up.topic in transport.kernel.topics:
            raise ConfigurationError(
                f"follow-up to topic {follow_up.topic!r} from an aws subscription: a database topic needs "
                "a database (set WORKQUEUE_DATABASE_URL), and the topic is not an aws topic"
            )
        # A topic the queue does not declare is refused as any publish refuses it (UnknownTopic).
        answers = await transport.publish(follow_up.topic, follow_up.messages)
        _check(delivery_id, follow_up, answers, derived)


def _check(delivery_id: str, follow_up: FollowUp, answers: Sequence[PublishResult], derived: set[uuid.UUID]) -> None:
    refused = [(m, a) for m, a in zip(follow_up.messages, answers, strict=True) if not _stored(m, a, derived)]
    if refused:
        message, answer = next(
            ((m, a) for m, a in refused if a.error is None or a.error.code != "BatchAborted"), refused[0]
        )
        raise _refused(delivery_id, follow_up.topic, message, answer)


def _database(transport: AwsTransport, topic: str) -> Transport:
    """The queue's database transport, which the follow-up's (non-aws) topic is on."""
    from ..core.routing import RoutingTransport

    router = transport.kernel.transport
    if not isinstance(router, RoutingTransport):
        raise ConfigurationError(
            f"follow-up to topic {topic!r} from an aws subscription: the queue routes no database topics"
        )
    return router.database
