"""The notebook's handle on an engine that lives on the ranks: a ``%%colossal`` cell builds a
tp=2 engine on a real 2-rank pool, ``RemoteEngine.generate`` sends it requests from the
notebook, streams each request's text into the cell while the ranks generate, and returns
the same tokens as HF ``generate``. A name that is no engine is an error naming the rank.
"""

from __future__ import annotations

import pytest

from helpers import inference as inf

pytestmark = pytest.mark.engines


def test_remote_engine_streams_text_and_returns_hf_tokens(shell, trained, capsys):
    from kernels_runtime.data.corpus import ByteTokenizer
    from kernels_runtime.inference import SamplingParams
    from workbench.inference import RemoteEngine

    shell.user_ns["weights"] = trained["gpt2"]
    shell.run_cell_magic("colossal", "--push weights --no-dashboard", (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from helpers import inference as inf\n"
        "from kernels_runtime.data.corpus import ByteTokenizer\n"
        "from kernels_runtime.inference import Engine\n"
        "engine = Engine(inf.load('gpt2', weights), 'tp=2', comm=comm, "
        "tokenizer=ByteTokenizer(), verbose=False)\n"))
    prompts = inf.prompts((20, 35))
    outs = RemoteEngine("engine").generate(prompts, SamplingParams(max_new_tokens=24),
                                           dashboard="off")
    model = inf.load("gpt2", trained["gpt2"])
    assert [o.token_ids for o in outs] == [inf.reference(model, p, 24)[0] for p in prompts]
    shown = capsys.readouterr().out
    assert f"[1] {ByteTokenizer().decode(outs[1].token_ids)!r}  [length]" in shown, shown


def test_a_variable_that_is_no_engine_is_a_clear_error(shell):
    from workbench.errors import RankFailureError
    from workbench.inference import RemoteEngine

    shell.run_cell_magic("colossal", "--no-dashboard", "not_an_engine = 3\n")
    with pytest.raises(RankFailureError, match="holds a int"):
        RemoteEngine("not_an_engine").generate([[1, 2, 3]], dashboard="off")
