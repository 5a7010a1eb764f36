"""``workbench serve``: a model folder served from a pool of its own, from a shell.

    workbench serve --model DIR [--plan "tp=2"] [--pool-size N] [--port 8000] [--host 127.0.0.1]
                    [--api-key K | --no-api-key] [--kv-mem 256MiB] [--model-name NAME]
                    [--lora NAME=DIR ...] [--max-inflight 256] [--request-timeout 600]

The pool starts, every rank loads its pieces of the model (``load_pretrained``: a meta model
filled shard-wise from the safetensors, so a host holds about one copy of the weights, not one
per rank; ``from_pretrained`` for other formats), with the folder's tokenizer when it has one,
and builds the engine under the plan, and the endpoint serves until SIGINT or
SIGTERM, which drain the requests in flight before the pool stops. The same ``Server`` as
``%colossal serve``; only who starts it differs. Without ``--plan`` the plan fits the pool
(``fit.py``); a plan that cannot work is one line on stderr and exit status 2.
``--lora NAME=DIR`` (repeatable) loads a peft LoRA adapter folder into the engine: a request
whose ``model`` is NAME is generated through it, beside requests for the base model and other
adapters in the same batches. ``--max-inflight N`` caps the requests answered at once; past it
a request is a 429 with ``Retry-After`` (a client retries) rather than a queue without end.
``--request-timeout S`` bounds what one request may take: past it, it is aborted and a 504.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from workbench.serving.options import add_limit_options, limit_settings

BUILD = """
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from kernels_runtime.checkpoint.pretrained import load_pretrained
from kernels_runtime.inference import Engine
from kernels_runtime.inference.plans import inference_plan, inference_problem
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import PlanError

folder = Path({folder!r})
tokenizer = None
if any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json",
                                              "vocab.json", "tokenizer.model")):
    tokenizer = AutoTokenizer.from_pretrained(folder)
ctx = ParallelContext.build(inference_plan({plan!r}), comm)
if inference_problem(ctx.plan):
    raise PlanError(inference_problem(ctx.plan))
if any(folder.glob("*.safetensors")):  # each rank reads and holds only its pieces
    model = load_pretrained(folder, ctx=ctx, verbose=False)
else:  # weights in another format: a whole copy per rank, then the plan cuts it
    model = AutoModelForCausalLM.from_pretrained(folder)
engine = Engine(model, ctx=ctx, tokenizer=tokenizer, kv_mem={kv_mem!r}, adapters={adapters!r},
                pack_weights={pack_weights!r}, verbose=False)
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model folder over the OpenAI HTTP API from a "
                                     "pool of its own")
    p.add_argument("--model", required=True, type=Path, help="a save_pretrained folder")
    p.add_argument("--plan", default=None,
                   help='e.g. "tp=2" or "dp=2" (default: replicas over the pool where the '
                        'model fits each rank, else the narrowest tp that fits)')
    p.add_argument("--pool-size", type=int, default=None,
                   help="ranks (default: the plan's dp*tp*pp*sp, else one per GPU, else 2)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-api-key", action="store_true")
    p.add_argument("--kv-mem", default=None, help="KV cache per rank, e.g. 256MiB")
    p.add_argument("--model-name", default=None, help="the id clients name (default: the "
                                                      "folder's name)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="a peft LoRA adapter folder clients name as model=NAME (repeatable)")
    p.add_argument("--pack-weights", action="store_true",
                   help="CPU ranks: pack every linear's weights for oneDNN (faster steps of a "
                        "few sequences or speculative drafts; a second copy of the weights in "
                        "host memory)")
    add_limit_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kernels_runtime.mesh.plan import PlanError
    from workbench.errors import PoolError, RankFailureError
    from workbench.pool.pool import Pool
    from workbench.serving import fit
    from workbench.serving.server import check_port

    folder = args.model.resolve()
    if not (folder / "config.json").exists():
        return _fail(f"{folder} is not a model folder (no config.json; write one with "
                     "model.save_pretrained(folder))")
    try:
        args.adapters = lora_modules(args.lora, args.model_name or folder.name)
        config = fit.folder_config(folder)
        plan, size = fit.requested(args.plan, args.pool_size, config)
        check_port(args.host, args.port)
    except (PlanError, PoolError, ValueError) as err:  # ValueError: a config.json not JSON
        return _fail(str(err))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    pool, server = Pool(size), None
    try:
        pool.start(progress=lambda note: print(f"waiting: {note}"))
        if plan is None:
            plan = fit.fitting(pool.world_size, fit.rank_capacity(_rank_memory(pool)), config,
                               fit.weight_bytes(folder))
        server = _serve(pool, folder, plan.to_string(), args)
        stop.wait()
        print("draining the requests in flight...", flush=True)
        return 0
    except PlanError as err:
        return _fail(str(err))
    except RankFailureError as err:  # one line: what failed where (a rank's PlanError is 2)
        planned = all(f.ename == "PlanError" for f in err.failures)
        return _fail(" ".join(err.summary().split()), 2 if planned else 1)
    except PoolError as err:
        return _fail(str(err), 1)
    finally:
        if server is not None:
            server.stop()
        pool.stop()


def _serve(pool: Any, folder: Path, plan: str, args: argparse.Namespace) -> Any:
    """Build the engine on every rank under ``plan`` and start the endpoint in front of it."""
    from workbench.cells.execution import run_cell
    from workbench.serving.keys import new_key
    from workbench.serving.server import Server

    run_cell(pool, BUILD.format(folder=str(folder), plan=plan, kv_mem=args.kv_mem,
                                adapters=args.adapters, pack_weights=args.pack_weights),
             stream=lambda rank, name, text: rank == 0 and print(text, end=""),
             display=lambda rank, content: None)
    key, where = (None, None) if args.no_api_key else new_key(args.port, args.api_key)
    server = Server(pool, "engine", model_id=args.model_name or folder.name,
                    host=args.host, port=args.port, api_key=key, **limit_settings(args))
    server.max_inflight = args.max_inflight  # None: the app's default
    try:
        server.start()
    except BaseException:
        server.stop()  # what started of it (the ranks' loop, the bridge) stops with it
        raise
    auth = f"API key in {where}" if key else "no API key"
    loras = f" with LoRA adapters {', '.join(server.adapters)}" if server.adapters else ""
    print(f"serving {server.model_id}{loras} at {server.url} ({pool.world_size} ranks, plan "
          f"{plan}); {auth}; {server.pacing()}. Ctrl-C drains and stops.", flush=True)
    return server


def lora_modules(given: list[str], model_name: str) -> dict[str, str]:
    """``--lora NAME=DIR`` values as {name: folder}, checked before any pool starts."""
    out: dict[str, str] = {}
    for value in given:
        name, sep, where = value.partition("=")
        if not sep or not name or not where:
            raise ValueError(f"--lora {value!r}: give NAME=DIR, e.g. --lora sql=./sql-adapter")
        if name == model_name or name in out:
            raise ValueError(f"--lora {value!r}: the name {name!r} is already taken (by the "
                             f"{'base model' if name == model_name else 'adapter before'}); "
                             "give each adapter a name of its own")
        folder = Path(where).resolve()
        if not (folder / "adapter_config.json").exists():
            raise ValueError(f"--lora {value!r}: {folder} is not a peft adapter folder (no "
                             "adapter_config.json; write one with "
                             "PeftModel.save_pretrained(folder))")
        out[name] = str(folder)
    return out


def _rank_memory(pool: Any) -> list[dict[str, Any]]:
    """Each rank's memory (``rank_calls.rank_memory``), in rank order."""
    from workbench.pool import rank_calls

    return pool.view().apply_async(rank_calls.rank_memory).get(timeout=60)


def _fail(message: str, code: int = 2) -> int:
    print(f"workbench serve: {message}", file=sys.stderr)
    return code
