"""``%colossal`` (pool lifecycle) and ``%%colossal`` (run a cell on every rank).

Options are declared once per group and composed with decorators, so the line and cell forms
share their definitions (ipyparallel's ``%px`` does the same). Argument mistakes become
IPython ``UsageError``s with argparse's message; failures on ranks become one
``RankFailureError`` naming every failing rank.

Every cell's published telemetry is collected by a ``LiveDashboard`` (shown once a cell has
run about 2 s and published something, or with ``--dashboard``; never with
``--no-dashboard``) and kept as ``last_run`` for ``workbench.show_dashboard()``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import publish_display_data

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.cells.background import BackgroundCell
from workbench.cells.execution import cell_label, run_cell
from workbench.cells.session import MAGICS_NAME
from workbench.cells.session import active_magics as active_magics  # re-exported
from workbench.cells.session import active_pool as active_pool  # re-exported
from workbench.errors import PoolError
from workbench.pool import rank_calls
from workbench.pool.pool import Pool
from workbench.pool.ranks import tp_groups_within_hosts
from workbench.pool.start_options import LAUNCH_OPTIONS, with_env_options
from workbench.serving.magic import guard_cell, resume_after_restart, serve_command
from workbench.ui.dashboard import LiveDashboard, RunHistory, preload

POOL_COMMANDS = ("start", "stop", "restart", "status")


def _timeout_arg(f):
    return argument(
        "--timeout", type=float, default=None,
        help="seconds: for a cell, interrupt every rank after this long; for start/restart, "
             "the collective timeout of the process group (default 60)",
    )(f)


def _pool_args(f):
    # the launch options are shared with ``workbench run`` (workbench.pool.start_options)
    for arg in reversed([
        argument("command", nargs="?", default="status", choices=POOL_COMMANDS),
        *(argument(*flags, **settings) for flags, settings in LAUNCH_OPTIONS),
    ]):
        f = arg(f)
    return _timeout_arg(f)


def _exec_args(f):
    for arg in reversed([
        argument("--plan", default=None, help='parallel plan, e.g. "dp=2 zero=1 bf16"'),
        argument("--targets", default=None, help="comma-separated ranks, e.g. 0,1"),
        argument("--output", choices=("rank0", "all"), default="rank0",
                 help="whose output to show: the first target only, or every rank prefixed"),
        argument("--push", default="", help="notebook variables to send to every rank: a,b"),
        argument("--pull", default="", help="variables of the first target to bring back: c"),
        argument("--dashboard", dest="dashboard", action="store_const", const="on",
                 default="auto", help="show the live dashboard from the start (by default it "
                 "appears once a cell has run ~2 s and published telemetry)"),
        argument("--no-dashboard", dest="dashboard", action="store_const", const="off",
                 help="do not show the live dashboard (telemetry is still kept)"),
        argument("--noblock", action="store_true",
                 help="return at once with a handle (.wait() gives the --pull values, "
                      ".ready(), .interrupt()); output and the dashboard keep updating"),
    ]):
        f = arg(f)
    return _timeout_arg(f)


def unquote(text: str | None) -> str | None:
    """IPython's magic argument splitter keeps the quotes around ``--plan "dp=2 tp=2"``."""
    if text and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _names(text: str) -> list[str]:
    text = unquote(text) or ""
    return [n.strip() for n in text.split(",") if n.strip()]


class _StreamPrinter:
    """Writes rank output to the notebook, prefixing each line with ``[rank k]`` if asked."""

    def __init__(self, primary: int, show_all: bool) -> None:
        self.primary, self.show_all = primary, show_all
        self.line_start: dict[tuple[int, str], bool] = {}

    def stream(self, rank: int, name: str, text: str) -> None:
        if not self.show_all and rank != self.primary:
            return
        target = sys.stderr if name == "stderr" else sys.stdout
        if self.show_all:
            key = (rank, name)
            prefix = f"[rank {rank}] "
            lines = text.splitlines(keepends=True)
            pieces = []
            for line in lines:
                pieces.append((prefix if self.line_start.get(key, True) else "") + line)
                self.line_start[key] = line.endswith("\n")
            text = "".join(pieces)
        target.write(text)
        target.flush()

    def display(self, rank: int, content: dict[str, Any]) -> None:
        if self.show_all or rank == self.primary:
            publish_display_data(content.get("data", {}), content.get("metadata", {}))


@magics_class
class ColossalMagics(Magics):
    """State: the pool this notebook drives, and the plan last sent to its ranks."""

    def __init__(self, shell: Any = None) -> None:
        super().__init__(shell)
        self.pool: Pool | None = None
        self.default_plan: Plan = Plan()
        self._sent_plan: tuple[Any, ...] | None = None
        self.last_run: RunHistory | None = None  # telemetry of the last %%colossal cell
        self.cells_run: list[tuple[str, str]] = []  # (line, code) of recent %%colossal cells
        self.server: Any = None  # the endpoint of ``%colossal serve``, while it serves
        self.background: BackgroundCell | None = None  # the last --noblock cell

    @line_cell_magic
    def colossal(self, line: str, cell: str | None = None) -> Any:
        """%colossal start|stop|restart|status [-n N] [--backend B] [--launcher L]
        %colossal serve ENGINE [--port P] [--host H] [--api-key K | --no-api-key] | --stop
        %colossal push NAME [NAME ...] [--targets 0,1]
        %%colossal [--plan P] [--targets 0,1] [--output rank0|all] [--push a] [--pull b]
                   [--dashboard | --no-dashboard] [--timeout S]
        """
        words = line.split()
        if "--help" in words or "-h" in words:
            print(_help(cell is not None, words[:1] == ["serve"], words[:1] == ["push"]))
            return None
        if cell is None:
            if words[:1] == ["serve"]:
                return serve_command(self, line)
            if words[:1] == ["push"]:
                return self._push_command(line.split(None, 1)[1] if len(words) > 1 else "")
            return self._pool_command(line)
        guard_cell(self)
        return self.run_cell_magic_unguarded(line, cell)

    def run_cell_magic_unguarded(self, line: str, cell: str) -> None:
        """A %%colossal cell, remembered (``%colossal serve`` rebuilds an engine from it)."""
        self.cells_run = [*self.cells_run[-99:], (line, cell)]
        return self._run_cell(line, cell)

    # ---- line: pool lifecycle ----------------------------------------------------------
    @magic_arguments()
    @_pool_args
    def _pool_parser(self, line: str) -> None:
        """%colossal start|stop|restart|status"""

    def _pool_command(self, line: str) -> Any:
        if line.split()[:1] in (["start"], ["restart"]):  # ``workbench run``'s options win
            line = with_env_options(line)
        args = parse_argstring(self._pool_parser, line)
        try:
            return getattr(self, f"_cmd_{args.command}")(args)
        except PoolError as e:
            raise UsageError(str(e)) from None

    def _cmd_start(self, args: Any) -> None:
        if self.pool is not None and self.pool.started:
            raise UsageError(f"{self.pool!r} is already running; use `%colossal restart`")
        pool = Pool(
            args.n, backend=args.backend, launcher=args.launcher,
            controller_ip=args.controller_ip, hosts=unquote(args.hosts),
            launcher_options=[unquote(o) for o in args.launcher_options],
            collective_timeout_s=args.timeout if args.timeout else 60.0,
            start_timeout_s=args.start_timeout if args.start_timeout else 120.0,
        )
        pool.start(progress=_progress)
        # The dashboard's imports take seconds of CPU: after the start, not during it (on a
        # small machine they would slow the engines' torch imports), while the user reads.
        preload()
        self.pool, self._sent_plan = pool, None
        print(f"colossal: {pool.world_size} ranks on {pool.backend} ready")

    def _cmd_stop(self, args: Any) -> None:
        if self.pool is None:
            print("colossal: no pool is running")
            return
        if self.server is not None and self.server.running:
            serve_command(self, "serve --stop")
        self.pool.stop()
        self.pool = None
        print("colossal: pool stopped")

    def _cmd_restart(self, args: Any) -> None:
        if self.pool is None:
            return self._cmd_start(args)
        if args.start_timeout:
            self.pool.start_timeout_s = args.start_timeout
        self.pool.restart(progress=_progress)
        self._sent_plan = None
        print(f"colossal: {self.pool.world_size} ranks on {self.pool.backend} restarted")
        resume_after_restart(self)

    def _cmd_status(self, args: Any) -> None:
        if self.pool is None or not self.pool.started:
            print("colossal: no pool is running; start one with `%colossal start`")
            return
        print(format_status(self.pool))

    # ---- line: send notebook variables to the ranks --------------------------------------
    @magic_arguments()
    @argument("--targets", default=None, help="comma-separated ranks, e.g. 0,1 (default: all)")
    @argument("names", nargs="*", help="notebook variables to send to every rank: a b (or a,b)")
    def _push_parser(self, line: str) -> None:
        """%colossal push NAME [NAME ...]"""

    def _push_command(self, line: str) -> None:
        """``%colossal push a b``: the cell's ``--push`` without a cell, for values the next
        cells on the ranks read (a config, a tokenizer, a list of prompts)."""
        args = parse_argstring(self._push_parser, line)
        names = [n for word in args.names for n in _names(word)]
        if not names:
            raise UsageError("push: name the notebook variables to send, e.g. "
                             "`%colossal push config prompts`")
        self._check_idle_pool()
        ranks = self._targets(args.targets)
        self._push(names, ranks, "push")
        print(f"colossal: sent {', '.join(names)} to ranks {', '.join(map(str, ranks))}")

    def _check_idle_pool(self) -> None:
        if self.pool is None or not self.pool.started:
            raise UsageError("no pool is running: start one with `%colossal start` (e.g. -n 2)")
        if self.background is not None and not self.background.ready():
            raise UsageError(f"a --noblock cell still runs on ranks {self.background.ranks}: "
                             "wait for it (handle.wait()) or stop it (handle.interrupt()) "
                             "first")

    def _values(self, names: list[str], what: str) -> dict[str, Any]:
        """The notebook's values of ``names``, or a UsageError listing those not defined."""
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"{what}: not defined in the notebook: {', '.join(missing)}")
        return {n: self.shell.user_ns[n] for n in names}

    def _push(self, names: list[str], ranks: list[int], what: str) -> None:
        values = self._values(names, what)
        self.pool.view(ranks).push(values, block=True)  # type: ignore[union-attr]

    # ---- cell: run on ranks ------------------------------------------------------------
    @magic_arguments()
    @_exec_args
    def _cell_parser(self, line: str) -> None:
        """%%colossal [options]"""

    def _targets(self, text: str | None) -> list[int]:
        assert self.pool is not None
        n = self.pool.world_size
        if not text:
            return list(range(n))
        try:
            ranks = sorted({int(t) for t in _names(text)})
        except ValueError:
            raise UsageError(f"--targets {text!r}: give ranks as integers, e.g. 0,1") from None
        bad = [r for r in ranks if not 0 <= r < n]
        if bad or not ranks:
            raise UsageError(f"--targets {text!r}: ranks must be in 0..{n - 1}")
        return ranks

    def _run_cell(self, line: str, cell: str) -> BackgroundCell | None:
        args = parse_argstring(self._cell_parser, line)
        self._check_idle_pool()
        pool = self.pool
        assert pool is not None
        ranks = self._targets(args.targets)
        try:
            plan = Plan.parse(unquote(args.plan)) if args.plan else self.default_plan
            plan = plan.validate(pool.world_size)
        except PlanError as e:
            raise UsageError(f"--plan: {e}") from None
        across = tp_groups_within_hosts(pool.hosts, plan.tp)
        if across:
            raise UsageError(f"--plan: {across}")
        pushes = _names(args.push)
        self._values(pushes, "--push")  # every name defined, before the plan goes out
        self._send_plan(plan, ranks)
        if pushes:
            self._push(pushes, ranks, "--push")
        printer = _StreamPrinter(ranks[0], args.output == "all")
        live = LiveDashboard(ranks, mode=args.dashboard, label=f"%%colossal {line}".strip(),
                             plan=plan.to_string())
        self.last_run = live.history
        live.start()
        pulls = _names(args.pull)

        def wait(stop: threading.Event | None = None) -> dict[str, Any]:
            outcome = run_cell(
                pool, cell, ranks=ranks, stream=printer.stream, display=printer.display,
                timeout_s=args.timeout, data_sink=live, stop=stop,
            )
            result = outcome.execute_results.get(ranks[0])
            if result:
                publish_display_data(result.get("data", {}), result.get("metadata", {}))
            values: dict[str, Any] = {}
            if pulls:
                engine = pool.client[pool.engine_ids[ranks[0]]]
                values = engine.apply_async(rank_calls.pull_names, pulls).get()
                self.shell.user_ns.update(values)
            return values

        if args.noblock:
            self.background = BackgroundCell(cell_label(cell), ranks, live.history).start(wait)
            return self.background
        wait()
        return None

    def _send_plan(self, plan: Plan, ranks: list[int]) -> None:
        key = (plan, tuple(ranks), tuple(self.pool.engine_ids))  # type: ignore[union-attr]
        if key != self._sent_plan:
            self.pool.view(ranks).apply_sync(rank_calls.set_plan, plan)  # type: ignore
            self._sent_plan = key


def parsers() -> tuple[Any, Any, Any]:
    """The (pool, cell, serve) argument parsers, named as the user types them."""
    from workbench.serving.magic import _parser as serve_parser

    pool, cell = ColossalMagics._pool_parser.parser, ColossalMagics._cell_parser.parser
    pool.prog, cell.prog = "colossal", "%colossal"  # IPython's usage line adds one "%"
    return pool, cell, serve_parser()


def push_parser() -> Any:
    """The parser of ``%colossal push``, named as the user types it."""
    parser = ColossalMagics._push_parser.parser
    parser.prog = "colossal push"
    return parser


def _help(cell: bool, serve: bool, push: bool = False) -> str:
    pool_parser, cell_parser, serve_parser = parsers()
    chosen = cell_parser if cell else serve_parser if serve else \
        push_parser() if push else pool_parser
    return _plain(chosen.format_help())


def _plain(text: str) -> str:
    """argparse's help without IPython's reStructuredText literal-block marker."""
    return text.replace("::\n\n  %", "usage: %", 1)


_OVERVIEW = """Run PyTorch on a pool of ranks from this notebook.

%colossal start -n 2                 start a pool (one rank per GPU by default, else 2 CPU ranks)
%colossal status | stop | restart    the pool's ranks; stop it; restart it after a failure
%%colossal --plan "dp=2 zero=1"      run the cell on every rank under a parallel plan
%colossal serve ENGINE               an OpenAI-compatible endpoint for an engine on the ranks
%colossal serve --status | --stop    the endpoint's requests and queue; stop it
%colossal push config prompts        send notebook variables to every rank (--targets 0,1)
Add --help to any of them for its options alone. Every option:
"""


def full_help() -> str:
    """``%colossal?``: what the magic does, then every option of its three forms."""
    return "\n".join([_OVERVIEW, *(_plain(p.format_help())
                                   for p in (*parsers(), push_parser()))])


def _progress(note: str) -> None:
    print(f"colossal: waiting: {note}", flush=True)


def format_status(pool: Pool) -> str:
    """A plain-text table of ``Pool.status()``."""
    rows = pool.status()
    header = f"{'rank':>4}  {'engine':>6}  {'host':<16} {'local':>5} {'pid':>7}  {'device':<8} " \
             f"{'backend':<7} {'state':<5} {'rss MiB':>8} {'dev MiB':>8}"
    lines = [header]
    for r in rows:
        rss = r.memory.get("host_rss", 0) / 2**20
        dev = r.memory.get("device_allocated", 0) / 2**20
        lines.append(
            f"{r.rank:>4}  {r.engine_id:>6}  {r.host[:16]:<16} {r.local_rank:>5} {r.pid:>7}  "
            f"{r.device:<8} "
            f"{r.backend:<7} {r.state:<5} {rss:>8.0f} {dev:>8.0f}"
        )
    return "\n".join(lines)


ColossalMagics.colossal.__doc__ = full_help()
assert ColossalMagics.__name__ == MAGICS_NAME, "cells.session finds the magics by this name"
