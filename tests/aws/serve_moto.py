"""moto_server with SQS's FIFO message group rule kept across concurrent receives (run as a script
by :mod:`tests.aws.moto`; it imports nothing of the project).

moto's ReceiveMessage takes no lock and reads the groups in flight once, when the call starts:
two receives that overlap (the long polls of two processes always do) can each take messages of
one group, and a long poll goes on skipping a group whose messages were deleted while it waits.
SQS never hands a group's messages to a second receive while some are in flight, and the
aws transport's Exclusive order relies on that. Here every ReceiveMessage pass and every call that
changes a message (send, delete, visibility, purge) runs under one lock, and a long poll looks
again every ``POLL_SECONDS`` with the groups in flight read afresh. Messages whose visibility ran
out leave the in-flight set before each pass, so that a group whose messages all timed out
together starts again from its first (moto's loop handed out the last).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from moto.server import main
from moto.sqs.models import SQSBackend

POLL_SECONDS = 0.05
"""How often a waiting long poll looks again (a send wakes it at once)."""

LOCK = threading.RLock()

_receive = SQSBackend.receive_message


def receive_message(self: SQSBackend, queue_name: str, count: int, wait_seconds_timeout: int,
                    visibility_timeout: int, message_attribute_names: list[str] | None = None) -> Any:
    """One pass of moto's own receive at a time, under the lock; a long poll repeats it until a
    message comes or the wait is over."""
    queue = self.get_queue(queue_name)
    end = time.monotonic() + wait_seconds_timeout
    while True:
        with LOCK:
            _release_timed_out(queue)
            found = _receive(self, queue_name, count, 0, visibility_timeout, message_attribute_names)
        left = end - time.monotonic()
        if found or left <= 0:
            return found
        with queue._messages_lock:  # notified by a send
            queue._messages_lock.wait(min(POLL_SECONDS, left))


def _release_timed_out(queue: Any) -> None:
    """Forgets, before a receive, every in-flight message whose visibility ran out. moto's receive
    does so only when its loop reaches each one: of a FIFO group whose messages all timed out
    together, the group stays "in flight" until the loop reaches the last, which then goes out
    first; SQS hands the group's first message out first."""
    for message in [m for m in queue.pending_messages if m.visible]:
        queue.pending_messages.discard(message)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with LOCK:
            return method(*args, **kwargs)

    return call


SQSBackend.receive_message = receive_message  # type: ignore[method-assign]
for _name in ("send_message", "send_message_batch", "delete_message", "delete_message_batch",
              "change_message_visibility", "change_message_visibility_batch", "purge_queue"):
    setattr(SQSBackend, _name, _locked(getattr(SQSBackend, _name)))

if __name__ == "__main__":
    main()
