"""``%colossal`` explains itself: its help lists every option, ``--help`` prints usage, and tab
completion offers subcommands, options and plan keys.

Completion candidates are computed from the same parsers the magics use (fast tests); one real
Jupyter kernel shows that ``%colossal?``, ``%colossal start --help`` and a ``complete_request``
for ``%colossal st`` reach a user as a notebook front end sees them.
"""

from __future__ import annotations

import pytest

from workbench.magic_completion import candidates, option_strings


@pytest.fixture(scope="module")
def options():
    from workbench.magics import parsers

    return [option_strings(p) for p in parsers()]


def test_completion_offers_subcommands_options_and_plan_keys(options):
    assert candidates("%colossal st", "st", *options) == ["start", "status", "stop"]
    assert candidates("%colossal start --la", "--la", *options) == ["--launcher",
                                                                    "--launcher-option"]
    assert "--status" in candidates("%colossal serve --s", "--s", *options)
    assert candidates("%%colossal --pl", "--pl", *options) == ["--plan"]
    assert candidates('%%colossal --plan "dp=2 ze', "ze", *options) == ["zero=", "zero_stage="]
    assert candidates("%%colossal --plan ", "", *options)[:2] == ["activation_checkpointing=",
                                                                 "checkpointing="]
    assert candidates('%%colossal --plan "dp=2" --no', "--no", *options) == ["--no-dashboard",
                                                                          "--noblock"]


def test_push_completes_notebook_variables_and_explains_itself(options):
    from workbench.magics import _help, push_parser

    push = option_strings(push_parser())
    names = ["config", "count", "_hidden", "prompts"]
    assert "push" in candidates("%colossal pu", "pu", *options)
    assert candidates("%colossal push co", "co", *options, push, names) == ["config", "count"]
    assert candidates("%colossal push config c", "c", *options, push, names) == ["count"]
    assert candidates("%colossal push --t", "--t", *options, push, names) == ["--targets"]
    text = _help(False, False, push=True)
    assert text.startswith("usage: %colossal push") and "--targets" in text, text


def test_the_help_of_each_form_lists_its_options():
    from workbench.magics import ColossalMagics, _help

    doc = ColossalMagics.colossal.__doc__
    for words in ("--hosts", "--launcher-option", "--start-timeout", "serve --status",
                  "--plan", "--push", "--api-key", "usage: %colossal ", "usage: %%colossal "):
        assert words in doc, words
    assert _help(cell=False, serve=False).startswith("usage: %colossal [--timeout")
    assert _help(cell=True, serve=False).startswith("usage: %%colossal ")
    assert "--status" in _help(cell=False, serve=True)


@pytest.mark.slow
def test_a_kernel_shows_help_usage_and_completions():
    from helpers.kernel_session import KernelSession

    session = KernelSession()
    try:
        session.run_ok("%load_ext workbench")
        usage = session.run_ok("%colossal start --help").text
        assert usage.startswith("usage: %colossal") and "--start-timeout" in usage, usage
        cell = session.run_ok("%%colossal --help\nprint('not run')").text
        assert "--plan" in cell and "not run" not in cell, cell
        reply = session.kc.execute_interactive("%colossal?", timeout=60, output_hook=lambda m: 0)
        pages = [p["data"]["text/plain"] for p in reply["content"]["payload"]
                 if p.get("source") == "page"]
        assert pages and all(w in pages[0] for w in ("--hosts", "--launcher-option",
                                                     "--start-timeout", "serve --status")), pages
        msg_id = session.kc.complete("%colossal st", 12)
        matches = session.kc.get_shell_msg(timeout=30)
        assert matches["parent_header"]["msg_id"] == msg_id
        assert {"start", "status", "stop"} <= set(matches["content"]["matches"]), matches
    finally:
        session.kc.stop_channels()
        session.km.shutdown_kernel(now=True)
