"""The server extension's routes, all under ``/workbench`` and all authenticated.

    GET  /workbench/pools                         every live pool (from the state files)
    GET  /workbench/pools/<pool_id>               one pool, with its running cell's telemetry
    GET  /workbench/pools/<pool_id>/dashboard     live dashboard page (polls the route above)
    POST /workbench/pools/<pool_id>/<action>      start | stop | restart, in the owning kernel
    POST /workbench/kernels/<kernel_id>/<action>  the same for a kernel (e.g. no pool yet)
                                                  body: {"n": ranks (start), "wait": seconds}
    GET  /workbench/static/<name>                 the page's script and plotly.js (offline)

Every verb method carries ``@tornado.web.authenticated``;
``tests/playground/test_lab_server.py`` finds every route registered by this module in a real
server and checks that none answers without a token. Login is not permission: a server may let
users in who must not run code (a read-only Authorizer, a JupyterHub role), so every route that
touches a kernel's pool is also ``@authorized`` on jupyter_server's ``kernels`` resource, the
one its own kernel routes use: reading pools is ``read``, the actions, which run code in the
kernel, are ``execute`` (403 when the server's Authorizer refuses;
``tests/workbench/ui/test_lab_authorization.py``). Errors are JSON ``{"message": ...}`` with a
status: unknown pool or kernel 404, bad action or body 400, a pool that belongs to no kernel of
this server 409, the kernel refusing the action (e.g. "already running") 409, anything else it
raised 500.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.utils import url_path_join

from workbench.ui.lab import actions, state

HERE = Path(__file__).resolve().parent
ID = r"[^/]+"  # validated in the handlers, so a bad id gets a clear 404, not a bare one


def _plotly_js() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise tornado.web.HTTPError(404, "plotly is not installed on the server")
    return Path(spec.origin).parent / "package_data" / "plotly.min.js"


STATIC = {
    "dashboard.js": lambda: HERE / "static" / "dashboard.js",
    "plotly.min.js": _plotly_js,
}


class _PoolsBase(APIHandler):
    """Shared lookups: pool files, this server's kernels and their notebooks."""

    auth_resource = "kernels"  # what ``@authorized`` asks the server's Authorizer about

    async def _notebooks(self) -> dict[str, str]:
        sessions = await self.session_manager.list_sessions()
        return {s["kernel"]["id"]: s.get("path", "") for s in sessions if s.get("kernel")}

    def _kernel_here(self, kernel_id: str | None) -> bool:
        return bool(kernel_id) and kernel_id in self.kernel_manager.list_kernel_ids()

    async def _describe(self, doc: dict[str, Any],
                        notebooks: dict[str, str] | None = None) -> dict[str, Any]:
        notebooks = await self._notebooks() if notebooks is None else notebooks
        kid = doc.get("kernel_id")
        return {**doc, "notebook": notebooks.get(kid or ""),
                "kernel_here": self._kernel_here(kid)}

    def _pool(self, pool_id: str) -> dict[str, Any]:
        doc = state.read_pool(pool_id)
        if doc is None:
            raise tornado.web.HTTPError(404, f"unknown pool {pool_id!r} (no live pool has it)")
        return doc

    def _body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            body = json.loads(self.request.body)
        except ValueError:
            raise tornado.web.HTTPError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise tornado.web.HTTPError(400, "the request body must be a JSON object")
        return body

    async def _act(self, kernel_id: str, action: str) -> None:
        body = self._body()
        n, wait = body.get("n"), body.get("wait", 120)
        try:
            code = actions.action_code(action, n)
        except ValueError as err:
            raise tornado.web.HTTPError(400, str(err)) from None
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 < wait <= 600:
            raise tornado.web.HTTPError(400, f"wait={wait!r}: give seconds in (0, 600]")
        if not self._kernel_here(kernel_id):
            raise tornado.web.HTTPError(404, f"unknown kernel {kernel_id!r} on this server")
        kernel = self.kernel_manager.get_kernel(kernel_id)
        result = await actions.run_in_kernel(kernel, code, float(wait))
        reply = {"action": action, "kernel_id": kernel_id, "status": result.status,
                 "output": result.output, "error": result.error}
        if result.status == "error":
            usage = result.error.get("ename") == "UsageError"
            self.set_status(409 if usage else 500)
            reply["message"] = f"{action}: {result.error.get('ename')}: " \
                               f"{result.error.get('evalue')}"
        elif result.status == "pending":
            self.set_status(202)
        self.finish(json.dumps(reply))


class PoolsHandler(_PoolsBase):
    @tornado.web.authenticated
    @authorized("read")
    async def get(self) -> None:
        notebooks = await self._notebooks()
        pools = [await self._describe(doc, notebooks) for doc in state.read_pools()]
        self.finish(json.dumps({"pools": pools}))


class PoolHandler(_PoolsBase):
    @tornado.web.authenticated
    @authorized("read")
    async def get(self, pool_id: str) -> None:
        self.finish(json.dumps(await self._describe(self._pool(pool_id))))


class PoolActionHandler(_PoolsBase):
    @tornado.web.authenticated
    @authorized("execute")
    async def post(self, pool_id: str, action: str) -> None:
        if action not in actions.ACTIONS:
            raise tornado.web.HTTPError(
                400, f"unknown action {action!r}: use one of {', '.join(actions.ACTIONS)}")
        doc = self._pool(pool_id)
        kid = doc.get("kernel_id")
        if not self._kernel_here(kid):
            raise tornado.web.HTTPError(
                409, f"pool {pool_id} belongs to no kernel of this server (kernel {kid!r})")
        await self._act(kid, action)


class KernelActionHandler(_PoolsBase):
    @tornado.web.authenticated
    @authorized("execute")
    async def post(self, kernel_id: str, action: str) -> None:
        await self._act(kernel_id, action)


class DashboardHandler(JupyterHandler):
    """An HTML page (not JSON): unauthenticated GETs are redirected to the login page."""

    auth_resource = "kernels"

    @tornado.web.authenticated
    @authorized("read")
    def get(self, pool_id: str) -> None:
        if state.read_pool(pool_id) is None:
            raise tornado.web.HTTPError(404, f"unknown pool {pool_id!r}")
        page = (HERE / "static" / "dashboard.html").read_text()
        config = json.dumps({"baseUrl": self.base_url, "poolId": pool_id})
        page = page.replace("__CONFIG__", config.replace("<", "\\u003c"))
        page = page.replace("__STATIC__", html.escape(url_path_join(self.base_url,
                                                                    "workbench", "static")))
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(page)


class StaticHandler(JupyterHandler):
    """The dashboard page's scripts; plotly.js comes from the installed plotly package, since
    the page must work offline (no CDN)."""

    @tornado.web.authenticated
    def get(self, name: str) -> None:
        if name not in STATIC:
            raise tornado.web.HTTPError(404, f"no static file {name!r}")
        path = STATIC[name]()
        self.set_header("Content-Type", "application/javascript; charset=utf-8")
        self.set_header("Cache-Control", "private, max-age=3600")
        self.finish(path.read_bytes())


def routes(base_url: str) -> list[tuple[str, type[JupyterHandler]]]:
    def url(*parts: str) -> str:
        return url_path_join(base_url, "workbench", *parts)

    action = r"(?P<action>[^/]+)"
    return [
        (url("pools"), PoolsHandler),
        (url("pools", rf"(?P<pool_id>{ID})"), PoolHandler),
        (url("pools", rf"(?P<pool_id>{ID})", "dashboard"), DashboardHandler),
        (url("pools", rf"(?P<pool_id>{ID})", action), PoolActionHandler),
        (url("kernels", rf"(?P<kernel_id>{ID})", action), KernelActionHandler),
        (url("static", r"(?P<name>[^/]+)"), StaticHandler),
    ]


def setup_handlers(web_app: Any) -> list[tuple[str, type[JupyterHandler]]]:
    handlers = routes(web_app.settings["base_url"])
    web_app.add_handlers(".*$", handlers)
    return handlers
