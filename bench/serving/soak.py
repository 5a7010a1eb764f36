"""``python -m bench serving --soak SECONDS``: ``workbench serve`` under hostile load for a while.

What a long-running endpoint must survive (issue 26's Must-show): 64 concurrent clients against
a real ``workbench serve`` of SmolLM2-135M-Instruct (a subprocess, as a user starts it, with no
``--kv-mem``: the default budget is on trial too), each sending one request after another until
the time is up: a tenth of the requests disconnect mid-stream (the server must abort them and
free their blocks), a tenth send malformed bodies (each must get a 4xx, never a 5xx), the rest
stream a greedy completion of a fixed token count, which must come back whole (``[DONE]`` and
exactly the tokens asked for). Afterwards ``/metrics`` must show no KV block in use and no request
in flight. The serving process's RSS (the kernel holding the endpoint) is sampled after a
warm-up and after the soak: its growth is reported (aim <= 5%), as are the ranks'. Exits 1 when
a good request failed, a malformed one got anything but a 4xx, or blocks leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLIENTS = 64
DISCONNECT, MALFORMED = 0.1, 0.1  # shares of the requests sent
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are", "In 1969, the first person to walk on the moon",
           "A haiku about the sea:"]
GOOD_TOKENS = (4, 24)  # a good request's max_tokens, generated whatever comes (ignore_eos)


def malformed(model: str) -> list[tuple[bytes, str]]:
    """(body, what is wrong) of requests a server must refuse with a 4xx."""
    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, "prompt": "Hi", "max_tokens": 4, **fields}).encode()

    return [(b'{"model": "x", "prompt": "Hi", "max_tok', "truncated JSON"),
            (b"[1, 2, 3]", "a list, not an object"),
            (b"\xff\xfe not json", "bytes that are not UTF-8 JSON"),
            (json.dumps({"model": model}).encode(), "no prompt"),
            (body(max_tokens="ten"), "max_tokens a string"),
            (body(temperature=-1), "temperature below 0"),
            (body(prompt={"text": "Hi"}), "prompt an object"),
            (body(n=3), "n > 1 (not implemented)")]


@dataclass
class Tally:
    good: int = 0
    good_ok: int = 0
    good_failures: list[str] = field(default_factory=list)
    disconnected: int = 0
    malformed: int = 0
    statuses: dict[int, int] = field(default_factory=dict)  # of the malformed requests
    not_4xx: list[str] = field(default_factory=list)


async def _good(client: Any, model: str, rng: random.Random, tally: Tally) -> None:
    n = rng.randint(*GOOD_TOKENS)
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tally.good += 1
    done, usage = False, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    usage = json.loads(line[6:]).get("usage") or usage
        got = (usage or {}).get("completion_tokens")
        if not done or got != n:
            raise RuntimeError(f"stream ended without [DONE] or with {got} of {n} tokens")
        tally.good_ok += 1
    except Exception as err:  # noqa: BLE001 - every failure is counted and reported
        tally.good_failures.append(f"{type(err).__name__}: {err}"[:300])


async def _disconnect(client: Any, model: str, rng: random.Random, tally: Tally) -> None:
    """A long stream the client walks away from after its first text."""
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": 128,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream
    tally.disconnected += 1


async def _malformed(client: Any, model: str, rng: random.Random, tally: Tally) -> None:
    content, what = rng.choice(malformed(model))
    response = await client.post("/v1/completions", content=content,
                                 headers={"Content-Type": "application/json"})
    tally.malformed += 1
    tally.statuses[response.status_code] = tally.statuses.get(response.status_code, 0) + 1
    if not 400 <= response.status_code < 500:
        tally.not_4xx.append(f"{what}: HTTP {response.status_code}")


async def _client(url: str, model: str, seed: int, until: float, tally: Tally) -> None:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while time.monotonic() < until:
            roll = rng.random()
            kind = _disconnect if roll < DISCONNECT else \
                _malformed if roll < DISCONNECT + MALFORMED else _good
            await kind(client, model, rng, tally)


async def _load(url: str, model: str, seconds: float, clients: int) -> Tally:
    tally, until = Tally(), time.monotonic() + seconds
    await asyncio.gather(*[_client(url, model, i, until, tally) for i in range(clients)])
    return tally


def metric(text: str, name: str) -> float | None:
    """An unlabelled sample of Prometheus text, e.g. ``workbench_kv_blocks_used``."""
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def by_status(text: str, name: str, status: str) -> float:
    """A labelled counter summed over routes, e.g. requests that ended 499 (client gone)."""
    found = re.findall(rf'^{name}{{[^}}]*status="{status}"[^}}]*}} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


def settled(url: str, timeout_s: float = 60.0) -> dict[str, float | None]:
    """``/metrics`` once no request is in flight and no KV block is in use (or the last read
    when ``timeout_s`` passes first): the ranks report their blocks after their next step."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        out = {name: metric(text, f"workbench_{name}") for name in
               ("kv_blocks_used", "kv_blocks_total", "requests_in_flight")}
        out["client_gone"] = by_status(text, "workbench_requests_total", "499")
        if (out["kv_blocks_used"] == 0 and out["requests_in_flight"] == 0) \
                or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def rss(pid: int) -> tuple[int, int]:
    """(RSS of the process, RSS of its descendants together: the pool's processes)."""
    import psutil

    process = psutil.Process(pid)
    children = 0
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            children += child.memory_info().rss
    return process.memory_info().rss, children


def start_serve(folder: Path, *args: str, timeout_s: float = 300.0,
                attempts: int = 3) -> tuple[Any, str]:
    """``workbench serve --model FOLDER ARGS`` on a free port; (process, url) once ``/health``
    answers. The caller stops it (``stop_serve``). The port is free when chosen but may be
    taken before the server binds it: a start that failed only on that is retried."""
    import httpx

    from workbench.serving.server import free_port

    for attempt in range(attempts):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "--model",
                                 str(folder), "--no-api-key", "--port", str(port), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        output = stop_serve(proc)
        if "address already in use" not in output.lower() or attempt + 1 == attempts:
            break
    raise RuntimeError(f"workbench serve did not answer /health in {timeout_s:.0f} s:\n"
                       f"{output[-3000:]}")


def stop_serve(proc: Any) -> str:
    """SIGINT (the CLI drains, stops its pool, exits 0); everything it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=120)[0] or ""
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0] or ""


def soak(seconds: float, clients: int = CLIENTS, ranks: int = 2,
         folder: Path | None = None) -> dict[str, Any]:
    """Run the soak (module docstring) against ``folder`` (default: SmolLM2-135M-Instruct,
    converted into the user cache on first use); its figures, ``ok`` False on any failure."""
    from workbench.models import smollm2

    folder = folder or smollm2.smollm2_instruct()
    proc, url = start_serve(folder, "--pool-size", str(ranks), "--max-inflight", "256")
    model = folder.name
    try:
        asyncio.run(_warm(url, model, 2 * ranks))
        kernel0, ranks0 = rss(proc.pid)
        tally = asyncio.run(_load(url, model, seconds, clients))
        after = settled(url)
        kernel1, ranks1 = rss(proc.pid)
    finally:
        output = stop_serve(proc)
    leaked = after["kv_blocks_used"] != 0 or after["requests_in_flight"] != 0
    out = {"seconds": seconds, "clients": clients, "model": model, "ranks": ranks, "tally": tally,
           "metrics": after, "kernel_rss": (kernel0, kernel1), "ranks_rss": (ranks0, ranks1),
           "kernel_growth": (kernel1 - kernel0) / kernel0, "leaked": leaked,
           "serve_output": output}
    out["ok"] = not (tally.good_failures or tally.not_4xx or leaked) and tally.good > 0
    return out


async def _warm(url: str, model: str, count: int) -> None:
    """``count`` good requests at once, so every replica has served before RSS is read."""
    import httpx

    tally = Tally()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*[_good(client, model, random.Random(i), tally)
                               for i in range(count)])
    if tally.good_failures:
        raise RuntimeError(f"the warm-up failed: {tally.good_failures[0]}")


def report(out: dict[str, Any]) -> None:
    t: Tally = out["tally"]
    mib = 2**20
    k0, k1 = out["kernel_rss"]
    r0, r1 = out["ranks_rss"]
    print(f"soak of {out['seconds']:.0f} s: {out['clients']} concurrent clients against "
          f"workbench serve of {out['model']} on {out['ranks']} ranks (no --kv-mem)")
    print(f"good requests complete: {t.good_ok} of {t.good}")
    print(f"disconnected mid-stream: {t.disconnected}")
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(t.statuses.items()))
    print(f"malformed bodies: {t.malformed} ({statuses or 'none'}); not a 4xx: "
          f"{len(t.not_4xx)}")
    m = out["metrics"]
    print(f"after the soak: KV blocks in use {m['kv_blocks_used']} of {m['kv_blocks_total']}, "
          f"requests in flight {m['requests_in_flight']}; requests the server saw end with "
          f"the client gone (499): {m['client_gone']:.0f}")
    print(f"kernel (serving process) RSS: {k0 / mib:.0f} MiB -> {k1 / mib:.0f} MiB, growth "
          f"{out['kernel_growth']:+.1%} (aim <= 5%); the pool's processes together "
          f"{r0 / mib:.0f} MiB -> {r1 / mib:.0f} MiB")
    for failure in (t.good_failures + t.not_4xx)[:10]:
        print(f"  failed: {failure}")
    print("soak: PASS" if out["ok"] else "soak: FAIL")
