"""``workbench serve --lora NAME=DIR``: LoRA adapters of the real SmolLM2 served beside the base
model, named by the OpenAI ``model`` field as vLLM's ``--lora-modules`` are.

What is protected: two random peft adapters on every projection of SmolLM2-135M-Instruct
(``helpers/adapters.py``) served with ``--lora a=DIR --lora b=DIR``; ``/v1/models`` lists the
base model and each adapter with the base as its ``parent``; the official ``openai`` client,
sending chat requests for a, b and the base at once (so the engine batches them together),
gets for each the text of HF ``generate``'s greedy tokens on the model with that adapter merged
(``merge_and_unload``); a ``model`` naming no adapter is a 404 in OpenAI's error shape listing
what is served. The engine under ``tp=3`` (the factors split with their layers) gives the
same tokens for a, b and the base in one ``generate`` call. A ``--lora`` that is not NAME=DIR
of a peft folder is one line on stderr and exit status 2 before any pool starts.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import adapters as lora
from helpers import real_model
from helpers.distributed import process_comm
from helpers.serve_cli import workbench_serve

ASKED = [0, 3]  # two of the chat prompts: an answer that stops, one the budget cuts (base)


@pytest.fixture(scope="module")
def adapted(smollm2, smollm2_greedy, tmp_path_factory) -> dict:
    """Two random adapters of SmolLM2 and, for the asked prompts, HF ``generate``'s greedy
    tokens with each merged (the base's from ``smollm2_greedy``)."""
    start = time.perf_counter()
    model = real_model.load(smollm2.folder)
    adapters = lora.make_adapters(model, tmp_path_factory.mktemp("smollm2-adapters"))
    prompts = [smollm2_greedy.prompts[i] for i in ASKED]
    want = {name: lora.merged_greedy(model, adapters[name], prompts, real_model.NEW)
            for name in adapters}
    want[None] = [smollm2_greedy.tokens[i] for i in ASKED]
    assert want["a"] != want[None] and want["b"] != want[None], want
    print(f"adapters and merged references: {time.perf_counter() - start:.0f} s")
    return {"adapters": adapters, "prompts": prompts, "want": want}


def _engine_tokens(rank: int, world: int, folder: str, adapters: dict[str, str],
                   prompts: list[list[int]], which: list[str | None]) -> list[list[int]]:
    from kernels_runtime.inference import Engine, SamplingParams

    engine = Engine(real_model.load(folder), "tp=3", comm=process_comm(), kv_mem="64MiB",
                    adapters=adapters, verbose=False)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=real_model.NEW),
                           adapter=which)
    return [o.token_ids for o in outs]


@pytest.mark.full  # the real model on 3 ranks
def test_tp3_engine_serves_mixed_adapters_like_their_merged_models(smollm2, adapted, ranks):
    """The 3 key/value heads one per rank: k and v's B split by heads, o and down's A by
    input rows; a, b and the base in one generate call."""
    jobs = [(name, i) for i in range(len(ASKED)) for name in ("a", None, "b")]
    results = ranks(3).run(_engine_tokens, str(smollm2.folder), adapted["adapters"],
                           [adapted["prompts"][i] for _, i in jobs], [n for n, _ in jobs],
                           timeout_s=600)
    for rank, tokens in enumerate(results):
        assert tokens == [adapted["want"][n][i] for n, i in jobs], rank


@pytest.mark.full  # the real model, its merged references and a served pool
@pytest.mark.engines
@pytest.mark.timeout(1200)  # minutes on a shared 2-core host
def test_serve_lora_adapters_answer_like_their_merged_models(smollm2, adapted):
    import openai
    from openai import OpenAI
    from transformers import AutoTokenizer

    from workbench.serving import api_key

    start = time.perf_counter()
    adapters, want = adapted["adapters"], adapted["want"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
    base = smollm2.folder.name
    with workbench_serve("--model", str(smollm2.folder), "--plan", "dp=1", "--lora",
                         f"a={adapters['a']}", "--lora", f"b={adapters['b']}") as served:
        client = OpenAI(base_url=served.url + "/v1", api_key=api_key(served.port),
                        max_retries=0)
        print(f"served: {time.perf_counter() - start:.0f} s")
        listed = {m.id: m for m in client.models.list().data}
        assert list(listed) == [base, "a", "b"]
        assert [getattr(listed[m], "parent", None) for m in listed] == [None, base, base]

        def ask(job: tuple[str | None, int]) -> tuple[str | None, int, str]:
            name, i = job
            got = client.chat.completions.create(
                model=name or base, max_tokens=real_model.NEW, temperature=0,
                messages=[{"role": "user", "content": real_model.CHAT[ASKED[i]]}])
            assert got.model == (name or base)
            return name, i, got.choices[0].message.content

        jobs = [(name, i) for i in range(len(ASKED)) for name in ("a", None, "b")]
        with ThreadPoolExecutor(len(jobs)) as pool:  # all in flight together
            answers = list(pool.map(ask, jobs))
        print(f"answered: {time.perf_counter() - start:.0f} s")
        for name, i, text in answers:
            assert text == tokenizer.decode(want[name][i], skip_special_tokens=True), (name, i)
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="c", prompt="hello", max_tokens=2)
        assert missing.value.body["message"] == (f"the model 'c' does not exist; this endpoint "
                                                 f"serves '{base}', 'a', 'b'")
    assert served.proc.returncode == 0, served.output
    assert f"serving {base} with LoRA adapters a, b at" in served.output, served.output


@pytest.mark.parametrize("given, says", [
    ("a", "--lora 'a': give NAME=DIR, e.g. --lora sql=./sql-adapter"),
    ("a={missing}", "--lora 'a={missing}': {missing} is not a peft adapter folder (no "
                    "adapter_config.json; write one with PeftModel.save_pretrained(folder))"),
])
def test_a_bad_lora_is_one_line_before_any_pool(tmp_path, given, says):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    missing = tmp_path / "missing"
    result = subprocess.run([sys.executable, "-m", "workbench.cli", "serve", "--model",
                             str(tmp_path / "model"), "--lora", given.format(missing=missing)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"workbench serve: {says.format(missing=missing)}"]
