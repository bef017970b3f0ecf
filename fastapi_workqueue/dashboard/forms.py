"""Reading the dashboard's forms (``application/x-www-form-urlencoded``, bounded) and their fields."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote

MAX_FORM_BYTES = 64 * 1024
MAX_TEXT = 2000
"""The longest note or reason a form may send."""


class FormRefused(Exception):
    """A form the dashboard cannot read; the message says what is wrong."""


MAX_FIELDS = 250
"""The most fields a form may send (a selection of dead letters sends one per delivery)."""


async def read_form(request: Any) -> dict[str, str]:
    """The first value of each field of a urlencoded form of at most 64 KiB."""
    return {name: values[0] for name, values in (await read_form_values(request)).items()}


async def read_form_values(request: Any) -> dict[str, list[str]]:
    """Every value of each field of a urlencoded form of at most 64 KiB (checkboxes repeat a name)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise FormRefused("send the dashboard's forms as application/x-www-form-urlencoded")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise FormRefused(f"the form is larger than {MAX_FORM_BYTES} bytes")
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False, max_num_fields=MAX_FIELDS)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormRefused(f"the form cannot be read: {exc}") from exc
    return fields


def text_field(form: dict[str, str], name: str) -> str | None:
    """A note or reason: stripped, None when empty; refused when too long or not storable."""
    value = form.get(name, "").strip()
    if not value:
        return None
    if len(value) > MAX_TEXT:
        raise FormRefused(f"the {name} is longer than {MAX_TEXT} characters; shorten it")
    if "\x00" in value:
        raise FormRefused(f"the {name} contains a NUL character; remove it")
    return value


def local_path(value: str | None, base: str, default: str) -> str:
    """``value`` when it is a path of the dashboard (where a form may send the browser back), else
    ``default``: never another site, nor a path that leaves the dashboard once the browser
    normalises it (``..`` or ``.`` segments, percent-encoded or not, backslashes, control characters)."""
    if not value or not value.startswith(base + "/"):
        return default
    path = value.split("?", 1)[0].split("#", 1)[0]
    decoded = unquote(path)
    if "//" in decoded or "\\" in decoded or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value + decoded):
        return default
    if any(segment in (".", "..") for segment in decoded.split("/")):
        return default
    return value
