"""The host: plans which subscriptions this process runs, re-plans, sweeps, and reports health."""

from __future__ import annotations

import asyncio
import fnmatch
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from .budget import DeliveryBudget
from .handlers import Invoker
from .observe import NO_OBSERVER, Observer
from .ports import Ports
from .processes import ProcessBeat, current_process
from .redaction import redacting_logger
from .request_load import RequestLoad
from .runtime import Consumer, Resolver, Settler
from .stalls import stall_causes, stall_reason
from .tasks import TaskScope
from .topology import SubscriptionState, is_job_topic
from .transport import Transport
from .wire import WireModel
from .words import count

if TYPE_CHECKING:
    from .reports import TakenBack

log = redacting_logger("fastapi_workqueue.host")

HealthState = Literal["Running", "Paused", "HandlerNotRegistered", "Undeclared", "Retired", "Unsupported", "Error"]
WAKE_ALL = "*"

STOP_SETTLE_GRACE_SECONDS = 2.0
"""How long past its drains a stop waits for the store (its last settles, the process registry)."""


class SubscriptionPlan(WireModel):
    """Which subscriptions a process runs: ``name`` (or ``"*"`` for all) and how many at once."""

    name: str = "*"
    concurrency: int = Field(default=4, ge=1)


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One consumer for several subscriptions sharing ``concurrency`` slots (a job worker's queues).

    ``patterns`` are taken in strict order: the consumer claims from the second only while the
    first has nothing claimable. A pattern is a subscription's name, or a glob (``jobs.*``) that
    stands for every subscription it matches that an earlier pattern did not, taken fairly (the
    oldest due delivery first). Subscriptions a group serves get no consumer of their own.
    """

    name: str
    patterns: tuple[str, ...]
    concurrency: int = 4
    leaves: Callable[[str], str | None] | None = None
    """For a subscription a glob pattern matches: why this process leaves it (the jobs layer:
    another app's job queue), or None to take it. A subscription a pattern names is always taken."""


STORE_FAILED_REASON = (
    "the queue's store is unavailable or refused a call; the details are in this process's log"
)
"""What ``GET /health/extensions`` (which answers anyone) says in place of a driver's error."""


class SubscriptionHealth(WireModel):
    """The state of one planned subscription in this process. ``reason_is_detail``: the reason is
    an error's own text (the driver's, with hosts and database names), shown to the process and
    to signed-in readers only."""

    subscription: str
    state: HealthState
    reason: str | None = None
    concurrency: int = 0
    active: int = 0
    reason_is_detail: bool = Field(default=False, exclude=True)

    def public(self) -> SubscriptionHealth:
        """This entry as an anonymous caller may see it: an error's own text replaced."""
        if not self.reason_is_detail:
            return self
        return self.model_copy(update={"reason": STORE_FAILED_REASON, "reason_is_detail": False})


@dataclass(frozen=True, slots=True)
class HostOptions:
    """Timings of the host (milliseconds, as in the settings)."""

    idle_poll_min_ms: int = 250
    idle_poll_max_ms: int = 5000
    wake_backoff_ms: int = 100
    shutdown_drain_ms: int = 8000
    sweeper_enabled: bool = True
    sweeper_interval_ms: int = 60000
    reconcile_interval_ms: int = 30000
    sweep_batch: int = 1000
    stalled_store_call_ms: int = 30000
    """A claim or a settle that has waited this long for the store is logged and puts the
    subscriptions it holds up in Error (:mod:`.stalls`); 0 turns the look off."""
    principal: str | None = None
    observer: Observer = NO_OBSERVER
    """Sees publishes, attempts and settles (traces and metrics)."""
    request_load: RequestLoad | None = None
    """The requests this process serves, which its consumers yield to (:mod:`.request_load`)."""
    on_taken_back: Callable[[Sequence[TakenBack]], None] | None = None
    """Hears the leases each sweeper pass took back (must not raise)."""


RETRY_KEEPS_KEY_BUSY = (
    "on the {name} transport a retrying Exclusive message keeps its key busy until its retry delay "
    "has passed (an SQS FIFO message group waits for its head), unlike the database transport"
)


def unsupported_reason(ports: Ports, sub: SubscriptionState) -> str | None:
    """Why the transport that serves ``sub`` cannot run it here, or None when it can."""
    transport = ports.for_subscription(sub.name)
    caps = transport.capabilities
    if sub.partition_mode == "Ordered" and not caps.ordered:
        return f"Ordered needs a database topic; the {transport.name} transport cannot keep order per key"
    if sub.partition_mode == "Exclusive" and not caps.exclusive:
        return f"Exclusive is not available on the {transport.name} transport"
    if sub.partition_mode == "Exclusive" and caps.exclusive_needs_fifo and not sub.is_fifo:
        return (f"Exclusive on the {transport.name} transport needs a FIFO topic: declare topic {sub.topic!r} with "
                "is_fifo=True (a standard queue runs one key's messages at once)")
    limits = {k: v for k, v in sub.flow_limits().items()
              if not (k == "key_concurrency" and sub.partition_mode != "None")}  # (1 on a keyed mode: the mode)
    counted = [f"{k}={limits[k]!r}" for k in ("max_in_flight", "key_concurrency") if k in limits]
    if counted and not caps.concurrency_limits:
        return (f"{' and '.join(counted)} needs a database topic: the {transport.name} transport cannot count the "
                "deliveries in flight across processes; remove the limit or keep the topic on 'database'")
    metered = [f"{k}={limits[k]!r}" for k in ("rate_limit", "key_rate_limit") if k in limits]
    if metered and not caps.rate_limits:
        return (f"{' and '.join(metered)} needs a database topic: the {transport.name} transport cannot meter "
                "claims across processes; remove the limit or keep the topic on 'database'")
    return None


_TAKEN_BACK = {
    "Pending": "it will be retried",
    "DeadLettered": "dead-lettered: that was its final attempt",
    "Discarded": "discarded: its cancel was requested",
}

TAKEN_BACK_LOGGED = 20
"""The leases a sweeper pass logs one by one; the rest of a pass (a crashed worker that held
hundreds) is one line of counts by subscription."""


class Host:
    """Runs the planned subscriptions of one process, with the sweeper and the reconcile loop."""

    def __init__(
        self,
        transport: Transport,
        resolve: Resolver,
        invoke: Invoker,
        *,
        plan: Sequence[SubscriptionPlan] = (SubscriptionPlan(),),
        groups: Sequence[GroupPlan] = (),
        options: HostOptions = HostOptions(),
        max_deliveries: int | None = None,
        stop_when_idle: bool = False,
        declared: Mapping[str, str] | Collection[str] | None = None,
        ports: Ports | None = None,
    ) -> None:
        """``declared``: the subscriptions the code of this process declares (None: unknown, every
        stored one counts as declared). One stored but not declared, without a handler here, is
        ``Undeclared`` rather than ``HandlerNotRegistered``: removed from the code, or a rolling
        deploy's older instances still run it. Given as a mapping (name -> handler key), a declared
        subscription runs with this process's handler key, whatever key the store holds: in a
        rolling deploy that renames a handler, the older instances keep serving it with theirs.
        ``ports``: the transport's ports as the queue resolved them (resolved here when not given)."""
        self.transport = transport
        self._declared = declared
        self._ever_stored: set[str] = set()
        """The subscriptions the store held at some reconcile of this host: one the plan names that
        is gone was deleted while the process ran, not misspelt."""
        self._resolve = resolve
        self._invoke = invoke
        self.plan = list(plan)
        self.groups = list(groups)
        self.options = options
        self._budget = DeliveryBudget(max_deliveries) if max_deliveries is not None else None
        """One budget for every consumer: ``max_deliveries`` bounds what the host receives."""
        self._stop_when_idle = stop_when_idle
        self.settler = Settler(transport, observer=options.observer)
        self.consumers: dict[str, Consumer] = {}
        self.group_consumers: dict[str, Consumer] = {}
        self._consumer_of: dict[str, Consumer] = {}  # subscription name -> the consumer that claims it
        self._health: dict[str, SubscriptionHealth] = {}
        self._by_id: dict[str, str] = {}
        self._loops = TaskScope("workqueue-host")
        """The host's own loops (process beat, sweeper, reconcile): cancelled at stop."""
        self._retiring = TaskScope("workqueue-host-retiring")
        """Consumers no longer planned, draining: stop waits for them."""
        self._started = False
        self._reconcile_lock = asyncio.Lock()
        self._retired: dict[str, list[Consumer]] = {}  # consumers no longer planned, by subscription
        self.ports = ports if ports is not None and ports.transport is transport else Ports.of(transport)
        self._registry = self.ports.processes
        self.stored_handler_keys: dict[str, str] = {}
        """The handler key of each stored subscription (key -> a subscription that names it), as
        the last reconcile read them (this process's own key for one its code declares)."""
        self._beat_failing = False
        self.reconciled = False
        """True once a reconcile read the store's subscriptions and planned from them."""

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Host:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Plans the subscriptions and starts consumers, the sweeper and the reconcile loop.

        ``async with host:`` starts it and stops it at the end of the block."""
        if self._started:
            return
        self._started = True
        self._loops.reopen()
        self._retiring.reopen()
        self.settler.start()
        await self.transport.add_wakeup_listener(self._on_wakeup)
        await self.reconcile()
        if self._registry is not None:
            await self.beat()
            self._loops.spawn(self._beat_loop(), name="workqueue-process-beat")
        if self.options.sweeper_enabled and self.transport.capabilities.sweeps:
            self._loops.spawn(self._sweep_loop(), name="workqueue-sweeper")
        if self.options.reconcile_interval_ms > 0:
            self._loops.spawn(self._reconcile_loop(), name="workqueue-reconcile")
        if self.options.stalled_store_call_ms > 0:
            self._loops.spawn(self._stall_loop(), name="workqueue-stalls")

    async def stop(self) -> None:
        """Stops claiming everywhere, drains (SPEC §4), releases leftovers, stops the loops."""
        if not self._started:
            return
        self._started = False
        drain = self.options.shutdown_drain_ms / 1000
        # The settles still to write get the stop's time (handlers drain, then the aborted ones do,
        # 2 x the drain) and a moment more: while the store is out of reach, the process ends in
        # time and their leases bring the deliveries back.
        self.settler.give_up_by(time.monotonic() + 2 * drain + STOP_SETTLE_GRACE_SECONDS)
        await self._loops.close()
        await asyncio.gather(*(c.stop(drain) for c in self._all_consumers()), self._retiring.join(),
                             return_exceptions=True)
        await self._retiring.close()
        self.consumers.clear()
        self.group_consumers.clear()
        self._consumer_of.clear()
        await self.settler.close()
        if self._registry is not None:
            try:
                await asyncio.wait_for(self._registry.process_stop(current_process().id), 1.0)
            except Exception as exc:  # (its beats stop: it shows Gone once it missed three)
                log.warning("cannot mark this process stopped in the process registry (%s)",
                            str(exc) or "no answer within 1 s")

    async def wait_finished(self) -> None:
        """Waits until every consumer's claim loop ended (budget spent, or idle in one-shot mode)."""
        await asyncio.gather(*(c.wait_finished() for c in self._all_consumers()))

    def _all_consumers(self) -> list[Consumer]:
        return [*self.consumers.values(), *self.group_consumers.values()]

    def consumers_of(self, subscription: str) -> list[Consumer]:
        """Every consumer this host ran for ``subscription`` on its own: those a pause or a new plan
        retired, then the current one (for counts that span them, as ``workqueue work`` reports)."""
        current = self.consumers.get(subscription)
        return [*self._retired.get(subscription, ()), *([current] if current is not None else [])]

    # -- planning ----------------------------------------------------------------------------

    def _concurrency_for(self, sub: SubscriptionState) -> int | None:
        """The concurrency the plan gives ``sub``; None when it does not take it. ``*`` leaves out
        the job queues' subscriptions: the job queues' own consumer (a group) takes those that the
        process's queue list names, and no other."""
        named = next((p for p in self.plan if p.name == sub.name), None)
        if named is not None:
            return named.concurrency
        wildcard = next((p for p in self.plan if p.name == WAKE_ALL), None)
        return None if wildcard is None or is_job_topic(sub.topic) else wildcard.concurrency

    async def reconcile(self) -> None:
        """Re-plans from the stored topology: starts, pauses, resumes and updates consumers."""
        async with self._reconcile_lock:
            try:
                subscriptions = await self.transport.list_subscriptions()
            except Exception as exc:
                log.error("reconcile: cannot read subscriptions (%s)", exc)
                if not self.reconciled:  # (never planned: what it would run is what fails)
                    for name, concurrency in self._planned_names():
                        self._health.setdefault(name, SubscriptionHealth(
                            subscription=name, state="Error", concurrency=concurrency))
                for name in self._health:
                    if name not in self._consumer_of:  # (what a consumer serves runs on, and says so there)
                        self._health[name] = SubscriptionHealth(
                            subscription=name, state="Error", reason=f"cannot read the topology: {exc}",
                            reason_is_detail=True, concurrency=self._health[name].concurrency,
                        )
                return
            if self._started:  # (a host that stopped meanwhile is left as it is)
                await self._apply(subscriptions)

    async def replan(self) -> None:
        """Re-plans now, as the reconcile loop does, while the host runs (a stopped host, or one
        that stops meanwhile, is left as it is)."""
        if self._started:
            await self.reconcile()

    def _planned_names(self) -> list[tuple[str, int]]:
        """The subscriptions this host would run by its plan and groups, as far as the code
        declares them (with their concurrency): what its health names before it could read the
        store's."""
        declared = list(self._declared) if self._declared is not None else []
        planned = [(p.name, p.concurrency) for p in self.plan if p.name != WAKE_ALL]
        seen = {name for name, _ in planned}
        wildcard = next((p for p in self.plan if p.name == WAKE_ALL), None)
        for name in sorted(declared):
            if name in seen:
                continue
            group = next((g for g in self.groups if any(fnmatch.fnmatchcase(name, p) for p in g.patterns)), None)
            if group is not None:
                planned.append((name, group.concurrency))
            elif wildcard is not None and not is_job_topic(name):
                planned.append((name, wildcard.concurrency))
            else:
                continue
            seen.add(name)
        return planned

    async def _apply(self, subscriptions: list[SubscriptionState]) -> None:
        self.reconciled = True
        subscriptions = [self._own_handler_key(s) for s in subscriptions]
        self.stored_handler_keys = {s.handler_key: s.name for s in subscriptions}
        self._ever_stored.update(s.name for s in subscriptions)
        health: dict[str, SubscriptionHealth] = {}
        self._by_id = {str(s.id): s.name for s in subscriptions}
        consumer_of: dict[str, Consumer] = {}
        served = self._apply_groups([s for s in subscriptions if s.host_type == "worker"], health, consumer_of)
        seen: set[str] = set()
        for sub in subscriptions:
            if sub.host_type != "worker" or sub.name in served:
                continue
            concurrency = self._concurrency_for(sub)
            if concurrency is None:
                continue
            seen.add(sub.name)
            state, reason = self._desired_state(sub)
            consumer = self.consumers.get(sub.name)
            if state == "Running":
                if consumer is None:
                    consumer = Consumer(
                        self.transport, self.settler, sub, self._resolve, self._invoke,
                        concurrency=concurrency,
                        idle_poll_min=self.options.idle_poll_min_ms / 1000,
                        idle_poll_max=self.options.idle_poll_max_ms / 1000,
                        wake_backoff=self.options.wake_backoff_ms / 1000,
                        principal=self.options.principal,
                        budget=self._budget,
                        stop_when_idle=self._stop_when_idle,
                        observer=self.options.observer,
                        request_load=self.options.request_load,
                    )
                    self.consumers[sub.name] = consumer
                    consumer.start()
                    log.info("%s: running (concurrency %d)", sub.name, concurrency)
                    consumer_of[sub.name] = consumer
                else:
                    consumer_of[sub.name] = consumer
                    if consumer.paused:
                        log.info("%s: resumed", sub.name)
                        consumer.resume()
                    consumer.update(sub, concurrency)
            elif state == "Paused" and consumer is not None:
                # A pause stops claiming; what runs finishes and settles (SPEC §3).
                if not consumer.paused:
                    log.info("%s: pausing (%s)", sub.name, reason)
                    consumer.pause()
                consumer_of[sub.name] = consumer
            elif consumer is not None:
                log.info("%s: stopping (%s)", sub.name, state)
                self._stop_later(self.consumers.pop(sub.name))
            health[sub.name] = SubscriptionHealth(
                subscription=sub.name, state=state, reason=reason, concurrency=concurrency
            )
        for entry in self.plan:
            if entry.name != WAKE_ALL and entry.name not in seen and entry.name not in health:
                known = next((s for s in subscriptions if s.name == entry.name), None)
                planned_state: HealthState = "Unsupported" if known is not None else "Error"
                if known is not None:
                    reason = f"subscription {entry.name!r} is served outside this host (host_type external)"
                elif self._declared is not None and entry.name in self._declared:
                    reason = (f"subscription {entry.name!r} is declared here but not in the store (deleted since this "
                              "process started?); a start of a release that declares it creates it again")
                elif entry.name in self._ever_stored:
                    # (deleted by an operator, as the runbook's last step: nothing is left to serve,
                    # and every instance out of its load balancer for a stale plan would help no one)
                    planned_state = "Undeclared"
                    reason = (f"subscription {entry.name!r} was deleted from the store while this process ran, and "
                              "the plan (WORKQUEUE_SUBSCRIPTIONS) still names it: take it out of the plan")
                else:
                    reason = (f"subscription {entry.name!r} does not exist; declare it or check the name (the plan, "
                              "WORKQUEUE_SUBSCRIPTIONS, names it)")
                health[entry.name] = SubscriptionHealth(
                    subscription=entry.name, state=planned_state, reason=reason, concurrency=entry.concurrency,
                )
        stored = {s.name for s in subscriptions}
        deleted: set[str] = set()
        for name in list(self.consumers):
            if name not in seen:
                if name not in stored:
                    deleted.add(name)
                    log.warning(
                        "%s: no longer in the store (deleted): this process stops serving it; a start of a release "
                        "that declares it creates it again", name)
                else:
                    log.info("%s: stopping (no longer planned here)", name)
                self._stop_later(self.consumers.pop(name))
        for name, now in health.items():
            before = self._health.get(name)
            if (now.state in ("HandlerNotRegistered", "Error") and name not in deleted
                    and (before is None or before.state != now.state)):
                # (health says it too, but nobody may be asking: the log is where a newcomer looks)
                log.warning("%s: not served by this process (%s): %s", name, now.state, now.reason)
        self._health = health
        self._consumer_of = consumer_of

    def _apply_groups(
        self, subscriptions: list[SubscriptionState], health: dict[str, SubscriptionHealth],
        consumer_of: dict[str, Consumer],
    ) -> set[str]:
        """Plans the group consumers; returns the subscriptions they serve."""
        served: set[str] = set()
        for plan in self.groups:
            groups: list[list[SubscriptionState]] = []
            mine: set[str] = set()
            for pattern in plan.patterns:
                members = [s for s in subscriptions if s.name not in served and fnmatch.fnmatchcase(s.name, pattern)]
                if plan.leaves is not None and _is_glob(pattern):
                    members = self._left_out(members, plan.leaves, health)
                served.update(s.name for s in members)
                mine.update(s.name for s in members)
                group = []
                for sub in members:
                    state, reason = self._desired_state(sub)
                    health[sub.name] = SubscriptionHealth(subscription=sub.name, state=state, reason=reason,
                                                          concurrency=plan.concurrency)
                    if state == "Running":
                        group.append(sub)
                if group:
                    groups.append(group)
            consumer = self.group_consumers.get(plan.name)
            if consumer is None and groups:
                consumer = Consumer(
                    self.transport, self.settler, groups, self._resolve, self._invoke,
                    concurrency=plan.concurrency, name=plan.name,
                    idle_poll_min=self.options.idle_poll_min_ms / 1000,
                    idle_poll_max=self.options.idle_poll_max_ms / 1000,
                    wake_backoff=self.options.wake_backoff_ms / 1000,
                    principal=self.options.principal, budget=self._budget,
                    stop_when_idle=self._stop_when_idle, observer=self.options.observer,
                    request_load=self.options.request_load,
                )
                self.group_consumers[plan.name] = consumer
                consumer.start()
                log.info("%s: running %s (concurrency %d)", plan.name,
                         " then ".join("+".join(s.name for s in g) for g in groups), plan.concurrency)
            elif consumer is not None:
                if groups:
                    if consumer.paused:
                        consumer.resume()
                    consumer.update(groups, plan.concurrency)
                elif not consumer.paused:
                    consumer.pause()
            if consumer is not None:
                consumer_of.update(dict.fromkeys(mine, consumer))
        return served

    @staticmethod
    def _left_out(members: list[SubscriptionState], leaves: Callable[[str], str | None],
                  health: dict[str, SubscriptionHealth]) -> list[SubscriptionState]:
        """``members`` without those the group leaves, which health reports ``Undeclared``."""
        kept = []
        for sub in members:
            why = leaves(sub.name)
            if why is None:
                kept.append(sub)
            else:
                health[sub.name] = SubscriptionHealth(subscription=sub.name, state="Undeclared", reason=why)
        return kept

    def _stop_later(self, consumer: Consumer) -> None:
        """Stops a consumer that is no longer planned, draining it in the background."""
        self._retired.setdefault(consumer.subscription.name, []).append(consumer)
        self._retiring.spawn(consumer.stop(self.options.shutdown_drain_ms / 1000),
                             name=f"workqueue-retire:{consumer.name}")

    def _own_handler_key(self, sub: SubscriptionState) -> SubscriptionState:
        """``sub`` with the handler key this process's code declares for it (the stored one
        otherwise): the key the store holds is the one the last release to sync wrote."""
        declared = self._declared
        if isinstance(declared, Mapping):
            key = declared.get(sub.name)
            if key is not None and key != sub.handler_key:
                return sub.model_copy(update={"handler_key": key})
        return sub

    def _desired_state(self, sub: SubscriptionState) -> tuple[HealthState, str | None]:
        reason = unsupported_reason(self.ports, sub)
        if reason is not None:
            return "Unsupported", reason
        retired = sub.status == "Retired" or sub.topic_status == "Retired"
        declared = self._declared
        if (isinstance(declared, Mapping) and sub.name not in declared and not retired
                and not is_job_topic(sub.topic)  # (every job queue shares one handler; queues come and go)
                and sub.handler_key in declared.values() and all(p.name != sub.name for p in self.plan)):
            # Renamed, the handler kept: the new name runs it here, not the old one as well (unless
            # the process's plan names the old one: then it is run on purpose).
            now = sorted(name for name, key in declared.items() if key == sub.handler_key)
            return "Undeclared", (
                f"subscription {sub.name!r} is stored, but no code in this process declares it; its handler "
                f"{sub.handler_key!r} serves {', '.join(map(repr, now))} here. If it was renamed, retire it: "
                f"`workqueue subscriptions retire {sub.name}` (until then it gets a delivery of every message, "
                "which instances that still declare it run)"
            )
        if self._resolve(sub.handler_key) is None:
            if retired:
                return "Retired", (
                    f"subscription {sub.name!r} is retired and no handler for it is registered here: what it "
                    "still holds waits for a process that has one, or for "
                    f"`workqueue subscriptions retire {sub.name} --discard-pending`"
                )
            if self._declared is not None and sub.name not in self._declared:
                return "Undeclared", (
                    f"subscription {sub.name!r} is stored, but no code in this process declares it; if it was "
                    f"removed on purpose, retire it: `workqueue subscriptions retire {sub.name}` (instances that "
                    "still declare it keep running it meanwhile)"
                )
            return "HandlerNotRegistered", (
                f"no handler is registered under {sub.handler_key!r} in this process; "
                "register it with @queue.handler(...) and import its module"
            )
        if sub.status == "Paused":
            return "Paused", f"subscription {sub.name!r} is Paused"
        if sub.topic_status == "Paused":
            return "Paused", f"topic {sub.topic!r} is Paused"
        if retired:
            what = f"subscription {sub.name!r}" if sub.status == "Retired" else f"topic {sub.topic!r}"
            return "Running", f"{what} is retired: no new deliveries; draining what it still holds"
        serving = self.ports.for_subscription(sub.name)
        if sub.partition_mode == "Exclusive" and serving.capabilities.retry_keeps_key_busy:
            return "Running", RETRY_KEEPS_KEY_BUSY.format(name=serving.name)
        return "Running", None

    def health(self) -> list[SubscriptionHealth]:
        """Each planned subscription's state, with what runs now."""
        report = []
        after = self.options.stalled_store_call_ms / 1000
        settles_stalled = self.settler.watch.stalled(after)
        for name, entry in sorted(self._health.items()):
            consumer = self.consumers.get(name)
            group = None if consumer is not None else self._consumer_of.get(name)
            if group is not None:  # served by a group consumer: its share of it
                entry = entry.model_copy(update={"active": group.active_for(name)})
                if entry.state == "Running" and group.last_error is not None:
                    entry = entry.model_copy(update={"state": "Error", "reason": group.last_error,
                                                     "reason_is_detail": not group.last_error_public})
            elif consumer is not None and entry.state == "Running":
                state: HealthState = "Running"
                reason = entry.reason
                detail = entry.reason_is_detail
                if consumer.last_error is not None:
                    state, reason, detail = "Error", consumer.last_error, not consumer.last_error_public
                entry = entry.model_copy(update={"active": consumer.active, "state": state, "reason": reason,
                                                 "reason_is_detail": detail})
            elif consumer is not None:
                entry = entry.model_copy(update={"active": consumer.active})
            serving = consumer or group
            if entry.state == "Running" and serving is not None:
                stalled = self._stall_of(serving, after, settles_stalled)
                if stalled is not None:
                    entry = entry.model_copy(update={"state": "Error", "reason": stalled})
            report.append(entry)
        return report

    # -- loops -------------------------------------------------------------------------------

    async def _stall_loop(self) -> None:
        """Looks at the claims and settles under way every few seconds: one that has waited
        ``stalled_store_call_ms`` is logged once (and again when it returns, :mod:`.stalls`)."""
        after = self.options.stalled_store_call_ms / 1000
        while True:
            await asyncio.sleep(min(max(after / 4, 0.05), 5.0))
            self.settler.watch.check(after, stall_causes(self.transport.name))
            for consumer in self._all_consumers():
                if self._claims_watched(consumer):
                    consumer.claim_watch.check(after, self._stall_causes(consumer))

    def _stall_of(self, consumer: Consumer, after: float, settles_stalled: float | None) -> str | None:
        """Why the subscriptions of ``consumer`` are held up by a call that waits too long, or None."""
        claim_stalled = consumer.claim_watch.stalled(after)
        if claim_stalled is not None and self._claims_watched(consumer):
            return stall_reason("its claim", claim_stalled, self._stall_causes(consumer))
        if settles_stalled is not None:
            return stall_reason("writing this process's settles", settles_stalled, self._stall_causes(consumer))
        return None

    def _stall_causes(self, consumer: Consumer) -> str:
        """What may keep the calls of ``consumer`` waiting, by the store of its first subscription."""
        first = consumer.groups[0][0].name if consumer.groups and consumer.groups[0] else None
        return stall_causes(self.transport.name if first is None else self.ports.for_subscription(first).name)

    def _claims_watched(self, consumer: Consumer) -> bool:
        """Whether how long the claims of ``consumer`` take tells of a stalled store: not where a
        claim may wait for work to arrive (an SQS long poll)."""
        return not any(self.ports.for_subscription(sub.name).capabilities.claims_wait
                       for group in consumer.groups for sub in group)

    def _on_wakeup(self, subscription_id: str) -> None:
        if subscription_id == WAKE_ALL:
            for consumer in self._all_consumers():
                consumer.wake()
            return
        name = self._by_id.get(subscription_id)
        target = self._consumer_of.get(name) if name is not None else None
        if target is not None:
            target.wake(name)

    @property
    def beat_interval(self) -> float:
        """Seconds between two beats of this process in the registry (the reconcile interval)."""
        return (self.options.reconcile_interval_ms or 30000) / 1000

    async def beat(self) -> None:
        """Writes this process's row in the registry: what it serves, its slots and busy ones."""
        if self._registry is None:
            return
        consumers = self._all_consumers()
        beat = ProcessBeat(
            identity=current_process(), subscriptions=tuple(sorted(self._consumer_of)),
            slots=sum(c.concurrency for c in consumers), busy=sum(c.active for c in consumers),
            interval_seconds=self.beat_interval,
        )
        try:
            await self._registry.process_beat(beat)
        except Exception as exc:
            if not self._beat_failing:
                log.warning("cannot record this process in the process registry (%s); retrying every %g s",
                            exc, self.beat_interval)
            self._beat_failing = True
        else:
            self._beat_failing = False

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.beat_interval)
            await self.beat()

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.reconcile_interval_ms / 1000)
            await self.reconcile()

    async def sweep_once(self) -> int:
        """Runs sweeper passes until one finds less than a full batch; returns leases expired. A
        transport that does not sweep (``capabilities.sweeps`` False: SQS expires leases itself) is
        not called."""
        expired = 0
        if not self.transport.capabilities.sweeps:
            return expired
        for _ in range(100):
            report = await self.transport.sweep(self.options.sweep_batch)
            if not report.ran:
                break
            for lease in report.taken_back[:TAKEN_BACK_LOGGED]:
                log.info("sweeper: took back delivery %s of %s on attempt %d from %s, whose lease ran out; %s",
                         lease.delivery_id, lease.subscription, lease.attempt,
                         lease.holder.label() if lease.holder is not None else "a process the store does not name",
                         _TAKEN_BACK[lease.result],
                         extra={"subscription": lease.subscription, "delivery_id": lease.delivery_id,
                                "attempt": lease.attempt})
            rest = report.taken_back[TAKEN_BACK_LOGGED:]
            if rest:
                by_subscription = Counter(lease.subscription for lease in rest)
                log.info("sweeper: also took back %s whose leases ran out in this pass (%s)",
                         count(len(rest), "delivery"),
                         ", ".join(f"{n} of {name}" for name, n in sorted(by_subscription.items())))
            if report.taken_back and self.options.on_taken_back is not None:
                self.options.on_taken_back(report.taken_back)
            expired += report.expired
            if report.expired:
                for consumer in self._all_consumers():
                    consumer.wake()
            batch = self.options.sweep_batch
            if report.expired < batch and max(report.purged_deliveries, report.purged_messages,
                                              report.purged_deduplication) < batch:
                break
        return expired

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("sweeper pass failed (%s); next pass in %d ms", exc, self.options.sweeper_interval_ms)
            await asyncio.sleep(self.options.sweeper_interval_ms / 1000)
