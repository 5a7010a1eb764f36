"""The lab extension's routes ask the server's Authorizer, not only whether a user logged in.

What is protected: a jupyter_server may let in users who must not run code (a read-only
Authorizer, a JupyterHub role). Every ``/workbench`` route that touches a kernel's pool is
authorized on jupyter_server's ``kernels`` resource: an Authorizer that refuses ``kernels``
gets 403 on all of them, one that allows only ``read`` can list pools but not start, stop or
restart one (those run code in the kernel), and the default Authorizer reaches the handlers
(404 for the sample pool and kernel, which do not exist). An in-process server on loopback:
no kernel, engine or browser is started.
"""

from __future__ import annotations

import asyncio

import pytest
from jupyter_server.auth.authorizer import AllowAllAuthorizer, Authorizer
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from traitlets.config import Config

TOKEN = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
POOL, KERNEL = "0123456789ab", "00000000-0000-4000-8000-000000000000"
READS = [("GET", "/workbench/pools"), ("GET", f"/workbench/pools/{POOL}"),
         ("GET", f"/workbench/pools/{POOL}/dashboard")]
ACTIONS = [("POST", f"/workbench/pools/{POOL}/start"), ("POST", f"/workbench/pools/{POOL}/stop"),
           ("POST", f"/workbench/kernels/{KERNEL}/restart"),
           ("POST", f"/workbench/kernels/{KERNEL}/start")]


class DenyKernels(Authorizer):
    """Everything but the ``kernels`` resource."""

    def is_authorized(self, handler, user, action, resource) -> bool:
        return resource != "kernels"


class ReadOnlyKernels(Authorizer):
    """Kernels may be looked at, not driven."""

    def is_authorized(self, handler, user, action, resource) -> bool:
        return resource != "kernels" or action == "read"


AUTHORIZERS = (DenyKernels, ReadOnlyKernels, AllowAllAuthorizer)


@pytest.fixture(scope="module")
def statuses(tmp_path_factory) -> dict[str, dict[str, int]]:
    """Per Authorizer, each route's status (token sent) from one in-process server with the
    extension: the Authorizer is swapped between rounds, as handlers read it per request."""
    from jupyter_server.serverapp import ServerApp

    tmp = tmp_path_factory.mktemp("lab-auth")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_RUNTIME_DIR", str(tmp / "runtime"))
        app = ServerApp(jpserver_extensions={"workbench.ui.lab": True}, root_dir=str(tmp),
                        reraise_server_extension_failures=True,
                        config=Config({"IdentityProvider": {"token": TOKEN}}))
        app.initialize(argv=[], find_extensions=False, new_httpserver=False)
        return asyncio.run(_ask(app))


async def _ask(app) -> dict[str, dict[str, int]]:
    sockets = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(app.web_app)
    server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    client = AsyncHTTPClient(force_instance=True)
    out: dict[str, dict[str, int]] = {}
    try:
        for authorizer in AUTHORIZERS:
            app.web_app.settings["authorizer"] = authorizer(
                parent=app, identity_provider=app.identity_provider)
            out[authorizer.__name__] = seen = {}
            for method, path in READS + ACTIONS:
                r = await client.fetch(
                    f"http://127.0.0.1:{port}{path}", method=method, raise_error=False,
                    body="{}" if method == "POST" else None, follow_redirects=False,
                    headers={"Authorization": f"token {TOKEN}"}, request_timeout=60)
                seen[f"{method} {path}"] = r.code
    finally:
        client.close()
        server.stop()
    return out


@pytest.mark.parametrize(("authorizer", "reads", "actions"), [
    (DenyKernels, 403, 403),
    (ReadOnlyKernels, None, 403),
    (AllowAllAuthorizer, None, None),
])
def test_routes_ask_the_authorizer(statuses, authorizer, reads, actions) -> None:
    seen = statuses[authorizer.__name__]
    for (method, path), want in [(r, reads) for r in READS] + [(a, actions) for a in ACTIONS]:
        got = seen[f"{method} {path}"]
        if want is None:  # allowed: the handler itself answers (no such pool or kernel here)
            assert got in (200, 404), f"{authorizer.__name__}: {method} {path} -> {got}"
        else:
            assert got == want, f"{authorizer.__name__}: {method} {path} -> {got}, want {want}"
