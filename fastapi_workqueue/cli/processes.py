"""``workqueue processes``: the processes that run a host on the store, from its process registry."""

from __future__ import annotations

from typing import Any

import click

from .jobs import _with_queue
from .output import emit_json, table


@click.command("processes")
@click.pass_obj
def processes(ctx: Any) -> None:
    """The processes that run a host: state (Running, Stopped, Gone), host, pid, what they run."""

    async def read(queue: Any) -> Any:
        registry = queue.ports.processes
        return [] if registry is None else await registry.list_processes()

    rows = _with_queue(ctx, read)
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, ["hostname", "pid", "state", "started_at", "busy", "slots", "in_flight", "subscriptions",
                     "last_seen_at", "process_id"], empty="(no process has run a host on this store)")
