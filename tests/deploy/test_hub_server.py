"""The playground end to end: a real JupyterHub started from deploy/jupyterhub/jupyterhub_config.py
(dummy authenticator, the device-sharing local spawner, two fake GPUs "0" and "1",
configurable-http-proxy from npm, jupyterhub-idle-culler as a service). `make test-hub`.

What is protected:
- two users log in through the hub's login form and REST API, each gets a server with our lab
  extension enabled (front end listed in the lab page, server routes answering), on a different
  device (CUDA_VISIBLE_DEVICES in the kernel and in the ranks), and a third user asking for a
  GPU while both are held is refused with a message saying who holds them;
- each runs the quickstart notebook's cells through the hub's proxy over the Jupyter REST +
  websocket kernel API, concurrently, and gets its outputs;
- user A's token opens nothing of B's: B's server, kernels and pool routes answer 403; B's pool
  controller listens on 127.0.0.1 only and ignores a client without B's key; B's serving
  endpoint (``%colossal serve``) listens on 127.0.0.1 only and answers 401 without B's API key;
- in Chromium, a user logs in through the hub's login page, starts a profile from the spawn
  form, lands in the lab on the quickstart and sees the Colossal sidebar listing their server's
  pools (screenshots in artifacts/browser/hub-*.png);
- stopping a server (A, by API) and culling an idle one (B, by the culler) leave no process of
  that server behind, ranks included, and return the device.
"""

from __future__ import annotations

import ast
import json
import re
import threading
from pathlib import Path

import nbformat
import psutil
import pytest
import requests
from hub_session import PASSWORD, ROOT, Hub, Kernel, User

pytestmark = pytest.mark.hub

# Long enough for the tests that use bob's server (it is busy in each, which counts as activity),
# short enough to wait for. The tests between the last use and the culler test may take longer
# than this: the culler test accepts a server already culled when it starts.
CULL_TIMEOUT_S = 30
QUICKSTART = ROOT / "notebooks" / "00_quickstart.ipynb"


def server_processes(hub: Hub, name: str) -> list[psutil.Process]:
    """Every live process started for ``name``'s server: they carry its JUPYTERHUB_USER and
    this hub's API URL in their environment (ranks inherit it), wherever they were reparented."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        ours = env.get("JUPYTERHUB_API_URL", "").startswith(hub.api_url)
        if ours and env.get("JUPYTERHUB_USER") == name:
            found.append(proc)
    return found


def wait_gone(procs: list[psutil.Process], timeout_s: float = 30.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Hub:
    workdir = tmp_path_factory.mktemp("hub")
    hub = Hub(workdir, devices="0,1", env={
        "WORKBENCH_HUB_CULL_TIMEOUT": str(CULL_TIMEOUT_S), "WORKBENCH_HUB_CULL_EVERY": "5"})
    hub.start()
    hub.kernels = {}  # user -> the kernel that ran the quickstart (its pool still running)
    hub.processes = {}  # user -> the processes of their server, read while it ran
    yield hub
    hub.stop()
    assert not wait_gone(server_processes(hub, "alice") + server_processes(hub, "bob")
                         + server_processes(hub, "carol") + server_processes(hub, "dave"), 30)


@pytest.fixture(scope="module")
def users(hub) -> dict[str, User]:
    """alice and bob logged in, each with a running server of the "1 GPU" profile."""
    alice, bob = hub.login("alice"), hub.login("bob")
    for user in (alice, bob):
        r = user.start_server("gpu-1")
        assert r.status_code in (201, 202), (r.status_code, r.text, hub.tail())
    for user in (alice, bob):
        user.wait_ready()
    return {"alice": alice, "bob": bob}


def test_each_user_gets_a_server_with_the_lab_extension_and_its_own_device(hub, users):
    devices = {}
    for name, user in users.items():
        page = user.request("GET", f"/user/{name}/lab")
        assert page.status_code == 200, page.status_code
        config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>',
                                      page.text, re.S).group(1))
        assert "colossal-workbench" in {e["name"] for e in config["federated_extensions"]}
        assert not any("colossal" in d for d in config.get("disabledExtensions", []))
        pools = user.request("GET", f"/user/{name}/workbench/pools")  # the server extension
        assert pools.status_code == 200 and pools.json() == {"pools": []}, pools.text
        kernel = Kernel(user)
        out, errors = kernel.execute("import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']),"
                                     " os.environ['WORKBENCH_PROFILE'], os.getcwd())")
        kernel.shutdown()
        assert not errors, errors
        device, profile, cwd = out.split()
        assert profile == "gpu-1" and Path(cwd) == hub.workdir / "homes" / name
        assert (Path(cwd) / "notebooks" / QUICKSTART.name).exists()  # copied into each home
        devices[name] = ast.literal_eval(device)
    assert sorted(devices.values()) == ["0", "1"], devices
    hub.devices = devices

    carol = hub.login("carol")
    r = carol.start_server("gpu-1")
    assert r.status_code == 409, (r.status_code, r.text)
    message = r.json()["message"]
    assert "needs 1, 0 are free" in message and "alice" in message and "bob" in message
    r = carol.start_server("gpu-8")
    assert r.status_code == 400 and "needs 8 GPUs but this server has 2" in r.json()["message"]


def quickstart_cells() -> list[str]:
    """The quickstart's code cells up to (not including) its closing ``%colossal stop``: the
    pool must still run when the isolation and stop tests look at it."""
    cells = [c.source for c in nbformat.read(QUICKSTART, as_version=4).cells
             if c.cell_type == "code"]
    assert "%colossal stop" in cells[-1], cells[-1]
    return cells[:-1]


# bob's pool serves a tiny random GPT-2 over the OpenAI-compatible endpoint (09_serving's way)
SERVE = """%%colossal
from transformers import GPT2Config, GPT2LMHeadModel

from kernels_runtime.data import ByteTokenizer
from kernels_runtime.inference import Engine

torch.manual_seed(0)
tiny = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0))
engine = Engine(tiny, "dp=1", comm=comm, tokenizer=ByteTokenizer(), kv_mem="1MiB",
                max_num_seqs=4, verbose=False)
"""
SERVE_START = """from workbench import free_port
PORT = free_port()
%colossal serve engine --port {PORT}
"""
SERVE_ASK = """import urllib.request, workbench.serving
request = urllib.request.Request(
    f"http://127.0.0.1:{PORT}/v1/models",
    headers={"Authorization": f"Bearer {workbench.serving.api_key(PORT)}"})
print("bob's own key:", urllib.request.urlopen(request, timeout=30).status, "port", PORT)
"""

RANK_ENV = """%%colossal
import os
print(f"rank {rank} sees CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
"""


def test_each_user_runs_the_quickstart_through_the_proxy(hub, users):
    results: dict[str, tuple[str, list]] = {}
    ranks_device: dict[str, str] = {}

    def run(user: User) -> None:
        kernel = Kernel(user)
        hub.kernels[user.name] = kernel.id  # its pool stays up for the tests below
        outputs, errors = [], []
        try:
            for cell in [*quickstart_cells(), RANK_ENV]:
                out, err = kernel.execute(cell, timeout_s=240)
                outputs.append(out)
                errors += err
                if err:
                    break
        finally:
            kernel.close()
        results[user.name] = ("\n".join(outputs), errors)

    threads = [threading.Thread(target=run, args=(u,)) for u in users.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=400)
    for name in users:
        out, errors = results[name]
        assert not errors, (name, errors, out[-2000:])
        assert "rank 0 of 1: [1.0, 1.0, 1.0]" in out, out[-2000:]  # "1 GPU": one rank
        assert re.search(r"loss went from [\d.]+ to [\d.]+ in 60 steps", out), out[-2000:]
        assert "trained 60 more steps" in out, out[-2000:]
        # the rank got its server's device, no other
        ranks_device[name] = re.search(r"rank 0 sees CUDA_VISIBLE_DEVICES='(\d)'", out)[1]
    assert sorted(ranks_device.values()) == ["0", "1"], ranks_device
    assert ranks_device == hub.devices, (ranks_device, hub.devices)
    for name in users:
        hub.processes[name] = server_processes(hub, name)


def controller_of(hub: Hub, name: str) -> list[psutil.Process]:
    """The processes of ``name``'s pool controller (ipyparallel forks its schedulers)."""
    procs = [p for p in server_processes(hub, name) if "ipyparallel.controller" in p.cmdline()]
    roots = [p for p in procs if p.ppid() not in {q.pid for q in procs}]
    assert len(roots) == 1, "\n".join(" ".join(p.cmdline()) for p in server_processes(hub, name))
    return procs


def listening(procs: list[psutil.Process]) -> set[str]:
    """The addresses any of ``procs`` listens on (TCP)."""
    return {f"{c.laddr.ip}:{c.laddr.port}" for p in procs
            for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_a_users_token_reaches_nothing_of_another_users(hub, users):
    import ipyparallel as ipp

    alice, bob = users["alice"], users["bob"]
    kernel = Kernel(bob, hub.kernels["bob"])  # the quickstart's kernel, its pool running
    try:
        for cell in (SERVE, SERVE_START, SERVE_ASK):
            out, errors = kernel.execute(cell, timeout_s=120)
            assert not errors, (errors, out)
    finally:
        kernel.close()
    port = int(re.search(r"bob's own key: 200 port (\d+)", out).group(1))
    # the endpoint answers bob's key only: without it, or with another, 401
    for headers in ({}, {"Authorization": f"Bearer {alice.token}"},
                    {"Authorization": "Bearer sk-not-bobs"}):
        r = requests.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.status_code, r.text[:300])
    # through the hub: alice's token stops at bob's server; bob's own finds no route to the
    # port (no jupyter-server-proxy), or the endpoint's own key check if one is installed
    r = alice.request("GET", f"/user/bob/proxy/{port}/v1/models")
    assert r.status_code in (403, 404), r.status_code
    r = bob.request("GET", f"/user/bob/proxy/{port}/v1/models")
    assert r.status_code in (401, 404), r.status_code
    # A running endpoint keeps bob's server from looking idle (seen: not culled 105 s after a
    # 45 s timeout), so it is stopped here: the culling test is about an idle pool.
    kernel = Kernel(bob, hub.kernels["bob"])
    try:
        out, errors = kernel.execute("%colossal serve --stop", timeout_s=120)
        assert not errors, (errors, out)
    finally:
        kernel.close()

    for path in ("/user/bob/api/status", "/user/bob/api/kernels", "/user/bob/workbench/pools",
                 "/user/bob/lab"):
        r = alice.request("GET", path)
        assert r.status_code == 403 or (r.status_code == 302 and "/hub/" in
                                         r.headers["location"]), (path, r.status_code)
        assert bob.request("GET", path).status_code == 200, path
    assert alice.request("GET", "/hub/api/users/bob").status_code in (403, 404)
    assert alice.request("DELETE", "/hub/api/users/bob/server").status_code in (403, 404)

    # bob's pool controller: only on the loopback interface, and deaf to a client without
    # bob's key (on a real hub the key file is bob's, mode 0600; here all users share one
    # Unix account, so the test reads it to forge a client with another key)
    # (every process of bob's server, the controller and the ranks included, listens on the
    # loopback interface only: nothing of it is reachable from another machine)
    assert listening(controller_of(hub, "bob"))
    everything = listening(server_processes(hub, "bob"))
    assert everything and all(a.startswith("127.0.0.1:") for a in everything), everything
    client_files = list((hub.workdir / "homes" / "bob").rglob("ipcontroller-*client.json"))
    assert len(client_files) == 1, client_files
    info = json.loads(client_files[0].read_text())
    assert info["key"]
    forged = hub.workdir / "forged-client.json"
    forged.write_text(json.dumps({**info, "key": "0" * 64}))
    with pytest.raises(Exception, match="(?i)timed out|timeout"):
        ipp.Client(str(forged), timeout=5)
    genuine = ipp.Client(str(client_files[0]), timeout=30)  # the same ports with bob's key
    assert len(genuine.ids) == 1
    genuine.close()
    hub.processes["bob"] = server_processes(hub, "bob")  # now with the serving endpoint
    # what the culler must end (read now: bob's server may be culled before the culler test)
    assert any("ipyparallel.controller" in " ".join(p.cmdline()) for p in hub.processes["bob"])


def test_stopping_a_server_leaves_no_process_and_frees_its_device(hub, users):
    alice = users["alice"]
    procs = server_processes(hub, "alice")
    assert len(procs) >= 4, [p.cmdline() for p in procs]  # server, kernel, controller, rank
    r = alice.request("DELETE", "/hub/api/users/alice/server")
    assert r.status_code in (202, 204), r.text
    alice.wait_stopped()
    alive = wait_gone(procs)
    assert not alive, [p.cmdline() for p in alive]
    assert not server_processes(hub, "alice")

    carol = hub.login("carol")  # alice's device is free again
    r = carol.start_server("gpu-1")
    assert r.status_code in (201, 202), (r.status_code, r.text)
    carol.wait_ready()
    carol.request("DELETE", "/hub/api/users/carol/server")
    carol.wait_stopped()


def test_a_user_logs_in_through_the_browser_and_sees_the_colossal_sidebar(hub, users):
    """The playground as a person meets it: Chromium opens the hub's login page, logs in as
    dave, starts the default profile from the spawn form, lands in the lab on the quickstart,
    and opens the Colossal sidebar, whose pool list comes from dave's server through the proxy.
    Runs while bob's server sits idle for the culler test below."""
    from helpers.browser import ARTIFACTS, CHROMIUM, LAUNCH_ARGS, MS, require_browser

    require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # no "Jupyter news" prompt over the screenshot: dave's own lab setting, in his home
    news = (hub.workdir / "homes" / "dave" / ".jupyter" / "lab" / "user-settings" / "@jupyterlab"
            / "apputils-extension" / "notification.jupyterlab-settings")
    news.parent.mkdir(parents=True, exist_ok=True)
    news.write_text(json.dumps({"fetchNews": "false"}))
    console: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
        page = browser.new_context(viewport={"width": 1500, "height": 950}).new_page()
        page.set_default_timeout(90 * MS)  # a server's first start on a loaded 2-core machine
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        try:
            page.goto(f"{hub.url}/hub/login")
            page.fill("#username_input", "dave")
            page.fill("#password_input", PASSWORD)
            page.click("#login_submit")
            form = page.locator("#spawn_form")  # the profiles, CPU checked (no GPU needed)
            form.wait_for()
            assert form.locator("input[name=profile][value=cpu]").is_checked()
            assert "1 GPU" in form.inner_text() and "8 GPUs" in form.inner_text()
            page.screenshot(path=str(ARTIFACTS / "hub-1-spawn-form.png"))
            form.locator("button[type=submit]").click()
            page.wait_for_url("**/user/dave/lab/tree/notebooks/00_quickstart.ipynb",
                              timeout=180 * MS)
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
            page.click(".jp-SideBar.jp-mod-left "
                       ".lm-TabBar-tab[data-id='colossal-workbench-sidebar']")
            sidebar = page.locator("#colossal-workbench-sidebar")
            sidebar.locator(".jp-Colossal-active", has_text="00_quickstart.ipynb").wait_for()
            sidebar.locator(".jp-Colossal-empty").wait_for()  # dave's pool list: none yet
            assert sidebar.locator(".jp-Colossal-error").count() == 0, sidebar.inner_text()
            page.screenshot(path=str(ARTIFACTS / "hub-2-lab-with-sidebar.png"))
        except BaseException as err:
            page.screenshot(path=str(ARTIFACTS / "hub-failure.png"))
            raise AssertionError(f"{err}\n--- browser console ---\n" + "\n".join(console[-30:])
                                 + f"\n--- hub log ---\n{hub.tail(30)}") from err
        finally:
            browser.close()
    dave = hub.login("dave")
    assert dave.model()["servers"][""]["user_options"] == {"profile": "cpu"}
    assert dave.request("DELETE", "/hub/api/users/dave/server").status_code in (202, 204)
    dave.wait_stopped()


def test_the_culler_stops_an_idle_server_and_its_pool(hub, users):
    """Bob's server with its pool (read in the test above) is stopped by the culler alone,
    during this test or already during the ones before it (under load they take longer than
    the idle timeout)."""
    bob = users["bob"]
    procs = hub.processes["bob"]  # the pool controller among them (asserted when read)
    bob.wait_stopped(timeout_s=CULL_TIMEOUT_S + 60)  # nobody stops it but the culler
    assert "idle-culler" in hub.log.read_text() and "Culling server bob" in hub.log.read_text()
    alive = wait_gone(procs)
    assert not alive, [p.cmdline() for p in alive]
