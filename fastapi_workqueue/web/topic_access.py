"""Which topics a caller may publish to over REST.

A job queue's topic (``jobs.*``) carries job envelopes that the job runner runs as they are (the
job's name, its payload and any chain of further jobs), so publishing to one needs the scope
``workqueue:jobs`` besides ``workqueue:publish``. A key may also be limited to named topics
(``workqueue api-keys create --topic orders --topic 'billing.*'``); a key without a list reaches
every topic (a job queue's with ``workqueue:jobs`` only).
"""

from __future__ import annotations

from fastapi import HTTPException, status

from ..core.keys import SCOPE_JOBS, Principal
from ..core.topology import JOB_TOPIC_PREFIX, is_job_topic


def require_topic(principal: Principal, topic: str) -> None:
    """Raises 403 saying why ``principal`` may not publish to ``topic``."""
    if is_job_topic(topic) and not principal.has(SCOPE_JOBS):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail=f"topic {topic!r} is a job queue's ({JOB_TOPIC_PREFIX}*): publishing to it needs the scope "
            f"{SCOPE_JOBS}, which this credential lacks; dispatch jobs from the app, or use a key created "
            f"with --scopes workqueue:publish,{SCOPE_JOBS}",
        )
    if not principal.may_reach(topic):
        allowed = ", ".join(principal.topics or ())
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail=f"this credential may not publish to topic {topic!r}; it is limited to: {allowed}",
        )
