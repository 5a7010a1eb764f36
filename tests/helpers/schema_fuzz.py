"""A bounded property-based fuzz of a running ``workbench serve`` from its own OpenAPI document.

Shared by the test tier (a few examples against a tiny model) and the full tier (more examples
against the real SmolLM2): schemathesis generates bodies the document allows (POSITIVE) and
bodies it does not (NEGATIVE: wrong types, missing fields, values out of range); none may get a
5xx or a dropped connection. ``max_tokens`` is capped and ``model`` named in the document that is
fuzzed, so the run spends its time on many requests rather than on long answers, and the body's
``timeout`` kept to deadlines the request can meet (a tiny one is a 504 by design).
"""

from __future__ import annotations

ROUTES = ("/v1/completions", "/v1/chat/completions")


def fuzz_endpoint(url: str, headers: dict[str, str], model: str, examples: int,
                  max_tokens: int = 8) -> dict[int, int]:
    """Run ``examples`` generated requests per route and mode; returns the count per status."""
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
    seen: dict[int, int] = {}
    for path in ROUTES:
        operation = schema[path]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case) -> None:
                response = case.call(base_url=url, headers=headers, timeout=120)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                assert response.status_code < 500, (case.body, response.text[:500])

            call()
    return dict(sorted(seen.items()))
