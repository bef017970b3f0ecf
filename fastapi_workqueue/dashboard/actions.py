"""The actions: replay, discard, cancel, pause, resume, and the bulk replay of a subscription's
dead letters. Each is a form posted with its CSRF token and answered with a redirect (303) back to
the page it came from, with a notice of what happened."""

# No ``from __future__ import annotations``: FastAPI reads the route signatures, whose annotations
# name aliases local to the builder.

from typing import Annotated
from urllib.parse import quote, urlencode

from fastapi import APIRouter, HTTPException, Request, Security, status
from fastapi.responses import RedirectResponse

from ..core.errors import ActionRefused
from ..core.keys import SCOPE_OPERATE, SCOPE_READ, Principal
from ..core.reports import DeliveryInfo
from ..web.auth import Authorizer
from . import views
from .causes import dead_letter_causes
from .csrf import check_csrf
from .forms import local_path, read_form, read_form_values, text_field
from .render import Dashboard
from .session import base_path


def build_actions(d: Dashboard, authorize: Authorizer) -> APIRouter:
    router = APIRouter()
    Operator = Annotated[Principal, Security(authorize, scopes=[SCOPE_READ, SCOPE_OPERATE])]

    async def checked_form(request: Request) -> dict[str, str]:
        form = await read_form(request)
        check_csrf(request, form)
        return form

    def back(
        request: Request, form: dict[str, str], default: str, notice: str, n: int | None = None
    ) -> RedirectResponse:
        target = local_path(form.get("back"), base_path(request), default).split("?", 1)[0]
        query = {"notice": notice, **({"n": str(n)} if n is not None else {})}
        return RedirectResponse(f"{target}?{urlencode(query)}", status_code=status.HTTP_303_SEE_OTHER)

    def delivery_url(request: Request, delivery_id: str) -> str:
        return f"{base_path(request)}/deliveries/{quote(delivery_id, safe='')}"

    def subscription_url(request: Request, name: str) -> str:
        return f"{base_path(request)}/subscriptions/{quote(name, safe='')}"

    async def known_delivery(delivery_id: str) -> DeliveryInfo:
        info = await d.kernel.operator.get_delivery(delivery_id)
        if info is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"delivery {delivery_id!r} does not exist")
        return info

    @router.post("/deliveries/{delivery_id}/replay")
    async def replay(request: Request, delivery_id: str, principal: Operator) -> RedirectResponse:
        form = await checked_form(request)
        info = await known_delivery(delivery_id)
        note = text_field(form, "note") or f"replayed by {principal.name} from the dashboard"
        result = await d.kernel.operator.replay(info.subscription, delivery_id, note)
        return back(request, form, delivery_url(request, delivery_id), result.result)

    @router.post("/deliveries/{delivery_id}/discard")
    async def discard(request: Request, delivery_id: str, principal: Operator) -> RedirectResponse:
        form = await checked_form(request)
        info = await known_delivery(delivery_id)
        reason = text_field(form, "reason") or f"discarded by {principal.name} from the dashboard"
        result = await d.kernel.operator.discard(info.subscription, delivery_id, reason)
        return back(request, form, delivery_url(request, delivery_id), result.result)

    @router.post("/deliveries/{delivery_id}/cancel")
    async def cancel(request: Request, delivery_id: str, principal: Operator) -> RedirectResponse:
        """A discard that only applies while the delivery runs (a cancel never drops waiting work)."""
        form = await checked_form(request)
        info = await known_delivery(delivery_id)
        if info.status != "InFlight":
            return back(request, form, delivery_url(request, delivery_id), "NotRunning")
        reason = text_field(form, "reason") or f"cancelled by {principal.name} from the dashboard"
        result = await d.kernel.operator.discard(info.subscription, delivery_id, reason)
        return back(request, form, delivery_url(request, delivery_id), result.result)

    async def set_status(request: Request, name: str, paused: bool) -> RedirectResponse:
        form = await checked_form(request)
        try:
            changed = await (d.kernel.operator.pause(name) if paused else d.kernel.operator.resume(name))
        except ActionRefused:
            return back(request, form, subscription_url(request, name), "RetiredNotPaused")
        if changed is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"subscription {name!r} does not exist")
        notice = ("Paused" if paused else "Resumed") if changed else "Unchanged"
        return back(request, form, subscription_url(request, name), notice)

    @router.post("/subscriptions/{name}/pause")
    async def pause(request: Request, name: str, principal: Operator) -> RedirectResponse:
        return await set_status(request, name, True)

    @router.post("/subscriptions/{name}/resume")
    async def resume(request: Request, name: str, principal: Operator) -> RedirectResponse:
        return await set_status(request, name, False)

    @router.post("/subscriptions/{name}/replay-all")
    async def replay_all(request: Request, name: str, principal: Operator) -> RedirectResponse:
        """Replays the subscription's dead letters oldest first, a batch at a time, at most
        views.BULK_BATCH x views.BULK_BATCHES per request; the page says how many, and offers the next round
        when more are left."""
        form = await checked_form(request)
        if form.get("confirm") != "yes":
            return RedirectResponse(f"{subscription_url(request, name)}/replay-all",
                                    status_code=status.HTTP_303_SEE_OTHER)
        if await views.find_subscription(d.kernel, name) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"subscription {name!r} does not exist")
        note = text_field(form, "note") or f"replayed with all dead letters by {principal.name} from the dashboard"
        replayed = 0
        after: str | None = None
        for _ in range(views.BULK_BATCHES):
            batch = await d.kernel.operator.dead_letters(name, limit=views.BULK_BATCH, after=after)
            for info in batch:
                if (await d.kernel.operator.replay(name, info.delivery_id, note)).ok:
                    replayed += 1
            if len(batch) < views.BULK_BATCH:
                break
            after = batch[-1].delivery_id
        return back(request, {}, subscription_url(request, name), "ReplayedAll", replayed)

    async def act_on(name: str, ids: list[str], replay: bool, text: str) -> int:
        done = 0
        for delivery_id in ids:
            result = await (d.kernel.operator.replay(name, delivery_id, text) if replay else
                            d.kernel.operator.discard(name, delivery_id, text))
            done += result.ok
        return done

    @router.post("/subscriptions/{name}/causes/{key}/{verb}")
    async def act_on_cause(request: Request, name: str, key: str, verb: str, principal: Operator) -> RedirectResponse:
        """Replays or discards every dead letter of one cause (at most views.BULK_BATCH x
        views.BULK_BATCHES a request: the page offers the rest again)."""
        form = await checked_form(request)
        if verb not in ("replay", "discard"):
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no action {verb!r}")
        if await views.find_subscription(d.kernel, name) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"subscription {name!r} does not exist")
        group = next((g for g in (await dead_letter_causes(d.kernel, name)).groups if g.key == key), None)
        if group is None:
            return back(request, form, subscription_url(request, name), "CauseGone")
        replay = verb == "replay"
        text = text_field(form, "note" if replay else "reason") or (
            f"{'replayed' if replay else 'discarded'} with its cause by {principal.name} from the dashboard")
        done = await act_on(name, group.delivery_ids[:views.BULK_BATCH * views.BULK_BATCHES], replay, text)
        return back(request, form, subscription_url(request, name), "ReplayedGroup" if replay else "DiscardedGroup",
                    done)

    @router.post("/subscriptions/{name}/selected/{verb}")
    async def act_on_selected(request: Request, name: str, verb: str, principal: Operator) -> RedirectResponse:
        """Replays or discards the dead letters ticked on the page (``delivery``, repeated)."""
        values = await read_form_values(request)
        form = {field: found[0] for field, found in values.items()}
        check_csrf(request, form)
        if verb not in ("replay", "discard"):
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no action {verb!r}")
        ids = [i for i in dict.fromkeys(values.get("delivery", []))
               if (i.isascii() and i.isdigit()) or i.startswith("aws:")]
        if not ids:
            return back(request, form, subscription_url(request, name), "NothingSelected")
        replay = verb == "replay"
        text = f"{'replayed' if replay else 'discarded'} with a selection by {principal.name} from the dashboard"
        done = await act_on(name, ids, replay, text)
        return back(request, form, subscription_url(request, name),
                    "ReplayedSelected" if replay else "DiscardedSelected", done)

    return router
