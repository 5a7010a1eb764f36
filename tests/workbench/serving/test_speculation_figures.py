"""Speculative decoding's acceptance reaches the endpoint's ``/metrics`` and the dashboard's
inference title from the engines' stats blocks (``spec_drafted_tokens``,
``spec_accepted_tokens``): counters that add each replica's new drafts once however often a
block is published, start again when a replica's engine is rebuilt, and a ratio over
replicas; a title that says nothing about speculation until some request speculated; the
OpenAI body's ``speculate`` field, checked and in the OpenAPI document. The live
path (a speculative request through the endpoint) is in ``test_serving.py``. Cost: < 0.1 s.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kernels_runtime.telemetry import TELEMETRY_KEY
from workbench.serving.metrics import Metrics
from workbench.ui.dashboard import RunHistory
from workbench.ui.dashboard.inference import inference_title


def _block(replica: int, drafted: int, accepted: int) -> dict:
    return {"replica": replica, "leader": True, "running": 1, "waiting": 0, "swapped": 0,
            "blocks_total": 8, "blocks_used": 2, "blocks_shared": 0,
            "spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted}


def _read(metrics: Metrics) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(
        metrics.text().decode()) for s in family.samples}


def test_metrics_count_each_replicas_drafts_once():
    m = Metrics()
    m.engines([_block(0, 10, 4), _block(1, 0, 0)])
    m.engines([_block(0, 10, 4), _block(1, 6, 6)])  # replica 0 published again, unchanged
    got = _read(m)
    assert got["workbench_spec_draft_tokens_total"] == 16
    assert got["workbench_spec_accepted_tokens_total"] == 10
    assert got["workbench_spec_acceptance_rate"] == 10 / 16
    m.engines([_block(0, 3, 1), _block(1, 6, 6)])  # replica 0's engine rebuilt
    got = _read(m)
    assert got["workbench_spec_draft_tokens_total"] == 19
    assert got["workbench_spec_accepted_tokens_total"] == 11
    assert got["workbench_spec_acceptance_rate"] == 7 / 9
    fresh = _read(Metrics())
    assert fresh["workbench_spec_draft_tokens_total"] == 0
    assert fresh["workbench_spec_acceptance_rate"] == 0


def test_the_dashboard_title_gives_acceptance_once_a_request_speculated():
    history = RunHistory([0, 1])
    history.ingest({0: {TELEMETRY_KEY: {"inference": _block(0, 0, 0), "seq": 1}},
                    1: {TELEMETRY_KEY: {"inference": _block(1, 0, 0), "seq": 1}}})
    assert "speculation" not in inference_title(history)
    history.ingest({0: {TELEMETRY_KEY: {"inference": _block(0, 30, 12), "seq": 2}},
                    1: {TELEMETRY_KEY: {"inference": _block(1, 10, 10), "seq": 2}}})
    assert inference_title(history).endswith(
        " · speculation: 22/40 drafts accepted (55%)")


def test_a_body_turns_speculation_on_per_request():
    from workbench.serving.openai_api import COMPLETION, ApiError, sampling
    from workbench.serving.openapi_schema import openapi

    assert sampling({"speculate": 4}, "completion", COMPLETION)["speculate"] == 4
    assert sampling({}, "completion", COMPLETION)["speculate"] == 0  # off unless asked
    for bad in (-1, 17, "yes", True, 2.5):
        with pytest.raises(ApiError, match="speculate must be an integer in") as err:
            sampling({"speculate": bad}, "completion", COMPLETION)
        assert err.value.param == "speculate"
    body = openapi()["paths"]["/v1/completions"]["post"]["requestBody"]
    field = body["content"]["application/json"]["schema"]["properties"]["speculate"]
    assert (field["minimum"], field["maximum"]) == (0, 16)
