"""Rendering the dashboard's pages: the templates shipped in the package, their filters, and the
headers every answer carries."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from ..core.processes import current_process, package_version
from ..core.words import duration
from .access import Viewer
from .csrf import CSRF_COOKIE, CSRF_FIELD, csrf_token
from .session import SessionCodec, base_path, cookie_options
from .views import waiting_since

if TYPE_CHECKING:
    from ..core.kernel import Kernel
    from ..jobs.layer import Jobs

VERSION = package_version()
"""The installed version of the package, shown in the pages' footer."""

NOTICES = {
    "Replayed": "Replayed: the delivery was queued again with its attempts reset; its status above is current.",
    "Discarded": "Discarded.",
    "CancelRequested": "Cancel requested: the handler is aborted at its next heartbeat, and the delivery "
                       "is Discarded when it returns.",
    "NotDeadLettered": "Nothing changed: the delivery is not dead-lettered (any more).",
    "AlreadyTerminal": "Nothing changed: the delivery is already Completed or Discarded.",
    "NotRunning": "Nothing changed: the delivery is not running (any more), so there is nothing to cancel.",
    "NotFound": "Nothing changed: no such delivery in this subscription.",
    "Paused": "Paused: no more claims; deliveries still accrue, and running handlers finish.",
    "Resumed": "Resumed: claiming again.",
    "Unchanged": "Nothing changed: the subscription was already so.",
    "RetiredNotPaused": "Not paused: the subscription is retired (it takes no new deliveries and drains what it "
                        "holds). Resume it first, or retire it again discarding what is pending.",
    "ReplayedAll": "Dead letters replayed.",
    "ReplayedGroup": "The cause's dead letters were replayed.",
    "DiscardedGroup": "The cause's dead letters were discarded.",
    "ReplayedSelected": "The selected dead letters were replayed.",
    "DiscardedSelected": "The selected dead letters were discarded.",
    "NothingSelected": "Nothing changed: no dead letter was selected.",
    "CauseGone": "Nothing changed: no dead letter has that cause any more.",
    "Unsupported": "Nothing changed: the transport cannot do this (SQS cannot cancel an in-flight message).",
}


def _ago(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "—"
    seconds = ((now or datetime.now(UTC)) - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 90:
        text = f"{seconds:.0f} s"
    elif seconds < 5400:
        text = f"{seconds / 60:.0f} min"
    elif seconds < 172800:
        text = f"{seconds / 3600:.0f} h"
    else:
        text = f"{seconds / 86400:.0f} d"
    return f"in {text}" if future else f"{text} ago"


def _utc(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _utc_short(value: datetime | None, now: datetime | None = None) -> str:
    """The absolute time beside a relative one: the time of day in UTC today, the date too otherwise."""
    if value is None:
        return ""
    moment = value.astimezone(UTC)
    if moment.date() == (now or datetime.now(UTC)).date():
        return moment.strftime("%H:%M:%S UTC")
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def _waited(value: datetime, now: datetime) -> str:
    """``12 min`` (how long since ``value``)."""
    return duration(max((now - value).total_seconds(), 0.0))


def _count(value: int, cap: int) -> str:
    return f"{cap:,}+" if value >= cap else f"{value:,}"


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("fastapi_workqueue.dashboard", "templates"),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(ago=_ago, utc=_utc, utc_short=_utc_short, count=_count, last_line=_last_line, pretty=_pretty,
                       waited=_waited, waiting_since=waiting_since)
    return env


@dataclass
class Dashboard:
    """What the routes share: the queue's kernel and its jobs layer (made when a page first needs
    it), the templates, the session codec and the options."""

    kernel: Kernel
    jobs: Callable[[], Jobs]
    codec: SessionCodec
    own_sign_in: bool
    poll_seconds: float
    title: str

    def __post_init__(self) -> None:
        self.templates = Jinja2Templates(env=environment())

    def render(
        self, request: Request, template: str, context: dict[str, Any], *, viewer: Viewer | None = None,
        status_code: int = 200,
    ) -> HTMLResponse:
        token, new = csrf_token(request)
        notice = request.query_params.get("notice")
        count = request.query_params.get("n", "")
        response = self.templates.TemplateResponse(
            request,
            template,
            {
                "base": base_path(request),
                "title": self.title,
                "version": VERSION,
                "csrf_field": CSRF_FIELD,
                "csrf": token,
                "viewer": viewer,
                "own_sign_in": self.own_sign_in,
                "poll_ms": int(self.poll_seconds * 1000),
                "notice": NOTICES.get(notice or ""),
                "notice_count": count if count.isascii() and count.isdigit() and len(count) < 10 else "",
                "path": request.url.path,
                "here": current_process().id,
                **context,
            },
            status_code=status_code,
        )
        if new:
            response.set_cookie(CSRF_COOKIE, token, samesite="strict", **cookie_options(request, None))
        return response
