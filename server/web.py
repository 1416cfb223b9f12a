"""The built-in web page (GET /): a chat with the served model and a live view of the prefix cache, and the
JSON it polls (GET /v1/cache/stats: the numbers /metrics exports, for one engine or summed over replicas).

The page is one static file shipped in the package (server/static/index.html): plain HTML, CSS and
JavaScript, nothing fetched from elsewhere, so it works offline. Its API calls go through /v1 like any
client's, with the API key it asks for when the server requires one.
"""

from dataclasses import asdict
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from server.core import ServerState, state_for

router = APIRouter()
PAGE = resources.files("server") / "static" / "index.html"
# the page is one file that loads nothing from elsewhere and is never framed (no clickjacking of its key box)
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # clients probe the root with HEAD
async def page() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers=PAGE_HEADERS)


@router.get("/v1/cache/stats")
async def cache_stats(request: Request, model: str | None = None) -> dict:
    """The engine's counters and gauges (summed over replicas behind a router), and the token hit rate, of
    the served model `model` names (default: the first; the page asks for the one it chats with)."""
    st: ServerState = state_for(request, model) if model is not None else request.app.state.server
    total: dict[str, float] = {}
    for stats in st.engine.replica_stats().values():
        for key, value in asdict(stats).items():
            if isinstance(value, int | float) and not isinstance(value, bool):  # not None: what it lacks
                total[key] = total.get(key, 0) + value
    looked_up = total.get("prefix_query_tokens", 0)
    total["hit_rate"] = total.get("prefix_hit_tokens", 0) / looked_up if looked_up else 0.0
    if st.shadow is not None:  # the cache advice: the recent requests replayed at other pool sizes
        total["shadow"] = [asdict(rate) for rate in st.shadow.rates]
    return total
