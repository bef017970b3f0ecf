"""What a publish call answers: one result per request, and a way to turn refusals into an error."""

from __future__ import annotations

from collections.abc import Iterable

from .envelope import PublishResult, PublishStatus
from .errors import PublishFailed

NOT_ACCEPTED_LOGGED = (PublishStatus.REJECTED, PublishStatus.MESSAGE_ID_CONFLICT)
"""Statuses a publish logs at WARNING (with the topic and the error's code)."""


class PublishResults(list[PublishResult]):
    """A list of :class:`PublishResult`, in the order of the requests, that can raise.

    ``await queue.publish(...)`` answers one; ``raise_for_errors()`` raises :class:`PublishFailed`
    when any request was not Accepted or Duplicate (and returns the results otherwise), so a caller
    that has no use for a partial answer need not read each one::

        results = (await queue.publish("orders", [request])).raise_for_errors()
    """

    __slots__ = ()

    def __init__(self, results: Iterable[PublishResult] = ()) -> None:
        super().__init__(results)

    @property
    def ok(self) -> bool:
        """True when every request was Accepted or Duplicate."""
        return all(r.ok for r in self)

    def failures(self) -> list[tuple[int, PublishResult]]:
        """The results that were not Accepted or Duplicate, with their index in the call."""
        return [(i, r) for i, r in enumerate(self) if not r.ok]

    def raise_for_errors(self) -> PublishResults:
        """Raises :class:`PublishFailed` if any request was not Accepted or Duplicate; returns self."""
        failures = self.failures()
        if not failures:
            return self
        shown = "; ".join(_describe(i, r) for i, r in failures[:5])
        more = f" (and {len(failures) - 5} more)" if len(failures) > 5 else ""
        raise PublishFailed(f"{len(failures)} of {len(self)} requests were not published: {shown}{more}",
                            list(failures))


def refusal(result: PublishResult) -> str:
    """What a result that is not Accepted or Duplicate says went wrong."""
    if result.error is not None:
        return result.error.message
    if result.status == PublishStatus.MESSAGE_ID_CONFLICT:
        return f"MessageID {result.message_id} was published before with other content"
    return result.status.value


def _describe(index: int, result: PublishResult) -> str:
    code = f" {result.error.code}" if result.error is not None else ""
    return f"item {index}: {result.status.value}{code}: {refusal(result)}"
