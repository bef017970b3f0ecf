"""The pages: the overview, a subscription, one delivery, and the confirmation of a bulk replay."""

# No ``from __future__ import annotations``: FastAPI reads the route signatures, whose annotations
# name aliases local to the builder.

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Security, status
from fastapi.responses import HTMLResponse

from ..core.clock import store_now
from ..core.keys import SCOPE_OPERATE, SCOPE_READ, Principal
from ..core.processes import current_process
from ..core.topology import SubscriptionState
from ..web.auth import Authorizer
from . import views
from .access import Viewer
from .chart import render_chart
from .jobs_view import jobs_page
from .render import Dashboard


def build_pages(d: Dashboard, authorize: Authorizer) -> APIRouter:
    router = APIRouter()
    Reader = Annotated[Principal, Security(authorize, scopes=[SCOPE_READ])]
    Operator = Annotated[Principal, Security(authorize, scopes=[SCOPE_READ, SCOPE_OPERATE])]

    def viewer(principal: Principal) -> Viewer:
        return Viewer(principal=principal, signed_in_here=d.own_sign_in)

    async def subscription_or_404(name: str) -> SubscriptionState:
        state = await views.find_subscription(d.kernel, name)
        if state is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"subscription {name!r} does not exist")
        return state

    @router.get("/", response_class=HTMLResponse)
    async def overview(request: Request, principal: Reader) -> HTMLResponse:
        data = await views.overview(d.kernel)
        rows = data.rows
        live = (sum(r.counts.pending + r.counts.in_flight for r in rows), sum(r.counts.dead_lettered for r in rows))
        chart = render_chart(data.history, data.now, label="All subscriptions", live=live)
        return d.render(request, "overview.html", {"page": data, "chart": chart}, viewer=viewer(principal))

    @router.get("/processes", response_class=HTMLResponse)
    async def processes(request: Request, principal: Reader) -> HTMLResponse:
        return d.render(request, "processes.html", {
            "processes": await views.process_list(d.kernel), "now": await store_now(d.kernel.ports.clock),
            "here": current_process().id,
        }, viewer=viewer(principal))

    @router.get("/jobs", response_class=HTMLResponse)
    async def jobs(request: Request, principal: Reader) -> HTMLResponse:
        now = await store_now(d.kernel.ports.clock)
        return d.render(request, "jobs.html", {"page": await jobs_page(d.jobs(), now)}, viewer=viewer(principal))

    @router.get("/search", response_class=HTMLResponse)
    async def search(
        request: Request, principal: Reader, q: Annotated[str, Query(max_length=512)] = "",
    ) -> HTMLResponse:
        query = q.strip()
        found = await views.search(d.kernel, query)
        return d.render(request, "search.html", {"query": query, "found": found, "limit": views.SEARCH_PAGE},
                        viewer=viewer(principal))

    @router.get("/subscriptions/{name}", response_class=HTMLResponse)
    async def subscription(
        request: Request, name: str, principal: Reader,
        after: Annotated[str | None, Query(pattern=r"^[0-9]{1,19}$")] = None,
    ) -> HTMLResponse:
        page = await views.subscription_page(d.kernel, d.jobs, await subscription_or_404(name), after)
        counts = page.row.counts
        chart = render_chart(page.history, page.now, label=name,
                             live=(counts.pending + counts.in_flight, counts.dead_lettered))
        return d.render(request, "subscription.html", {"page": page, "chart": chart}, viewer=viewer(principal))

    @router.get("/deliveries/{delivery_id}", response_class=HTMLResponse)
    async def delivery(request: Request, delivery_id: str, principal: Reader) -> HTMLResponse:
        seen = viewer(principal)
        found = await views.delivery(d.kernel, d.jobs, delivery_id, include_payload=seen.sees_payloads)
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"delivery {delivery_id!r} does not exist")
        info, job = found
        trace_url = d.kernel.settings.trace_url
        link = trace_url.replace("{trace_id}", info.trace_id) if trace_url and info.trace_id else None
        attempts = await views.attempts_of(d.kernel, delivery_id)
        return d.render(request, "delivery.html", {"info": info, "trace_link": link, "job": job,
                                                   "attempts": attempts}, viewer=seen)

    @router.get("/subscriptions/{name}/replay-all", response_class=HTMLResponse)
    async def confirm_replay_all(request: Request, name: str, principal: Operator) -> HTMLResponse:
        state = await subscription_or_404(name)
        counts = (await views.counts_of(d.kernel, name)).get(name)
        return d.render(request, "replay_all.html", {
            "state": state, "counts": counts, "batch": views.BULK_BATCH, "most": views.BULK_BATCH * views.BULK_BATCHES,
        }, viewer=viewer(principal))

    return router
