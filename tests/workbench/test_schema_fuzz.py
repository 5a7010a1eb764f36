"""A property-based fuzz of ``workbench serve`` of the real SmolLM2 from its OpenAPI document.

What is protected (issue 26's Must-show): requests schemathesis generates from
``/openapi.json`` (bodies the document allows, and bodies it does not: wrong types, missing
fields, values out of range) never get a 5xx or a dropped connection, and afterwards the
endpoint is healthy and the same greedy request returns the same text as before. The document
served is fuzzed as served, except that ``max_tokens`` is capped at 8 and ``model`` named, so
the bounded run spends its time on many requests rather than on long answers.
"""

from __future__ import annotations

import pytest

from helpers.serve_cli import workbench_serve

pytestmark = [pytest.mark.full, pytest.mark.engines]  # the real model on 2 ranks, minutes
EXAMPLES = 40  # per route and mode


def test_generated_requests_never_get_a_5xx_and_the_endpoint_serves_on(smollm2):
    import httpx
    import schemathesis.openapi
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    from workbench.serving import api_key

    model = smollm2.folder.name
    with workbench_serve("--model", str(smollm2.folder), "--plan", "dp=2") as served:
        headers = {"Authorization": f"Bearer {api_key(served.port)}"}
        greedy = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                  "temperature": 0}
        before = httpx.post(served.url + "/v1/completions", json=greedy, headers=headers,
                            timeout=120)
        assert before.status_code == 200, before.text
        document = httpx.get(served.url + "/openapi.json").json()
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = document["paths"][path]["post"]["requestBody"]["content"][
                "application/json"]["schema"]["properties"]
            body["model"] = {"type": "string", "enum": [model]}
            for key in ("max_tokens", "max_completion_tokens"):
                if key in body:
                    body[key]["maximum"] = 8
        schema = schemathesis.openapi.from_dict(document)
        seen: dict[int, int] = {}
        for path in ("/v1/completions", "/v1/chat/completions"):
            operation = schema[path]["POST"]
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def call(case) -> None:
                    response = case.call(base_url=served.url, headers=headers, timeout=120)
                    seen[response.status_code] = seen.get(response.status_code, 0) + 1
                    assert response.status_code < 500, (case.body, response.text[:500])

                call()
        print(f"statuses over the fuzz run: {dict(sorted(seen.items()))}")
        assert seen.get(200) and seen.get(400), seen  # both kinds of request were made
        assert httpx.get(served.url + "/health").status_code == 200
        after = httpx.post(served.url + "/v1/completions", json=greedy, headers=headers,
                           timeout=120)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == \
            before.json()["choices"][0]["text"]
    assert served.proc.returncode == 0, served.output
