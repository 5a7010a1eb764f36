"""``%colossal serve``: serve an engine built on the ranks over the OpenAI HTTP API.

    %colossal serve ENGINE [--port 8000] [--host 127.0.0.1] [--api-key K | --no-api-key]
                           [--model NAME] [--no-dashboard]
    %colossal serve --stop       drain the requests in flight, then stop
    %colossal serve --status     the endpoint, its requests and the engines' queue

Secure by default: bound to 127.0.0.1 (another address is an explicit ``--host``), and an API
key is required unless ``--no-api-key``; a generated key lives in a 0600 file in Jupyter's
runtime folder and is read with ``workbench.serving.api_key()``, never printed, since saved
notebooks keep their outputs. While it serves, the pool belongs to the server: other
``%%colossal`` cells get an error naming the endpoint. The cell that built the engine is
remembered, so after ``%colossal restart`` it runs again and serving resumes on the same port.
While it serves, a live dashboard under the cell (unless ``--no-dashboard``) and the lab's
sidebar and dashboard page show the endpoint (``display.py``).
"""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any

from IPython.core.error import UsageError

from workbench.errors import PoolError
from workbench.serving.display import ServingDisplay, sample_of
from workbench.serving.keys import new_key
from workbench.serving.options import add_limit_options, limit_settings
from workbench.serving.server import Server
from workbench.ui.dashboard.endpoint import EndpointHistory


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%colossal serve", add_help=False, exit_on_error=False)
    p.add_argument("engine", nargs="?", default=None,
                   help="the rank variable holding the Engine, built in a %%%%colossal cell")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but loopback exposes the endpoint")
    p.add_argument("--api-key", default=None,
                   help="the Bearer token clients must send (default: a new one, in a key "
                        "file read by workbench.serving.api_key())")
    p.add_argument("--no-api-key", action="store_true",
                   help="accept requests without a token")
    p.add_argument("--model", default=None, help="the model id clients name (default ENGINE)")
    p.add_argument("--no-dashboard", action="store_true",
                   help="no live dashboard under the cell (the lab still shows the endpoint)")
    p.add_argument("--stop", action="store_true", help="stop the endpoint")
    p.add_argument("--status", action="store_true",
                   help="the endpoint, its requests and the engines' queue")
    add_limit_options(p)
    return p


def serve_command(magics: Any, line: str) -> None:
    words = shlex.split(line)[1:]  # without "serve"
    try:
        args = _parser().parse_args(words)
    except (argparse.ArgumentError, SystemExit) as err:
        raise UsageError(f"%colossal serve: {err}; usage: %colossal serve ENGINE [--port P] "
                         "[--host H] [--api-key K | --no-api-key] | --stop | --status") from None
    server: Server | None = getattr(magics, "server", None)
    if args.stop:
        if server is None or not server.running:
            print("colossal: no endpoint is serving")
            return
        server.stop()
        display = getattr(magics, "serving_display", None)
        if display is not None:
            display.close()
        magics.server = magics.serving_display = None
        print(f"colossal: stopped serving {server.engine} at {server.url}")
        return
    if args.status:
        print(status_line(server, getattr(magics, "serving_display", None))
              if server is not None and server.running else "colossal: no endpoint is serving")
        return
    if server is not None and server.running:
        raise UsageError(f"already serving {server.engine} at {server.url}; stop it with "
                         "`%colossal serve --stop`")
    if args.engine is None or not args.engine.isidentifier():
        raise UsageError("%colossal serve ENGINE: name the rank variable holding the Engine, "
                         "e.g. `%colossal serve engine`")
    if magics.pool is None or not magics.pool.started:
        raise UsageError("no pool is running: start one with `%colossal start` and build the "
                         "engine in a %%colossal cell")
    if args.api_key and args.no_api_key:
        raise UsageError("--api-key and --no-api-key contradict each other")
    key, where = None, None
    if not args.no_api_key:
        key, where = new_key(args.port, args.api_key)
    server = Server(magics.pool, args.engine, model_id=args.model, host=args.host,
                    port=args.port, api_key=key, **limit_settings(args))
    server.max_inflight = args.max_inflight  # None: the app's default
    server.rebuild = _building_cell(magics, args.engine)
    try:
        server.start()
    except PoolError as err:
        server.stop()
        raise UsageError(str(err)) from None
    magics.server = server
    auth = f"API key in {where} (workbench.serving.api_key())" if key else \
        "no API key (--no-api-key): anyone who reaches the address can call it"
    exposed = "" if args.host in ("127.0.0.1", "localhost", "::1") else \
        f"; bound to {args.host}: reachable beyond this machine"
    print(f"colossal: serving {args.engine} at {server.url} (model {server.model_id!r}, "
          f"{server.replicas} replica{'s' if server.replicas > 1 else ''}); {auth}{exposed}; "
          f"{server.pacing()}. `%colossal serve --stop` drains and stops.")
    magics.serving_display = ServingDisplay(server, show=not args.no_dashboard).start()


def status_line(server: Server, display: ServingDisplay | None = None) -> str:
    """The endpoint's line, the title of its dashboard panel: the server's counts now, and
    requests/s from the display's samples (0 without them)."""
    endpoint = display.endpoint if display is not None else \
        EndpointHistory(server.url, server.engine, replicas=server.replicas)
    return f"colossal: {endpoint.line(sample_of(server))}"


def _building_cell(magics: Any, name: str) -> tuple[str, str] | None:
    """The last %%colossal cell that assigned ``name`` (its magic line and code)."""
    pattern = re.compile(rf"^\s*{re.escape(name)}\s*=[^=]", re.M)
    for line, cell in reversed(getattr(magics, "cells_run", [])):
        if pattern.search(cell):
            return line, cell
    return None


def guard_cell(magics: Any) -> None:
    """A %%colossal cell while the pool serves: refused, naming the endpoint."""
    server = getattr(magics, "server", None)
    if server is not None and server.running:
        raise UsageError(f"the pool is serving {server.engine} at {server.url}; its ranks run "
                         "the serving loop. Stop it first with `%colossal serve --stop`")


def resume_after_restart(magics: Any) -> None:
    """Run the cell that built the engine again on the restarted pool, and serve on."""
    server = getattr(magics, "server", None)
    if server is None or not server.running:
        return
    if server.rebuild is None:
        server.failure = (f"the pool restarted and the cell that built {server.engine} is not "
                          "known; build it again and run `%colossal serve --stop` then serve")
        print(f"colossal: {server.failure}")
        return
    line, cell = server.rebuild
    print(f"colossal: rebuilding {server.engine} for {server.url}")
    try:
        magics.run_cell_magic_unguarded(line, cell)
        server.resume()
    except Exception as err:
        server.failure = f"rebuilding {server.engine} after the restart failed: {err}"
        raise UsageError(server.failure) from None
    print(f"colossal: serving {server.engine} at {server.url} again")
