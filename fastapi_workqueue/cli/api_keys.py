"""``workqueue api-keys``: create, list and revoke the REST API's keys."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click

from ..core.keys import SCOPES, create_key
from .context import Context, parse_duration, pass_context, run
from .output import emit_json, table


@click.group("api-keys")
def api_keys() -> None:
    """Create, list and revoke API keys for the REST API."""


@api_keys.command("create")
@click.option("--name", required=True, help="Who or what uses the key.")
@click.option("--scopes", required=True, help=f"Comma-separated: {', '.join(SCOPES)}.")
@click.option("--expires-in", help="Lifetime: 3600, 90m, 12h, 30d.")
@click.option("--topic", "topics", multiple=True,
              help="A topic the key may publish to, or a pattern with * (billing.*); repeat it for more. "
                   "Without it: every topic (a job queue's, jobs.*, with workqueue:jobs only).")
@pass_context
def api_keys_create(ctx: Context, name: str, scopes: str, expires_in: str | None, topics: tuple[str, ...]) -> None:
    """Create a key; it is shown once."""
    wanted = [s.strip() for s in scopes.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SCOPES]
    if unknown or not wanted:
        raise click.BadParameter(
            f"{'unknown scope(s) ' + ', '.join(map(repr, unknown)) if unknown else 'no scope given'}; use one or "
            f"more of {', '.join(SCOPES)}, comma-separated", param_hint="'--scopes'")
    lifetime = parse_duration(expires_in, option="--expires-in") if expires_in else None
    if lifetime is not None and lifetime <= 0:
        raise click.BadParameter("a key must live longer than 0 seconds (use 3600, 90m, 12h or 30d)",
                                 param_hint="'--expires-in'")
    expires = datetime.now(UTC) + timedelta(seconds=lifetime) if lifetime is not None else None
    allowed = [t.strip() for t in topics] if topics else None
    created = run(ctx, lambda t: create_key(t, name, wanted, expires, allowed))
    if ctx.as_json:
        emit_json(created)
    else:
        click.echo(created.key)
        limited = f", topics {', '.join(created.topics)}" if created.topics is not None else ""
        click.echo(f"(key {created.prefix} for {created.name}, scopes {', '.join(created.scopes)}{limited}; "
                   "store it now, it is not shown again)", err=True)


@api_keys.command("list")
@pass_context
def api_keys_list(ctx: Context) -> None:
    """List keys (never their secrets)."""
    keys = run(ctx, lambda t: t.api_key_list())
    if ctx.as_json:
        emit_json(keys)
    else:
        table(keys, ["prefix", "name", "scopes", "topics", "created_at", "expires_at", "revoked_at", "last_used_at"])


@api_keys.command("revoke")
@click.argument("key")
@pass_context
def api_keys_revoke(ctx: Context, key: str) -> None:
    """Revoke a key by its prefix, id or name."""
    revoked = run(ctx, lambda t: t.api_key_revoke(key))
    if ctx.as_json:
        emit_json({"Revoked": revoked})
    elif revoked:
        click.echo(f"revoked {revoked} key(s)")
    if not revoked:
        raise click.ClickException(f"no active key matches {key!r}")
