"""The endpoint's limits as one option group, shared by ``workbench serve`` (``cli.py``) and
``%colossal serve`` (``magic.py``), so both take the same flags with the same checks."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"give a whole number >= 1, got {value!r}")
    return int(value)


def _number(value: str) -> float:
    """``value`` as a float, NaN where it is none (every check below then refuses it)."""
    try:
        return float(value)
    except ValueError:
        return float("nan")


def seconds(value: str) -> float:
    parsed = _number(value)
    if not parsed > 0 or parsed == float("inf"):
        raise argparse.ArgumentTypeError(f"give a number of seconds > 0, got {value!r}")
    return parsed


def interval(value: str) -> float:
    from workbench.serving.server import MAX_STREAM_INTERVAL_S

    parsed = _number(value)
    if not 0 <= parsed <= MAX_STREAM_INTERVAL_S:
        raise argparse.ArgumentTypeError(f"give seconds from 0 to {MAX_STREAM_INTERVAL_S:g}, "
                                         f"got {value!r}")
    return parsed


def add_limit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-inflight", type=positive_int, default=None, metavar="N",
                   help="requests answered at once; more get 429 with Retry-After "
                        "(default: 256)")
    p.add_argument("--request-timeout", type=seconds, default=None, metavar="S",
                   help="seconds a request may take before it is aborted and answered 504 "
                        "(default: 600; a body's \"timeout\" may ask for less)")
    p.add_argument("--stream-interval", type=interval, default=None, metavar="S",
                   help="stream a request's new tokens at most every S seconds, its first "
                        "and its last at once: less CPU per token where the ranks share "
                        "the host's cores (default: 0.04 on CPU ranks, 0 (every step) on GPUs)")


def limit_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``Server`` keyword arguments for the limits given (none: the server's defaults)."""
    out = {} if args.request_timeout is None else {"request_timeout_s": args.request_timeout}
    if args.stream_interval is not None:
        out["stream_interval_s"] = args.stream_interval
    return out
