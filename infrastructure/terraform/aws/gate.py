#!/usr/bin/env python3
"""The destructive-change gate: fails when a Terraform plan deletes or replaces a queue or a topic.

    terraform plan -out=tfplan
    terraform show -json tfplan > plan.json
    python gate.py plan.json            # exit 0: safe to apply; exit 1: destructive; exit 2: bad input

A queue or topic that is deleted (or replaced, i.e. deleted and created again) loses the messages it
holds and the subscriptions bound to it. To apply such a plan on purpose, allow it:
``--allow ADDRESS`` (repeatable, the resource address as the plan prints it), ``--allow-all``, or the
environment variable ``WORKQUEUE_ALLOW_DESTRUCTIVE`` (``1`` for all, or addresses separated by commas).
Runs on the Python standard library alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PROTECTED_TYPES = frozenset({"aws_sns_topic", "aws_sqs_queue", "aws_kms_key"})
"""Resource types whose deletion loses messages (a KMS key's makes the encrypted ones unreadable)."""

ALLOW_ENV = "WORKQUEUE_ALLOW_DESTRUCTIVE"


class PlanError(ValueError):
    """The input is not the JSON of `terraform show -json <planfile>`."""


@dataclass(frozen=True, slots=True)
class DestructiveChange:
    """One protected resource the plan deletes or replaces."""

    address: str
    type: str
    action: str  # "delete" or "replace"
    reason: str | None
    replace_paths: tuple[str, ...]
    allowed: bool

    def describe(self) -> str:
        what = f"{self.address} would be {'deleted' if self.action == 'delete' else 'replaced'}"
        if self.replace_paths:
            what += f" (forced by a change of {', '.join(self.replace_paths)})"
        elif self.reason:
            what += f" ({self.reason})"
        return what


def _path(parts: Sequence[Any]) -> str:
    return ".".join(str(p) for p in parts)


def _action(actions: Sequence[str]) -> str | None:
    if "delete" not in actions:
        return None
    return "replace" if "create" in actions else "delete"


def destructive_changes(plan: Any, allowed: Iterable[str] = (), allow_all: bool = False) -> list[DestructiveChange]:
    """The protected resources ``plan`` (a parsed `terraform show -json`) deletes or replaces."""
    if not isinstance(plan, dict) or "format_version" not in plan:
        raise PlanError("the input is not a plan in JSON: pass the output of `terraform show -json <planfile>`")
    changes = plan.get("resource_changes") or []
    if not isinstance(changes, list):
        raise PlanError(
            "the plan's resource_changes is not a list: pass the output of `terraform show -json <planfile>`"
        )
    allow = set(allowed)
    found: list[DestructiveChange] = []
    for rc in changes:
        if not isinstance(rc, dict) or rc.get("mode", "managed") != "managed":
            continue
        kind = rc.get("type")
        if kind not in PROTECTED_TYPES:
            continue
        change = rc.get("change") or {}
        action = _action(change.get("actions") or [])
        if action is None:
            continue
        address = str(rc.get("address"))
        paths = tuple(_path(p) for p in change.get("replace_paths") or [] if isinstance(p, list))
        found.append(DestructiveChange(
            address=address,
            type=str(kind),
            action=action,
            reason=rc.get("action_reason"),
            replace_paths=paths,
            allowed=allow_all or address in allow,
        ))
    return found


def _allowed_from_env(value: str | None) -> tuple[bool, set[str]]:
    if not value:
        return False, set()
    if value.strip().lower() in {"1", "true", "yes", "all"}:
        return True, set()
    return False, {a.strip() for a in value.split(",") if a.strip()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gate.py", description="Fail when a Terraform plan deletes or replaces a queue, topic or key."
    )
    parser.add_argument("plan", help="the output of `terraform show -json <planfile>` ('-' reads stdin)")
    parser.add_argument("--allow", action="append", default=[], metavar="ADDRESS",
                        help="a resource address that may be deleted or replaced (repeatable)")
    parser.add_argument("--allow-all", action="store_true", help="allow every destructive change")
    args = parser.parse_args(argv)

    try:
        if args.plan == "-":
            text = sys.stdin.read()
        else:
            with open(args.plan, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        print(f"gate: cannot read {args.plan}: {exc.strerror}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        text = "\x00"
    try:
        plan = json.loads(text)
    except json.JSONDecodeError:
        print(f"gate: {args.plan} is not JSON (a binary plan file?): pass the output of "
              "`terraform show -json <planfile>`", file=sys.stderr)
        return 2

    env_all, env_addresses = _allowed_from_env(os.environ.get(ALLOW_ENV))
    try:
        changes = destructive_changes(plan, set(args.allow) | env_addresses, args.allow_all or env_all)
    except PlanError as exc:
        print(f"gate: {exc}", file=sys.stderr)
        return 2

    blocked = [c for c in changes if not c.allowed]
    for c in changes:
        print(f"{'allowed' if c.allowed else 'BLOCKED'}: {c.describe()}")
    if blocked:
        print(
            f"gate: {len(blocked)} destructive change(s) would lose queued messages. Fix the topology, or rerun "
            f"with --allow ADDRESS for each (or {ALLOW_ENV}=1) once you accept the loss.",
            file=sys.stderr,
        )
        return 1
    if changes:
        print("gate: every destructive change is allowed")
    else:
        print("gate: no queue, topic or key is deleted or replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
