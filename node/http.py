"""Local HTTP status endpoint (aiohttp), served on the node's own event loop.

``GET /healthz`` 200 when up; ``/status`` JSON; ``/peers`` JSON list; ``/metrics`` Prometheus text; ``/`` the
dashboard (``node/static/dashboard.html``, drawing ``/dashboard`` JSON with uPlot, which ships in ``node/static``:
the page loads nothing from elsewhere).
Bound to 127.0.0.1 by default: it is for the person running the node, not for the swarm, nor for the web pages that
person's browser opens. So every request passes :func:`StatusServer._guard` first:

- ``Host`` must name the address we are bound to (a DNS-rebinding page reaches us under its own name): else 421.
  Bound to 0.0.0.0 or :: (a container, a LAN node), the name in ``Host`` (any port: a published port differs from
  ours) must be a loopback name, one of this machine's own addresses, its host name, or one of
  ``http.allowed_hosts``;
- a request with an ``Origin`` that is not ours (a cross-site form or fetch) is refused: 403. Ours is the endpoint's
  own origin: ``http://<an allowed Host>``, the Host of the request itself when bound to 0.0.0.0 or ::;
- anything but GET/HEAD needs ``Authorization: Bearer <token>``, the secret in ``<data dir>/http.token`` (mode 0600;
  ``swarmd write`` reads it): else 401;
- a body over the route's limit (or a body without a Content-Length) is refused before it is read: 413 / 411.

A service's own routes (``/bulk``, ``/topics/...``, SAPO's ``/sapo/history``) are served whether it started with the
node or was attached to the running node later (``swarmd.DiLoCo`` on a node a script started before): aiohttp's
router is frozen once it listens, so routes added later live in :class:`LateRoutes`, one resource of that router
which resolves them as the router does its own. A request to one passes the same guard.

Each refusal is counted in ``/metrics`` (``swarmd_errors_total{kind="http_..."}``) and logged at most once a minute
per kind.
"""

from __future__ import annotations

import base64
import errno
import hmac
import ipaddress
import asyncio
import json
import logging
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractResource

from swarmd.node.metrics import CONTENT_TYPE, make_registry, render
from swarmd.node.replication import WritesPaused

if TYPE_CHECKING:
    from swarmd.node.core import Node

logger = logging.getLogger(__name__)


# the dashboard and what it loads, read once: a fixed set of names, never a path from the request
_STATIC_DIR = Path(__file__).parent / "static"
STATIC = {name: ((_STATIC_DIR / name).read_bytes(), kind) for name, kind in (
    ("dashboard.html", "text/html"), ("dashboard.js", "application/javascript"),
    ("uPlot.iife.min.js", "application/javascript"), ("uPlot.min.css", "text/css"))}
# the page runs only its own scripts and talks only to this node; no other site may frame it
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; "
                "style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff"}


class HttpStartError(Exception):
    pass


KIB, MIB = 1 << 10, 1 << 20
# request body limits by (method, route); a POST elsewhere may carry 4 KiB
BODY_LIMITS = {
    "/crdt": 4 * MIB,
    "/topics/{topic}": 4 * MIB + 64 * KIB,  # one pubsub message (gossip.MAX_MESSAGE)
    "/bulk": 1 << 30,  # a blob to announce (the node holds it in memory)
}
DEFAULT_BODY_LIMIT = 4 * KIB
MAX_BODY_DEPTH = 32  # JSON nesting of a POST /crdt body (a value in the store is at most 8 deep: crdt/types.py)
MAX_OPS_PER_WRITE = 1000  # ops signed in one POST /crdt (each is an Ed25519 signature on the event loop)


class LateRoutes(AbstractResource):
    """Routes added after the endpoint started listening, resolved as the app's own.

    Registered last under ``/``, the router asks it about a path only after its own routes for that path (and for
    each of the path's prefixes) matched nothing, so an added route never shadows one served from the start. The
    match it returns is the added route's own: the guard, ``request.match_info`` and the body limit by route see
    that route, as they would had it been there from the start.
    """

    def __init__(self) -> None:
        super().__init__()
        self._routes = web.UrlDispatcher()  # builds each added route's resource; never frozen, never an app's
        self._served: set[tuple[str, str]] = set()

    def add(self, routes: list, served: set[tuple[str, str]]) -> list[str]:
        """Add ``routes`` (aiohttp RouteDefs); returns "METHOD path" of those already served (in ``served``, the
        app's own, or added before), which are left out: the first service to serve a route keeps it."""
        taken = []
        for route in routes:
            key = (route.method, route.path)
            if key in served or key in self._served:
                taken.append(f"{route.method} {route.path}")
                continue
            self._served.add(key)
            route.register(self._routes)
        return taken

    @property
    def canonical(self) -> str:
        return "/"

    async def resolve(self, request: web.Request):
        allowed: set[str] = set()
        for resource in self._routes.resources():
            match, methods = await resource.resolve(request)
            if match is not None:
                return match, methods
            allowed |= methods
        return None, allowed

    def url_for(self, **kwargs: str):
        raise RuntimeError("routes added to a running endpoint are not named")

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("routes added to a running endpoint are served at their own paths")

    def get_info(self) -> dict:
        return {"routes": [f"{r.method} {r.resource.canonical}" for r in self]}

    def raw_match(self, path: str) -> bool:
        return False

    def __len__(self) -> int:
        return sum(len(resource) for resource in self._routes.resources())

    def __iter__(self):
        return (route for resource in self._routes.resources() for route in resource)


class StatusServer:
    def __init__(self, node: Node, host: str, port: int, extra_routes: list = (), token: str | None = None,
                 allowed_hosts: list[str] = ()):
        self.node = node
        self._allowed_names = {n.lower() for n in allowed_hosts}  # the user's own names, at any port
        self._extra_routes = list(extra_routes)
        self._late = LateRoutes()
        self._served: set[tuple[str, str]] = set()  # (method, path) of the app's own routes
        self.host = host
        self.port = port
        self.token = token
        self._runner: web.AppRunner | None = None
        self._registry = make_registry(node)
        self.url: str | None = None
        self._hosts: set[str] = set()
        self._origins: set[str] = set()
        self._logged: dict[str, float] = {}

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=max(BODY_LIMITS.values()), middlewares=[self._guard])
        app.add_routes(
            [
                web.get("/", self._page),
                web.get("/dashboard", self._dashboard),
                web.get("/static/{name}", self._static),
                web.get("/healthz", self._healthz),
                web.get("/status", self._status),
                web.get("/peers", self._peers),
                web.get("/metrics", self._metrics),
                web.get("/state", self._state),
                web.post("/crdt", self._write),
                *self._extra_routes,
            ]
        )
        app.router.register_resource(self._late)
        self._served = {(route.method, route.resource.canonical) for route in app.router.routes()
                        if route.resource is not self._late}
        return app

    def add_routes(self, routes: list) -> list[str]:
        """Serve a service's routes from now on (the endpoint may already listen); returns "METHOD path" of those
        another route already serves, which are not served twice."""
        return self._late.add(routes, self._served)

    async def start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        # SO_REUSEADDR: on Linux it only lets us bind over connections in TIME_WAIT (a quick restart after serving
        # requests), a port another process listens on is still an error
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            if e.errno == errno.EADDRINUSE:
                raise HttpStartError(f"http address {self.host}:{self.port} is already in use "
                                     "(choose --http)") from None
            raise HttpStartError(f"cannot serve http on {self.host}:{self.port}: {e.strerror}") from None
        sock = site._server.sockets[0]  # the real port when 0 was asked for
        host, port = sock.getsockname()[:2]
        self.port = port
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        names = {f"[{host}]" if ":" in host else host}
        if _loopback(host):
            names |= {"localhost", "127.0.0.1", "[::1]"}
        self._hosts = {f"{n}:{port}" for n in names}
        self._origins = {f"http://{h}" for h in self._hosts}
        self._unspecified = self.host in ("0.0.0.0", "::", "")
        self._names = self._local_names() if self._unspecified else set()
        self._names_at = time.monotonic()

    def _local_names(self) -> set[str]:
        """The names a request to an endpoint bound to every address may carry in Host: loopback names, this
        machine's (container's) own addresses and host name, the unspecified address itself, the user's names."""
        names = {"localhost", "127.0.0.1", "[::1]", "0.0.0.0", "[::]", *self._allowed_names}
        try:
            import psutil

            for addrs in psutil.net_if_addrs().values():
                for a in addrs:
                    if a.family in (socket.AF_INET, socket.AF_INET6):
                        ip = a.address.split("%")[0]
                        names.add(f"[{ip.lower()}]" if ":" in ip else ip)
        except (ImportError, OSError):
            pass
        hostname = socket.gethostname().lower()
        if hostname:
            names |= {hostname, hostname.split(".")[0]}
        return names

    def _host_ok(self, host: str) -> bool:
        if host in self._hosts:
            return True
        name = _host_name(host)
        if name in self._allowed_names:
            return True
        if not self._unspecified:
            return False
        if name not in self._names and time.monotonic() - self._names_at > 30.0:
            self._names, self._names_at = self._local_names(), time.monotonic()  # an address added since
        return name in self._names

    # ------------------------------------------------------------------ the guard
    def _refuse(self, kind: str, status: int, message: str, request: web.Request) -> web.Response:
        self.node.transport.stats.errors[f"http_{kind}"] += 1
        now = time.monotonic()
        if now - self._logged.get(kind, -1e9) > 60:
            self._logged[kind] = now
            logger.warning("http: refused %s %s from %s: %s (further refusals of this kind are counted in "
                           "/metrics, logged once a minute)", request.method, request.path, request.remote, message)
        return web.json_response({"error": message}, status=status)

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        host = request.headers.get("Host", "")
        if not self._host_ok(host):
            return self._refuse("bad_host", 421, "Host must name this node's endpoint (a loopback name, one of "
                                "its addresses or a name in http.allowed_hosts)", request)
        origin = request.headers.get("Origin")
        if origin is not None and origin not in self._origins and origin.lower() != f"http://{host.lower()}":
            return self._refuse("foreign_origin", 403, "requests from other origins are refused", request)
        if request.method not in ("GET", "HEAD"):
            supplied = request.headers.get("Authorization", "")
            expected = f"Bearer {self.token}" if self.token else None
            if expected is None or not hmac.compare_digest(supplied.encode(), expected.encode()):
                return self._refuse("unauthorized", 401, "writes need 'Authorization: Bearer <token>' (the token "
                                    "is in the node's data dir, http.token)", request)
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else ""
            limit = BODY_LIMITS.get(route, DEFAULT_BODY_LIMIT)
            if request.body_exists and request.content_length is None:
                return self._refuse("no_length", 411, "a request body needs a Content-Length", request)
            if (request.content_length or 0) > limit:
                return self._refuse("too_large", 413, f"the body is over this route's limit of {limit} bytes",
                                    request)
        return await handler(request)

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "peer_id": self.node.identity.peer_id})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.node.status(), dumps=_dumps)

    async def _peers(self, request: web.Request) -> web.Response:
        return web.json_response(self.node.peers_view())

    async def _state(self, request: web.Request) -> web.Response:
        # the values are gathered on the loop (a consistent snapshot of fresh containers around payloads that are
        # never mutated) and serialised in a worker thread: a large state must not hold the event loop
        body = await asyncio.to_thread(_dumps, self.node.replicator.state())
        return web.Response(text=body, content_type="application/json")

    async def _write(self, request: web.Request) -> web.Response:
        """Local writes: ``{"ops": [{"object": name, "payload": {...}}, ...]}``; answers once they are fsync'd."""
        try:
            body = await request.json()
            if _deeper_than(body, MAX_BODY_DEPTH):
                return self._refuse("bad_body", 400, f"the body is nested deeper than {MAX_BODY_DEPTH} levels",
                                    request)
            items = [(item["object"], item["payload"]) for item in body["ops"]]
            if not items or not all(isinstance(o, str) and isinstance(p, dict) for o, p in items):
                raise ValueError
            if len(items) > MAX_OPS_PER_WRITE:
                return self._refuse("too_many_ops", 413, f"at most {MAX_OPS_PER_WRITE} ops per request", request)
        except RecursionError:
            return self._refuse("bad_body", 400, f"the body is nested deeper than {MAX_BODY_DEPTH} levels", request)
        except (ValueError, KeyError, TypeError):
            return self._refuse("bad_body", 400, 'expected {"ops": [{"object": str, "payload": {...}}, ...]}',
                                request)
        try:
            ops = await self.node.replicator.write_many(items)
        except WritesPaused as e:
            return web.json_response({"error": str(e)}, status=503)
        except ValueError as e:
            return self._refuse("rejected_write", 422, f"rejected: {e}", request)
        except OSError as e:  # the log cannot persist them (disk full): nothing was applied
            return web.json_response({"error": f"not written: {e}"}, status=503)
        return web.json_response({"ops": [{"id": op.id.hex(), "seq": op.seq} for op in ops],
                                  "digest": self.node.replicator.store.digest()})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render(self._registry), headers={"Content-Type": CONTENT_TYPE})

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(body=STATIC["dashboard.html"][0], content_type="text/html", charset="utf-8",
                            headers=PAGE_HEADERS)

    async def _dashboard(self, request: web.Request) -> web.Response:
        return web.json_response(self.node.recorder.view(), dumps=_dumps)

    async def _static(self, request: web.Request) -> web.Response:
        item = STATIC.get(request.match_info["name"])
        if item is None:
            return web.json_response({"error": "no such file"}, status=404)
        body, content_type = item
        return web.Response(body=body, content_type=content_type, charset="utf-8",
                            headers={"Cache-Control": "max-age=3600", **PAGE_HEADERS})


def _deeper_than(value, limit: int) -> bool:
    """Whether parsed JSON nests lists/maps more than ``limit`` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _host_name(host: str) -> str:
    """The name part of a Host header, lower case: 'Example:80' -> 'example', '[::1]:8470' -> '[::1]'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else ""
    return host.rpartition(":")[0] if ":" in host else host


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _json_default(obj):
    if isinstance(obj, bytes):
        return "base64:" + base64.b64encode(obj).decode()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def _dumps(obj) -> str:
    return json.dumps(obj, default=_json_default)
