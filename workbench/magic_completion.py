"""Tab completion for ``%colossal`` and ``%%colossal``: subcommands, options and plan keys.

IPython asks a ``complete_command`` hook keyed by the magic's name for candidates of the word
under the cursor (``event.symbol``) given the line so far (``event.line``). The candidates come
from the same option declarations the magics parse with (``magics.py``, ``serving/magic.py``)
and from the plan's own keys, so completion cannot drift from what is accepted.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kernels_runtime.mesh.plan import plan_keys

SUBCOMMANDS = ("start", "stop", "restart", "status", "serve", "push")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--option`` a parser accepts, and ``--help``."""
    found = {s for action in parser._actions for s in action.option_strings if s.startswith("--")}
    return sorted(found | {"--help"})


def candidates(line: str, symbol: str, pool_options: list[str], cell_options: list[str],
               serve_options: list[str], push_options: Sequence[str] = ("--help",),
               variables: Sequence[str] = ()) -> list[str]:
    """The completions of ``symbol`` (the word being typed) in a ``%colossal`` line.

    After ``--plan`` (or inside its quotes) plan keys as ``key=``; in a cell magic line cell
    options; after a subcommand its options; after ``push`` the notebook's ``variables`` not
    named yet (its options once ``-`` is typed); as the first word, the subcommands."""
    words = line.split()
    cell = bool(words) and words[0].startswith("%%")
    rest = words[1:] if words and words[0].lstrip("%") == "colossal" else words
    typing_new = line.endswith(" ")
    done = rest if typing_new else rest[:-1]  # the words before the one being completed
    word = symbol.lstrip("'\"")
    if "--plan" in done[-1:] or (done and _inside_plan(done)):
        keys = [f"{k}=" for k in plan_keys()]
        return [k for k in keys if k.startswith(word.rsplit(" ", 1)[-1])]
    if cell:
        return [o for o in cell_options if o.startswith(word)]
    if not done:
        return sorted(c for c in SUBCOMMANDS if c.startswith(word))
    if done[0] == "push":
        if word.startswith("-"):
            return [o for o in push_options if o.startswith(word)]
        named = set(done[1:])
        return sorted(v for v in variables
                      if v.startswith(word) and not v.startswith("_") and v not in named)
    options = serve_options if done[0] == "serve" else pool_options
    return [o for o in options if o.startswith(word)]


def _inside_plan(done: list[str]) -> bool:
    """Still within ``--plan "dp=2 ...``: its quote opened and not closed yet."""
    if "--plan" not in done:
        return False
    after = " ".join(done[len(done) - done[::-1].index("--plan"):])
    return after.count('"') % 2 == 1 or after.count("'") % 2 == 1


def register(ip: Any, pool_parser: argparse.ArgumentParser,
             cell_parser: argparse.ArgumentParser,
             serve_parser: argparse.ArgumentParser) -> None:
    """Install the hook for both the line and the cell form (``push`` completes the names
    in the shell's namespace at the time of asking)."""
    from workbench.magics import push_parser

    pool, cell, serve = (option_strings(p) for p in (pool_parser, cell_parser, serve_parser))
    push = option_strings(push_parser())

    def complete(_self: Any, event: Any) -> list[str]:
        return candidates(event.line, event.symbol, pool, cell, serve, push,
                          list(ip.user_ns))

    for key in ("%colossal", "%%colossal", "colossal"):
        ip.set_hook("complete_command", complete, str_key=key)
