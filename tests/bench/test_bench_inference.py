"""``python -m bench inference --quick`` runs end to end on 2 real ranks and reports its figures
(nothing about time is asserted): the benchmark stays runnable; its KV utilisation is a
fraction of allocated slots and above contiguous allocation's; prefix sharing took blocks from
the index and kept fewer blocks in use; prompt-lookup speculation left the greedy tokens
unchanged (the bench asserts it) and accepted drafts; the workload is the same on every
side."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.full  # a --quick benchmark run
def test_the_inference_benchmark_reports_its_figures(capsys, smollm2):
    from bench.inference.run import main

    figures = main(["--quick", "--smollm2", str(smollm2.folder)])
    printed = capsys.readouterr().out
    assert figures["pipeline"] > 0  # pp=2 overlapped / plain tokens/s (tokens asserted equal)
    assert set(figures) == {"ratio", "static", "utilisation", "hits", "speculation", "pipeline",
                            "acceptance", "static_cpu", "prefix_speedup", "prefix_cpu_speedup",
                            "draft_speculation", "draft_acceptance", "drained"}
    assert figures["ratio"] > 0 and figures["static"] > 0 and figures["static_cpu"] > 0
    assert figures["drained"] > 0
    assert figures["prefix_speedup"] > 0 and figures["prefix_cpu_speedup"] > 0
    assert 0.5 < figures["utilisation"] <= 1.0
    assert figures["hits"] > 0
    assert figures["speculation"] > 0 and 0 < figures["acceptance"] <= 1
    assert figures["draft_speculation"] > 0 and 0 <= figures["draft_acceptance"] <= 1
    for words in ("engine / HF generate", "(aim >= 5x)", "aim >= 96%", "contiguous per request",
                  "time to first token p50", "peak blocks in use",
                  "prompt-lookup speculation", "greedy tokens identical",
                  "pp=2 overlapped / plain tokens/s", "draft-model speculation",
                  "with static batches", "with drained batches"):
        assert words in printed, words


def test_the_workload_is_mixed_and_the_same_for_every_side():
    from bench.inference.ranks import workload
    from bench.inference.run import QUICK

    first, again = workload(QUICK), workload(QUICK)
    assert first == again and len(first) == QUICK["requests"]
    prompts = [len(p) for p, _ in first]
    outputs = [n for _, n in first]
    assert min(prompts) < max(prompts) / 2 and min(outputs) < max(outputs) / 2


def test_static_batches_hold_every_row_to_its_replica_batchs_longest():
    from bench.inference.ranks import _held_to_longest

    group = [([1], 5), ([2], 9), ([3], 2), ([4], 3), ([5], 7)]
    # two replicas deal round-robin: replica 0 takes 5, 2, 7 (longest 7), replica 1 9, 3 (9)
    assert [n for _, n in _held_to_longest(group, 2)] == [7, 9, 7, 9, 7]
    assert [p for p, _ in _held_to_longest(group, 2)] == [p for p, _ in group]
