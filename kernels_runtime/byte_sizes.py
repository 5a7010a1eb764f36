"""Byte sizes as people write them in plans: ``device_mem=256MiB``, ``host_mem=1.5GB``.

Torch-free and below every layer that reads sizes: ``mesh`` (the Plan parses its memory fields),
``memory`` and ``inference`` (budgets and their messages), the notebook side (the planner and the
tuner). ``format_bytes`` is exact so a plan's canonical string parses back to the same plan;
``human_bytes`` rounds, for messages.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"256MiB"`` -> 268435456; decimal (KB, MB, GB, TB) and binary (KiB ... TiB) units,
    any case; a plain number is bytes."""
    if isinstance(text, int):
        return text
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write a number with an optional unit, "
                         "e.g. 256MiB, 2GiB, 1.5GB or 4096 (bytes)")
    return int(round(float(match.group(1)) * _UNITS[unit]))


def format_bytes(n: int) -> str:
    """Exact and parseable: the largest binary unit that divides ``n`` (``"256MiB"``)."""
    for name, size in _BINARY:
        if n and n % size == 0:
            return f"{n // size}{name}"
    return str(n)


def human_bytes(n: float | None) -> str:
    """Rounded for messages: ``"1.50 GiB"``, ``"12.0 MiB"``, ``"512 B"``."""
    if n is None:
        return "unlimited"
    for name, size in _BINARY:
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {name}" if value < 10 else f"{value:.1f} {name}"
    return f"{int(n)} B"
