"""``%colossal serve``: an engine built on a real 2-rank pool (tp=2) served over HTTP on
loopback, called with the official ``openai`` client and plain HTTP.

Greedy completions and chat completions, streamed and not, equal ``engine.generate`` on the
same prompts; keys, malformed bodies and unsupported parameters get OpenAI-style errors;
``/metrics`` parses as Prometheus text and counts what was sent (a speculative request's
drafts included); the dashboard under the serve
cell and the lab's pool-state file follow the endpoint while clients call (in flight, KV
blocks, the serving replica's inference panel, the requests /metrics counts) and drop it
after ``--stop``; a client that disconnects
mid-stream frees its blocks; ``--stop`` lets 8 running streams finish; a SIGKILLed rank makes
the endpoint answer 503 naming the rank, and after ``%colossal restart`` the same client works.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from IPython.core.error import UsageError

pytestmark = pytest.mark.engines
BUILD = (
    "import sys; sys.path.insert(0, 'tests')\n"
    "from helpers import inference as inf\n"
    "from kernels_runtime.data.corpus import ByteTokenizer\n"
    "from kernels_runtime.inference import Engine\n"
    "engine = Engine(inf.load('gpt2', weights), 'tp=2', comm=comm, tokenizer=ByteTokenizer(),"
    " kv_mem='1MiB', verbose=False)\n")
PROMPTS = ["def __init__(self", "import ", "    for name in "]
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "A loop:"}]


@pytest.fixture(scope="module")
def served(shell, trained):
    """The engine, what engine.generate gives for the test's prompts, and a running endpoint."""
    from workbench.serving.server import free_port

    shell.user_ns["weights"] = trained["gpt2"]
    shell.run_cell_magic("colossal", "--push weights --no-dashboard", BUILD)
    shell.run_cell_magic("colossal", "--no-dashboard --pull expected,expected_chat", (
        "from kernels_runtime.inference import SamplingParams\n"
        "from kernels_runtime.inference.chat import chat_prompt\n"
        f"greedy = SamplingParams(max_new_tokens=24)\n"
        f"expected = [o.text for o in engine.generate({PROMPTS!r}, greedy)]\n"
        f"expected_chat = engine.generate(chat_prompt(engine.tokenizer, {CHAT!r}), "
        "greedy)[0].text\n"))
    port = free_port()
    shell.run_line_magic("colossal", f"serve engine --port {port}")
    from workbench.serving import api_key

    yield {"port": port, "key": api_key(port), "url": f"http://127.0.0.1:{port}",
           "expected": shell.user_ns["expected"], "expected_chat": shell.user_ns["expected_chat"]}
    shell.run_line_magic("colossal", "serve --stop")


def _client(served, key=None):
    from openai import OpenAI

    return OpenAI(base_url=served["url"] + "/v1", api_key=key or served["key"], max_retries=0)


def test_completions_and_chat_equal_engine_generate(served):
    client = _client(served)
    for prompt, expected in zip(PROMPTS, served["expected"]):
        plain = client.completions.create(model="engine", prompt=prompt, max_tokens=24,
                                          temperature=0)
        assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "length"
        assert plain.usage.completion_tokens == 24
        streamed = client.completions.create(model="engine", prompt=prompt, max_tokens=24,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == expected
    chat = client.chat.completions.create(model="engine", messages=CHAT, max_tokens=24,
                                          temperature=0)
    assert chat.choices[0].message.content == served["expected_chat"]
    chunks = list(client.chat.completions.create(model="engine", messages=CHAT, max_tokens=24,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == served["expected_chat"]
    assert [m.id for m in client.models.list().data] == ["engine"]


def test_keys_bodies_and_unsupported_parameters_get_openai_errors(served):
    import openai

    with pytest.raises(openai.AuthenticationError):
        _client(served, key="wrong").models.list()
    missing = httpx.post(served["url"] + "/v1/completions", json={"model": "engine",
                                                                  "prompt": "x"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served["url"] + "/health").json()["status"] == "ok"
    headers = {"Authorization": f"Bearer {served['key']}"}
    bad_json = httpx.post(served["url"] + "/v1/completions", headers=headers,
                          content=b"{not json")
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    client = _client(served)
    for params, named in ((dict(n=2), "n"), (dict(logprobs=3), "logprobs"),
                          (dict(extra_body={"tools": [{"type": "function"}]}), "tools"),
                          (dict(extra_body={"colour": "red"}), "colour"),
                          (dict(temperature=7), "temperature"), (dict(top_p=0), "top_p")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="engine", prompt="x", **params)
        assert err.value.body["param"] == named and named in err.value.body["message"], params
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context holds 256"):
        client.completions.create(model="engine", prompt="x" * 300, max_tokens=4)


def test_metrics_parse_and_count_what_was_sent(served):
    from prometheus_client.parser import text_string_to_metric_families

    def read() -> dict:
        text = httpx.get(served["url"] + "/metrics",
                         headers={"Authorization": f"Bearer {served['key']}"}).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    ok = ("workbench_requests_total", (("route", "/v1/completions"), ("status", "200")))
    before = read()
    client = _client(served)
    made = [client.completions.create(model="engine", prompt=p, max_tokens=n, temperature=0)
            for p, n in zip(PROMPTS, (5, 9, 13))]
    after = read()
    assert after[ok] - before.get(ok, 0) == 3
    generated = ("workbench_generation_tokens_total", ())
    assert after[generated] - before.get(generated, 0) == sum(m.usage.completion_tokens
                                                              for m in made) == 27
    prompt = ("workbench_prompt_tokens_total", ())
    assert after[prompt] - before.get(prompt, 0) == sum(m.usage.prompt_tokens for m in made)
    assert after[("workbench_time_to_first_token_seconds_count", ())] >= 3

    # a speculative request (our body field): the greedy text unchanged, its drafts counted
    spec = client.completions.create(model="engine", prompt=PROMPTS[0], max_tokens=24,
                                     temperature=0, extra_body={"speculate": 4})
    assert spec.choices[0].text == served["expected"][0]
    drafted, accepted = ("workbench_spec_draft_tokens_total", ()), \
        ("workbench_spec_accepted_tokens_total", ())
    deadline = time.monotonic() + 10  # the endpoint reads the ranks' telemetry every 0.2 s
    while (now := read())[drafted] == after[drafted] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now[drafted] > after[drafted] and now[accepted] <= now[drafted]
    assert 0 <= now[("workbench_spec_acceptance_rate", ())] <= 1


def test_the_dashboard_and_the_lab_file_follow_the_endpoint(shell, served, tmp_path,
                                                          monkeypatch, capsys):
    """While 4 clients stream: the dashboard shown under the serve cell (fed by its display
    thread, no cell running) and the pool-state file's endpoint block show requests in flight
    and KV blocks in use, and the serving replica's inference panel; once they are done, the
    requests the endpoint counted are /metrics' own, and ``--status`` says so."""
    from prometheus_client.parser import text_string_to_metric_families

    from workbench.ui.lab.state import read_pool

    magics = shell.magics_manager.registry["ColossalMagics"]
    display, state = magics.serving_display, magics.pool.state
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(state, "enabled", True)
    texts: list[str] = []
    stop = threading.Event()

    def keep_streaming(prompt: str) -> None:  # until the test has seen what it needs
        while not stop.is_set():
            _stream(served, prompt, 40, texts)

    def serving(docs: list[dict]) -> list[dict]:
        return [d for d in docs if d["endpoint"] and d["endpoint"]["in_flight"] > 0
                and d["endpoint"]["kv_used"] > 0]

    clients = [threading.Thread(target=keep_streaming, args=(PROMPTS[i % 3],))
               for i in range(4)]
    for t in clients:
        t.start()
    files, figures = [], []
    deadline = time.monotonic() + 60  # the state file and the figure follow at ~1 Hz
    try:
        while time.monotonic() < deadline and not (
                serving(files) and max(max(y, default=0) for y in figures) > 0):
            doc = read_pool(state.pool_id) if state.path is not None else None
            if doc is not None:
                files.append(doc)
            figures.append(display.view.endpoint_figure.data[2].y)  # "endpoint: in flight"
            time.sleep(0.1)
    finally:
        stop.set()
        for t in clients:
            t.join(60)
    assert len(texts) >= 4 and not any(t.is_alive() for t in clients)
    url = f"{served['url']}/v1"
    assert serving(files), [d["endpoint"] for d in files][-5:]
    doc = serving(files)[-1]
    assert doc["endpoint"]["url"] == url and doc["endpoint"]["status"] == "serving"
    assert doc["cell"]["label"] == f"serving engine at {url}" and doc["cell"]["running"]
    assert {r["state"] for r in doc["ranks"]} == {"busy"}
    panel = {t["name"]: t for t in doc["cell"]["inference"]["traces"]}
    assert panel["KV blocks: free"]["x"] == ["replica 0"]  # tp=2: one replica, counted once
    assert max(max(y, default=0) for y in figures) > 0  # the figure under the cell moved

    text = httpx.get(served["url"] + "/metrics",
                     headers={"Authorization": f"Bearer {served['key']}"}).text
    counted = sum(s.value for family in text_string_to_metric_families(text)
                  for s in family.samples if s.name == "workbench_requests_total")
    deadline = time.monotonic() + 15  # the ranks' KV count reaches the server a moment later
    while time.monotonic() < deadline and (display.endpoint.latest.requests != counted or
                                           display.endpoint.latest.in_flight or
                                           display.endpoint.latest.kv_used):
        time.sleep(0.1)
    latest = display.endpoint.latest
    assert (latest.requests, latest.in_flight, latest.kv_used) == (counted, 0, 0)
    assert display.error is None and display.view.endpoint_figure.layout.title.text.startswith(
        f"endpoint engine at {url}: serving, ")
    capsys.readouterr()
    shell.run_line_magic("colossal", "serve --status")
    out = capsys.readouterr().out  # the endpoint panel's title, counted now
    assert out.startswith(f"colossal: endpoint engine at {url}: serving, ")
    assert " 0 in flight; engines (1 replica): 0 running, 0 waiting, KV blocks 0 of " in out
    assert f" · {counted:,.0f} requests, " in out


def test_a_cell_while_serving_names_the_endpoint(shell, served):
    with pytest.raises(UsageError, match=f"serving engine at {served['url']}/v1"):
        shell.run_cell_magic("colossal", "", "x = 1\n")
    with pytest.raises(UsageError, match="already serving engine"):
        shell.run_line_magic("colossal", "serve engine --port 1")


def _stream(served, prompt: str, n: int, into: list) -> None:
    client = _client(served)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="engine", prompt=prompt, max_tokens=n, temperature=0, stream=True))
    into.append(text)


def test_a_disconnected_stream_is_aborted_and_frees_its_blocks(served):
    headers = {"Authorization": f"Bearer {served['key']}"}
    body = {"model": "engine", "prompt": "def __init__(self", "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", served["url"] + "/v1/completions", json=body,
                      headers=headers) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines)[6:])["choices"][0]["text"] is not None
        held = 0.0
        for _ in range(100):  # while it streams, its blocks are in use
            next(lines)
            text = httpx.get(served["url"] + "/metrics", headers=headers).text
            held = next(float(line.split()[1]) for line in text.splitlines()
                        if line.startswith("workbench_kv_blocks_used "))
            if held > 0:
                break
        assert held > 0, "the streaming request held no KV blocks"
    deadline = time.monotonic() + 10
    metrics = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(served["url"] + "/metrics", headers=headers).text
        if "workbench_requests_in_flight 0.0" in metrics and \
                "workbench_kv_blocks_used 0.0" in metrics:
            break
        time.sleep(0.1)
    assert "workbench_requests_in_flight 0.0" in metrics
    assert "workbench_kv_blocks_used 0.0" in metrics, "the aborted request kept its blocks"
    assert 'status="499"' in metrics


def test_stop_lets_eight_running_streams_finish(shell, served, tmp_path, monkeypatch):
    from workbench.serving import api_key
    from workbench.ui.lab.state import read_pool

    texts: list[str] = []
    clients = [threading.Thread(target=_stream, args=(served, PROMPTS[i % 3], 40, texts))
               for i in range(8)]
    for t in clients:
        t.start()
    magics = shell.magics_manager.registry["ColossalMagics"]
    server, display = magics.server, magics.serving_display
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(magics.pool.state, "enabled", True)
    deadline = time.monotonic() + 60
    while len(server.bridge.queues) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)  # all 8 are streaming
    assert len(server.bridge.queues) == 8
    shell.run_line_magic("colossal", "serve --stop")
    for t in clients:
        t.join(60)
    assert len(texts) == 8 and all(len(t) > 0 for t in texts)
    # the dashboard's last sample says stopped; the lab's file has no endpoint any more
    assert display.endpoint.latest.status == "stopped" and not display._thread.is_alive()
    doc = read_pool(magics.pool.state.pool_id)
    assert doc["endpoint"] is None and not doc["cell"]["running"]
    assert {r["state"] for r in doc["ranks"]} == {"idle"}
    shell.run_cell_magic("colossal", "--no-dashboard --pull stats", "stats = engine.stats()\n")
    assert shell.user_ns["stats"]["blocks_used"] == 0
    import socket

    from workbench.serving.server import free_port

    with socket.socket() as busy:  # a port in use is a clear error before anything starts
        port = free_port()
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(UsageError, match=f"127.0.0.1:{port}: .*the port is in use"):
            shell.run_line_magic("colossal", f"serve engine --port {port}")
    shell.run_line_magic("colossal", f"serve engine --port {served['port']}")  # for what follows
    served["key"] = api_key(served["port"])


def test_a_killed_rank_gives_503_and_restart_serves_again(shell, served):
    import openai

    pool = shell.magics_manager.registry["ColossalMagics"].pool
    pid = pool.status()[1].pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    health = None
    while time.monotonic() < deadline:
        health = httpx.get(served["url"] + "/health")
        if health.status_code == 503:
            break
        time.sleep(0.2)
    assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
    client = _client(served)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="engine", prompt="import ", max_tokens=8,
                                  temperature=0)
    assert err.value.status_code == 503 and "rank 1" in err.value.message
    shell.run_line_magic("colossal", "restart")
    again = client.completions.create(model="engine", prompt=PROMPTS[0], max_tokens=24,
                                      temperature=0)
    assert again.choices[0].text == served["expected"][0]
