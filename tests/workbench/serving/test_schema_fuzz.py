"""A property-based fuzz of ``workbench serve`` of the real SmolLM2 from its OpenAPI document.

What is protected (issue 26's Must-show): requests schemathesis generates from
``/openapi.json`` (bodies the document allows, and bodies it does not: wrong types, missing
fields, values out of range) never get a 5xx or a dropped connection, and afterwards the
endpoint is healthy and the same greedy request returns the same text as before. ``make test`` runs
the same fuzz, fewer examples, against a tiny model (``test_serve_first_commands.py``).
"""

from __future__ import annotations

import pytest

from helpers.schema_fuzz import fuzz_endpoint
from helpers.serve_cli import workbench_serve

pytestmark = [pytest.mark.full, pytest.mark.engines]  # the real model on 2 ranks, minutes
EXAMPLES = 40  # per route and mode


def test_generated_requests_never_get_a_5xx_and_the_endpoint_serves_on(smollm2):
    import httpx

    from workbench.serving import api_key

    model = smollm2.folder.name
    with workbench_serve("--model", str(smollm2.folder), "--plan", "dp=2") as served:
        headers = {"Authorization": f"Bearer {api_key(served.port)}"}
        greedy = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                  "temperature": 0}
        before = httpx.post(served.url + "/v1/completions", json=greedy, headers=headers,
                            timeout=120)
        assert before.status_code == 200, before.text
        seen = fuzz_endpoint(served.url, headers, model, EXAMPLES)
        print(f"statuses over the fuzz run: {seen}")
        assert seen.get(200) and seen.get(400), seen  # both kinds of request were made
        assert httpx.get(served.url + "/health").status_code == 200
        after = httpx.post(served.url + "/v1/completions", json=greedy, headers=headers,
                           timeout=120)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == \
            before.json()["choices"][0]["text"]
    assert served.proc.returncode == 0, served.output
