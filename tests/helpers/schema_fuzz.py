"""A bounded property-based fuzz of a running ``workbench serve`` from its own OpenAPI document.

Shared by the test tier (a few examples against a tiny model) and the full tier (more examples
against the real SmolLM2): schemathesis generates bodies the document allows (POSITIVE) and
bodies it does not (NEGATIVE: wrong types, missing fields, values out of range); none may get a
5xx or a dropped connection. ``max_tokens`` is capped and ``model`` named in the document that is
fuzzed, so the run spends its time on many requests rather than on long answers, and the body's
``timeout`` kept to deadlines the request can meet (a tiny one is a 504 by design).

The cases are generated first and then sent ``workers`` at a time: the server batches
concurrent requests, so the same requests take about a third of the time they took one after
another (the full tier's 160 against SmolLM2 on dp=2: 28 s against 93 s at load 5-7), and the
endpoint is fuzzed under concurrent load as it is served. A failing case is reported with its
body (no shrinking: the body that failed is the one to read).
"""

from __future__ import annotations

ROUTES = ("/v1/completions", "/v1/chat/completions")


def fuzz_endpoint(url: str, headers: dict[str, str], model: str, examples: int,
                  max_tokens: int = 8, workers: int = 8) -> dict[int, int]:
    """Send ``examples`` generated requests per route and mode, ``workers`` at a time; returns
    the count per status."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import schemathesis.openapi
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    document = httpx.get(url + "/openapi.json").json()
    for path in ROUTES:
        body = document["paths"][path]["post"]["requestBody"]["content"][
            "application/json"]["schema"]["properties"]
        body["model"] = {"type": "string", "enum": [model]}
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body:
                body[key]["maximum"] = max_tokens
        # a deadline the request may meet: a tiny one is a 504 by design (test_request_deadline)
        body["timeout"] = {"type": "number", "minimum": 120, "maximum": 600, "nullable": True}
    schema = schemathesis.openapi.from_dict(document)
    cases = []
    for path in ROUTES:
        operation = schema[path]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def collect(case) -> None:
                cases.append(case)

            collect()

    def call(case) -> int:
        response = case.call(base_url=url, headers=headers, timeout=120)
        assert response.status_code < 500, (case.path, case.body, response.text[:500])
        return response.status_code

    seen: dict[int, int] = {}
    with ThreadPoolExecutor(workers) as pool:
        for status in pool.map(call, cases):  # the first failure raises here
            seen[status] = seen.get(status, 0) + 1
    return dict(sorted(seen.items()))
