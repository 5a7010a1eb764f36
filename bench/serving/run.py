"""The serving endpoint under load, against calling the engine directly, in one run:

64 concurrent streaming clients (``client.py``: asyncio, one connection each, all sent at
once) against ``%colossal serve``'s server on loopback in front of an engine on a real pool
(``dp=<ranks>`` replicas, GPT-2 shape, random weights, greedy), and the same 64 requests through
``engine.generate`` on the ranks with no HTTP in between. Every streamed request must come back
whole: its streamed text equal, in order, to the decoding of what ``generate`` produced for
it, with the token count it asked for (byte tokens, so every token is text). The endpoint
streams as it does by default (on CPU ranks a request's tokens go out at most every 40 ms, its
first and last at once: ``kernels_runtime/inference/stream_pacing.py``), and again streaming
every step, for comparison. Printed: requests/s, generated tokens/s, time to first token, time
per output token after the first, the gaps between a client's events (p50, p99, seen by the
clients), and served throughput / direct throughput (aim >= 0.9, at the default); rounds
alternate direct, served and served every step, medians with the min-max.

``--quick``: fewer, shorter requests on a smaller model (what the test runs).
The per-token time split (``workbench/serving/profile.py``: rank loop, engine step, deltas,
bridge, event loop, SSE write) is printed under the table, from one more served round after the
timed ones: its timestamps (taken, sent and recorded for every delta) cost the serving path CPU
the direct side does not pay, so the rounds that give the ratio run without them, as a server
does unless asked to profile. ``--no-profile`` skips that round. Printed too: the CPU seconds
the serving process (uvicorn's loop, the bridge) and the load clients took per round, a figure
the machine's load disturbs less than a rate: on a machine whose cores the ranks fill, what the
server takes, the ranks lose.
``--soak SECONDS``: instead, 64 clients, some disconnecting and some malformed, against a real
``workbench serve`` for that long (``bench/serving/soak.py``); exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common.spread import spread
from bench.common.table import print_table

FULL = dict(clients=64, vocab=256, hidden=256, layers=4, heads=4, context=512, batch=32,
            batch_tokens=512, kv_mem="32MiB", prompt=(16, 96), output=(24, 96), seed=0)
QUICK = dict(FULL, clients=12, vocab=256, hidden=64, layers=2, heads=2, batch=8,
             batch_tokens=128, kv_mem="2MiB", prompt=(8, 32), output=(8, 24))

BUILD = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from kernels_runtime.data import ByteTokenizer
from kernels_runtime.inference import Engine, SamplingParams

torch.set_num_threads(1)
torch.manual_seed(0)
_cfg = {spec!r}
_model = GPT2LMHeadModel(GPT2Config(
    vocab_size=_cfg["vocab"], n_positions=_cfg["context"], n_embd=_cfg["hidden"],
    n_layer=_cfg["layers"], n_head=_cfg["heads"], resid_pdrop=0.0, embd_pdrop=0.0,
    attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
engine = Engine(_model, "dp={ranks}", comm=comm, kv_mem=_cfg["kv_mem"],
                max_num_seqs=_cfg["batch"], max_batch_tokens=_cfg["batch_tokens"],
                prefix_sharing=False, tokenizer=ByteTokenizer(), verbose=False)
"""

DIRECT = """
import time
import torch.distributed as _dist

_params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in _bench_lengths]
_dist.barrier()
_t0 = time.perf_counter()
_outs = engine.generate(_bench_prompts, _params)
_dist.barrier()
bench_direct = {{"seconds": time.perf_counter() - _t0,
                 "tokens": [o.token_ids for o in _outs]}}
"""


def workload(spec: dict) -> tuple[list[list[int]], list[int]]:
    import random

    rng = random.Random(spec["seed"])
    prompts = [[rng.randrange(1, spec["vocab"]) for _ in range(rng.randint(*spec["prompt"]))]
               for _ in range(spec["clients"])]
    return prompts, [rng.randint(*spec["output"]) for _ in range(spec["clients"])]


def _body(prompt: list[int], n: int) -> dict:
    return {"model": "engine", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


async def _one(client: Any, url: str, key: str, prompt: list[int], n: int) -> dict:
    body = _body(prompt, n)
    import json

    start = time.perf_counter()
    times, text, usage = [], "", None
    async with client.stream("POST", url, json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice.get("text"):
                    times.append(time.perf_counter() - start)
                    text += choice["text"]
    return {"times": times, "text": text, "usage": usage}


async def _load(url: str, key: str, prompts: list, lengths: list, timeout_s: float,
                client: str = "raw") -> dict:
    """All the requests at once; ``client``: ``raw`` (``client.py``, what the figures use) or
    ``httpx`` (a parsing client, several times the CPU: for comparison)."""
    cpu = time.thread_time()  # the clients run in this thread: their CPU, apart from the server's
    if client == "raw":
        from urllib.parse import urlsplit

        from bench.serving.client import stream

        where = urlsplit(url)
        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*[
            stream(where.hostname, where.port, where.path, key, _body(p, n))
            for p, n in zip(prompts, lengths)]), timeout_s)
    else:
        import httpx

        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
            start = time.perf_counter()
            results = await asyncio.wait_for(asyncio.gather(*[
                _one(http, url, key, p, n) for p, n in zip(prompts, lengths)]), timeout_s)
    return {"seconds": time.perf_counter() - start, "results": results,
            "client_cpu": time.thread_time() - cpu}


def run(spec: dict, ranks: int, rounds: int, profile: bool = True,
        client: str = "raw", stream_interval_s: float | None = None) -> dict:
    """Rounds of: direct, served at ``stream_interval_s`` (None: the endpoint's default, paced
    on CPU ranks) and served streaming every step, in that order."""
    from workbench.cells.execution import run_cell
    from workbench.pool.pool import Pool
    from workbench.serving.profile import ServingProfile

    prompts, lengths = workload(spec)
    quiet = {"stream": lambda *a: None, "display": lambda *a: None}
    out: dict[str, Any] = {"direct": [], "served": [], "every step": [],
                           "profile": ServingProfile()}
    with Pool(ranks) as pool:
        pool.start()
        run_cell(pool, BUILD.format(spec=spec, ranks=ranks), **quiet)
        pool.view().push({"_bench_prompts": prompts, "_bench_lengths": lengths}, block=True)
        for _ in range(rounds):
            run_cell(pool, DIRECT.format(), **quiet)
            out["direct"].append(pool.view([0]).pull("bench_direct", block=True)[0])
            out["served"].append(_served_round(pool, prompts, lengths, client,
                                               stream_interval_s=stream_interval_s))
            out["every step"].append(_served_round(pool, prompts, lengths, client,
                                                   stream_interval_s=0.0))
        if profile:  # the split, from a round of its own (the module docstring says why)
            out["profiled"] = _served_round(pool, prompts, lengths, client, out["profile"],
                                            stream_interval_s)
    out["lengths"] = lengths
    return out


def _served_round(pool: Any, prompts: list, lengths: list, client: str,
                  profile: Any = None, stream_interval_s: float | None = None) -> dict:
    """One round of the requests through a fresh endpoint; with ``profile`` (a
    ``ServingProfile``), the endpoint stamps every delta and its split is merged into it.
    ``stream_interval_s``: the endpoint's (None: its default)."""
    from workbench.serving.server import Server, free_port, new_event_loop

    server = Server(pool, "engine", port=free_port(), api_key="bench",
                    profile=profile is not None, stream_interval_s=stream_interval_s).start()
    try:
        cpu = time.process_time()
        loop = new_event_loop()  # uvloop's where installed: the clients' CPU is the ranks' too
        try:
            served = loop.run_until_complete(_load(server.url + "/completions", "bench",
                                                   prompts, lengths, 600, client))
        finally:
            loop.close()
        # this process's CPU but the clients': uvicorn's loop, the bridge, the watcher
        served["server_cpu"] = time.process_time() - cpu - served["client_cpu"]
        served["interval_s"] = server.stream_interval_s
    finally:
        server.stop()
    if profile is not None and server.profile is not None:
        profile.merge(server.profile)
    return served


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(out: dict, spec: dict, ranks: int) -> dict:
    from kernels_runtime.data import ByteTokenizer
    from workbench.serving.profile import rows as profile_rows

    decode = ByteTokenizer().decode
    lengths = out["lengths"]
    tokens = sum(lengths)
    reference = out["direct"][0]["tokens"]
    complete = 0
    checked = out["served"] + out["every step"] + (
        [out["profiled"]] if "profiled" in out else [])
    for served in checked:
        for result, n, ref in zip(served["results"], lengths, reference):
            usage = result["usage"] or {}
            if usage.get("completion_tokens") == n == len(ref) and result["text"] == decode(ref):
                complete += 1
    expected = len(checked) * spec["clients"]
    direct = [tokens / d["seconds"] for d in out["direct"]]
    rate = {side: [tokens / s["seconds"] for s in out[side]] for side in ("served", "every step")}
    paced = out["served"][0]["interval_s"]
    label = f"at most every {paced * 1e3:g} ms" if paced else "every step"
    names = {"served": label, "every step": "every step"}  # how each side streamed
    print(f"{spec['clients']} concurrent streaming clients, {tokens} tokens per round; GPT-2 "
          f"h={spec['hidden']}, {spec['layers']} layers, vocab {spec['vocab']}; {ranks} ranks "
          f"(dp={ranks}), up to {spec['batch']} sequences per replica")
    print_table(["path", "tokens/s", "requests/s"],
                [["direct engine.generate", spread(direct, digits=1),
                  spread([spec["clients"] / d["seconds"] for d in out["direct"]], digits=1)],
                 [f"HTTP, streamed {label} (default)", spread(rate["served"], digits=1),
                  spread([spec["clients"] / s["seconds"] for s in out["served"]], digits=1)],
                 ["HTTP, streamed every step", spread(rate["every step"], digits=1),
                  spread([spec["clients"] / s["seconds"] for s in out["every step"]],
                         digits=1)]])
    print(f"requests complete with all their tokens: {complete} of {expected}")
    for side in ("served", "every step"):
        results = [r for s in out[side] for r in s["results"] if r["times"]]
        ttft = [r["times"][0] for r in results]
        gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
        # per output token after the first: what chunking into events does not change
        tpot = [(r["times"][-1] - r["times"][0]) / (n - 1)
                for r, n in ((r, (r["usage"] or {}).get("completion_tokens", 0))
                             for r in results) if n > 1]
        print(f"streamed {names[side]}: time to first token p50 {_p(ttft, 0.5) * 1e3:.0f} ms, p99 "
              f"{_p(ttft, 0.99) * 1e3:.0f} ms; per output token p50 "
              f"{_p(tpot, 0.5) * 1e3:.1f} ms; between events p50 {_p(gaps, 0.5) * 1e3:.1f} ms, "
              f"p99 {_p(gaps, 0.99) * 1e3:.1f} ms ({len(gaps) + len(results)} events)")
    ratio = [s / d for s, d in zip(rate["served"], direct)]
    every = [s / d for s, d in zip(rate["every step"], direct)]
    print(f"served / direct throughput: {statistics.median(ratio):.2f} "
          f"({min(ratio):.2f}-{max(ratio):.2f}) (aim >= 0.9), streamed {label}; every step "
          f"{statistics.median(every):.2f} ({min(every):.2f}-{max(every):.2f})")
    for side in ("served", "every step"):
        server_cpu = [s["server_cpu"] for s in out[side]]
        client_cpu = [s["client_cpu"] for s in out[side]]
        print(f"CPU seconds per served round, streamed {names[side]} (the ranks share "
              f"{os.cpu_count()} cores with it): serving process {spread(server_cpu, 2)} "
              f"({statistics.median(server_cpu) / tokens * 1e6:.0f} us per token), load "
              f"clients {spread(client_cpu, 2)}")
    split = out["profile"].summary()
    if split["tokens"]:
        print(f"where a streamed token's time goes (mean per token over {split['tokens']} "
              f"tokens after each request's first, in one more served round, profiled; "
              f"measured end to end {split['latency_ms']:.2f} ms):")
        print_table(["part", "ms / token", "share"], profile_rows(split))
    return {"ratio": statistics.median(ratio), "every_step": statistics.median(every),
            "complete": complete, "expected": expected, "split": split,
            "server_cpu": statistics.median(s["server_cpu"] for s in out["served"])}


def main(argv: list[str]) -> dict:
    from workbench.serving.options import interval

    parser = argparse.ArgumentParser(prog="python -m bench serving")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-profile", action="store_true",
                        help="no per-token time split (no timestamps on the serving path)")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="the load client: raw (light, bench/serving/client.py) or httpx")
    parser.add_argument("--stream-interval", type=interval, default=None, metavar="S",
                        help="the endpoint's --stream-interval (default: the server's)")
    parser.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                        help="soak a real workbench serve for SECONDS (serving_soak.py)")
    parser.add_argument("--clients", type=int, default=64, help="with --soak: clients at once")
    parser.add_argument("--model", type=Path, default=None,
                        help="with --soak: a model folder (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    if args.soak is not None:
        from bench.serving import soak as serving_soak

        if args.soak <= 0 or args.clients < 1:
            parser.error("--soak takes seconds > 0 and --clients a count >= 1")
        out = serving_soak.soak(args.soak, args.clients, args.ranks, args.model)
        serving_soak.report(out)
        if not out["ok"]:
            raise SystemExit(1)
        return out
    spec = dict(QUICK if args.quick else FULL)
    rounds = args.rounds or (1 if args.quick else 3)
    return report(run(spec, args.ranks, rounds, not args.no_profile, args.client,
                      args.stream_interval), spec, args.ranks)
