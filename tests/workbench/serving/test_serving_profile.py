"""The per-token time split of the serving path (``workbench/serving/profile.py``) on synthetic
timestamps: each part is the mean of its hop weighted by the tokens each delta carries, the
parts add up to the end-to-end latency, and malformed stamps (they cross the network) are
counted and left out instead of skewing the figures."""

from __future__ import annotations

from workbench.serving.profile import PARTS, STAMPS, ServingProfile, rows


def _stamps(start: int, gaps: list[int]) -> list[int]:
    out = [start]
    for g in gaps:
        out.append(out[-1] + g)
    return out


def test_parts_are_token_weighted_means_that_add_up_to_the_latency():
    profile = ServingProfile()
    profile.record(_stamps(1000, [1, 10, 2, 3, 4, 5]), tokens=1)
    profile.record(_stamps(5000, [3, 20, 2, 3, 0, 5]), tokens=3)
    split = profile.summary()
    assert split["tokens"] == 4
    means = [ms * 1e6 for ms, _ in split["parts"].values()]  # ns per token
    assert means == [(1 + 3 * 3) / 4, (10 + 3 * 20) / 4, 2, 3, (4 + 0) / 4, 5]
    assert abs(sum(means) / 1e6 - split["total_ms"]) < 1e-12
    assert abs(split["latency_ms"] - split["total_ms"]) < 1e-12
    assert abs(sum(share for _, share in split["parts"].values()) - 1) < 1e-9
    assert [r[0] for r in rows(split)][:-1] == list(PARTS)


def test_malformed_stamps_are_rejected_and_rounds_merge():
    profile = ServingProfile()
    good = _stamps(0, [1] * (len(STAMPS) - 1))
    for bad in (good[:-1], [*good[:-1], "x"], [*good[:-1], -5], None, [True] * len(STAMPS)):
        profile.record(bad, tokens=1)
    profile.record(good, tokens=0)  # a delta with no token (a held-back or final one)
    assert profile.summary()["rejected"] == 5 and profile.tokens == 0
    other = ServingProfile()
    other.record(good, tokens=2)
    profile.merge(other)
    split = profile.summary()
    assert split["tokens"] == 2 and split["rejected"] == 5
    assert abs(split["total_ms"] - (len(STAMPS) - 1) / 1e6) < 1e-12
