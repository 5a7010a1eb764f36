"""The JupyterLab server extension in a real server started by ``workbench lab``.

What is protected:
- no route of the extension answers without credentials. The routes are found by
  introspection (every handler from ``workbench.*`` registered on a server that loaded the
  extension), so a new route is checked without touching this file; a route with a path
  parameter this file has no sample for fails loudly;
- with the token, every route works and errors are JSON with the right status;
- the actions drive a real pool in a real kernel: start from a kernel with no pool, the pool's
  state file reaches the server (2 ranks, busy while a cell runs, telemetry growing during the
  cell), restart keeps the pool, stop marks it stopped, and a kernel that ends takes it along.
"""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import pytest
import tornado.web

from helpers.jupyter import LabServer, start_lab, stop_lab

pytestmark = pytest.mark.engines

# A sample value for every path parameter of the extension's routes.
SAMPLES = {
    "pool_id": "0123456789ab",  # well-formed, belongs to no pool
    "kernel_id": "00000000-0000-4000-8000-000000000000",
    "action": "start",
    "name": "plotly.min.js",
}
GROUP = re.compile(r"\(\?P<(?P<name>\w+)>[^)]*\)")


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> LabServer:
    server = start_lab(tmp_path_factory.mktemp("lab"))
    yield server
    stop_lab(server)


def extension_routes(tmp_path: Path, monkeypatch) -> list[tuple[str, type]]:
    """(sample path, handler class) for every route the extension registers, read from the
    tornado application of an in-process server that loaded it. Also fails on any
    JupyterServerAuthWarning (an unprotected handler), as the extension template's check."""
    from jupyter_server.serverapp import ServerApp
    from jupyter_server.utils import JupyterServerAuthWarning

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    app = ServerApp(jpserver_extensions={"workbench.ui.lab": True},
                    allow_unauthenticated_access=False, reraise_server_extension_failures=True,
                    root_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        app.initialize(argv=[], find_extensions=False, new_httpserver=False)
    unprotected = [str(r.message) for r in records
                   if issubclass(r.category, JupyterServerAuthWarning)]
    assert not unprotected, unprotected

    found = []

    def walk(rules):
        for rule in rules:
            target = rule.target
            if hasattr(target, "rules"):
                walk(target.rules)
            elif isinstance(target, type) and target.__module__.startswith("workbench."):
                found.append((rule.matcher.regex.pattern, target))

    walk(app.web_app.default_router.rules)
    routes = []
    for pattern, handler in found:
        missing = {m["name"] for m in GROUP.finditer(pattern)} - set(SAMPLES)
        assert not missing, f"route {pattern}: add sample values for {missing} to SAMPLES"
        path = GROUP.sub(lambda m: SAMPLES[m["name"]], pattern).rstrip("$")
        assert re.fullmatch(pattern, path), (pattern, path)
        routes.append((path, handler))
    return routes


def _implements(handler: type, method: str) -> bool:
    return getattr(handler, method.lower()) is not getattr(tornado.web.RequestHandler,
                                                           method.lower())


def test_no_route_answers_without_credentials(lab, tmp_path, monkeypatch):
    routes = extension_routes(tmp_path, monkeypatch)
    assert len(routes) >= 6, routes
    problems = []
    for path, handler in routes:
        for method in ("GET", "POST"):
            r = lab.request(method, path, body={} if method == "POST" else None, token=False)
            login = r.status == 302 and "/login" in r.headers.get("location", "")
            refused = r.status in (401, 403) or login
            if not (refused or (r.status == 405 and not _implements(handler, method))):
                problems.append(f"{method} {path} ({handler.__name__}) -> {r.status}")
    assert not problems, "answered without a token:\n" + "\n".join(problems)


def test_every_route_works_with_the_token(lab):
    r = lab.request("GET", "/workbench/pools")
    assert r.status == 200 and r.json() == {"pools": []}
    for path in ("/workbench/pools/0123456789ab", "/workbench/pools/not-an-id",
                 "/workbench/pools/0123456789ab/dashboard"):
        assert lab.request("GET", path).status == 404, path
    r = lab.request("GET", "/workbench/pools/0123456789ab")
    assert "unknown pool" in r.json()["message"]
    r = lab.request("GET", "/workbench/static/plotly.min.js")
    assert r.status == 200 and b"plotly" in r.body[:2000] and len(r.body) > 1_000_000
    assert lab.request("GET", "/workbench/static/dashboard.js").status == 200
    assert lab.request("GET", "/workbench/static/secrets.txt").status == 404

    r = lab.request("POST", "/workbench/pools/0123456789ab/start", {})
    assert r.status == 404 and "unknown pool" in r.json()["message"]
    r = lab.request("POST", "/workbench/pools/0123456789ab/explode", {})
    assert r.status == 400 and "unknown action 'explode'" in r.json()["message"]
    r = lab.request("POST", f"/workbench/kernels/{SAMPLES['kernel_id']}/stop", {})
    assert r.status == 404 and "unknown kernel" in r.json()["message"]
    r = lab.request("POST", f"/workbench/kernels/{SAMPLES['kernel_id']}/start", {"n": "two"})
    assert r.status == 400 and "n='two'" in r.json()["message"]


def _pool(lab: LabServer, pool_id: str) -> dict:
    r = lab.request("GET", f"/workbench/pools/{pool_id}")
    assert r.status == 200, r.body
    return r.json()


def _wait(lab: LabServer, pool_id: str, ok, what: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        doc = _pool(lab, pool_id)
        if ok(doc):
            return doc
        assert time.monotonic() < deadline, f"waiting for {what}; last: {doc}"
        time.sleep(0.1)


CELL = """%%colossal
import time
for step in range(24):
    with session.telemetry.step(tokens=64, samples=8):
        time.sleep(0.15)
"""


def test_actions_drive_a_real_pool_in_a_kernel(lab):
    from jupyter_client import BlockingKernelClient

    kid = lab.request("POST", "/api/kernels", {"name": "python3"}).json()["id"]
    r = lab.request("POST", f"/workbench/kernels/{kid}/start", {"n": 2})
    assert r.status == 200, r.body
    assert r.json()["status"] == "ok" and "2 ranks" in r.json()["output"]

    pools = lab.request("GET", "/workbench/pools").json()["pools"]
    assert len(pools) == 1
    pool = pools[0]
    assert pool["kernel_id"] == kid and pool["kernel_here"] and pool["state"] == "running"
    assert [r["rank"] for r in pool["ranks"]] == [0, 1] and pool["world_size"] == 2
    for row in pool["ranks"]:
        assert row["device"] == "cpu" and row["state"] == "idle"
        assert row["memory"]["host"] > 10 * 2**20 and set(row["memory"]) == {
            "device", "host", "disk"}
    pid = pool["id"]
    page = lab.request("GET", f"/workbench/pools/{pid}/dashboard")
    assert page.status == 200 and b"plotly.min.js" in page.body and pid.encode() in page.body

    # a cell with telemetry, run from a second client of the same kernel
    kc = BlockingKernelClient(connection_file=str(lab.runtime_dir / f"kernel-{kid}.json"))
    kc.load_connection_file()
    kc.start_channels()
    try:
        msg_id = kc.execute(CELL)
        busy = _wait(lab, pid, lambda d: d["state"] == "busy" and d["cell"]["points"] >= 1,
                     "the cell's first telemetry")
        assert {r["state"] for r in busy["ranks"]} == {"busy"} and busy["cell"]["running"]
        later = _wait(lab, pid, lambda d: d["cell"]["points"] > busy["cell"]["points"],
                      "more telemetry while the cell runs")
        assert later["state"] == "busy", "the series must grow while the cell is running"
        reply = kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
    done = _wait(lab, pid, lambda d: d["state"] == "running", "the end of the cell")
    cell = done["cell"]
    assert not cell["running"] and cell["label"] == "import time"
    assert set(cell["series"]["tokens_per_s"]) == {"0", "1"}
    assert cell["latest"]["0"]["steps"] >= 20 and max(cell["series"]["tokens_per_s"]["0"]) > 0

    r = lab.request("POST", f"/workbench/pools/{pid}/start", {})
    assert r.status == 409 and "already running" in r.json()["message"]
    old_pids = {row["pid"] for row in done["ranks"]}
    r = lab.request("POST", f"/workbench/pools/{pid}/restart", {})
    assert r.status == 200 and r.json()["status"] == "ok", r.body
    restarted = _pool(lab, pid)
    assert restarted["state"] == "running" and len(restarted["ranks"]) == 2
    assert old_pids.isdisjoint(row["pid"] for row in restarted["ranks"])
    r = lab.request("POST", f"/workbench/pools/{pid}/stop", {})
    assert r.status == 200 and "pool stopped" in r.json()["output"]
    stopped = _pool(lab, pid)
    assert stopped["state"] == "stopped" and stopped["ranks"] == []

    assert lab.request("DELETE", f"/api/kernels/{kid}").status == 204
    deadline = time.monotonic() + 20
    while lab.request("GET", "/workbench/pools").json()["pools"]:
        assert time.monotonic() < deadline, "the ended kernel's pool is still listed"
        time.sleep(0.2)
