"""Offload fields of ``Plan``: sizes and fractions parse, print back exactly, and every budget or
share that cannot work is refused with the field's name and a fix, before any rank works."""

from __future__ import annotations

import pytest

from kernels_runtime.byte_sizes import format_bytes, human_bytes, parse_bytes
from kernels_runtime.mesh.plan import Plan, PlanError

SIZES = [
    ("256MiB", 256 * 2**20),
    ("2GiB", 2 * 2**30),
    ("1.5GB", 1_500_000_000),
    ("512mb", 512_000_000),
    ("4096", 4096),
    ("64KiB", 64 * 2**10),
    ("1TiB", 2**40),
    ("10B", 10),
    ("3kb", 3000),
    ("2tb", 2 * 10**12),
    ("0", 0),
]


@pytest.mark.parametrize("text, n", SIZES)
def test_parse_bytes_reads_decimal_and_binary_units_in_any_case(text, n):
    assert parse_bytes(text) == n
    assert parse_bytes(text.upper()) == n
    assert parse_bytes(format_bytes(n)) == n


@pytest.mark.parametrize("text", ["-1GiB", "abc", "", "2 parsecs", "1.5XB", "GiB", "1,5GB"])
def test_parse_bytes_refuses_junk_naming_the_text_and_an_example(text):
    with pytest.raises(ValueError, match=rf"{text!r} is not a size.*e\.g\. 256MiB"):
        parse_bytes(text)


@pytest.mark.parametrize("n, text", [
    (268435456, "256MiB"), (1000, "1000"), (0, "0"), (1536, "1536"), (2**30, "1GiB"),
    (3 * 2**40, "3TiB"), (5 * 2**10, "5KiB"), (1_500_000_000, "1500000000"),
])
def test_format_bytes_is_exact(n, text):
    assert format_bytes(n) == text
    assert parse_bytes(text) == n


@pytest.mark.parametrize("n, text", [
    (1.5 * 2**30, "1.50 GiB"), (12 * 2**20, "12.0 MiB"), (512, "512 B"), (2**10, "1.00 KiB"),
])
def test_human_bytes_rounds_for_messages(n, text):
    assert human_bytes(n) == text


ROUND_TRIPS = [
    "dp=2 zero=3 offload=auto device_mem=256MiB host_mem=1GiB",
    "dp=2 zero=2 offload=static offload_optim=1 offload_params=0.5 host_mem=0",
    "zero=3 offload=static offload_grads=0.125 device_mem=1.5GB",
    "zero=2 offload=static offload_params=0.1 offload_grads=0.3333333333333333",
    "zero=3 offload=auto device_mem=1000 host_mem=64KiB",
]


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_offload_plans_round_trip_through_their_string(text):
    p = Plan.parse(text)
    assert Plan.parse(p.to_string()) == p


def test_offload_fields_parse_to_bytes_and_floats_and_print_compactly():
    p = Plan.parse("zero=2 offload=static offload_optim=1 offload_params=0.5 "
                   "device_mem=2GiB host_mem=0")
    assert (p.device_mem, p.host_mem) == (2 * 2**30, 0)
    assert (p.offload_params, p.offload_grads, p.offload_optim) == (0.5, 0.0, 1.0)
    text = p.to_string()
    assert "device_mem=2GiB" in text and "host_mem=0" in text
    assert "offload_params=0.5 " in text and "offload_optim=1" in text
    assert "offload_grads" not in text  # defaults stay out of the canonical form
    assert Plan().device_mem is None and Plan().offload_params == 0.0


def test_code_built_fractions_round_trip_exactly():
    p = Plan(zero_stage=3, offload="static", offload_params=1 / 3, offload_optim=0.7)
    assert Plan.parse(p.to_string()) == p


@pytest.mark.parametrize("text, message", [
    ("device_mem=lots", "device_mem='lots': 'lots' is not a size.*e.g. 256MiB"),
    ("host_mem=-1GiB", "host_mem='-1GiB'.*not a size"),
    ("offload_params=x", r"offload_params='x' is not a number between 0 and 1 "
                         r"\(e.g. offload_params=0.5\)"),
    ("offload_grads=half", "offload_grads='half' is not a number"),
])
def test_unparseable_offload_values_name_the_key(text, message):
    with pytest.raises(PlanError, match=message):
        Plan.parse(text)


REFUSED = [
    ("dp=2 zero=2 offload=static offload_params=1.5", "offload_params=1.5 .*from 0 to 1"),
    ("dp=2 zero=2 offload=static offload_grads=-0.5", "offload_grads=-0.5 .*from 0 to 1"),
    ("dp=2 zero=2 offload_params=0.5", "offload_params=0.5 needs offload=static"),
    ("dp=2 zero=2 offload=auto offload_optim=1", "offload_optim=1 needs offload=static"),
    ("dp=2 zero=2 offload=static", "nothing to offload: set offload_params, offload_grads "
                                   r"and/or offload_optim \(0 to 1\)"),
    ("dp=2 zero=2 device_mem=2GiB", "device_mem=2GiB is a budget for offload=auto or static; "
                                    "add offload=auto"),
    ("dp=2 zero=2 host_mem=0", "host_mem=0 is a budget for offload=auto or static"),
    ("dp=2 zero=2 offload=auto device_mem=0", "device_mem=0: .*device_mem=256MiB"),
    ("dp=2 zero=1 offload=auto", "offload=auto with zero=1: offload keeps each rank's "
                                 "gradient and optimizer shards in chunks: use zero=2 or zero=3"),
    ("dp=2 offload=static offload_params=1", "offload=static with zero=0.*use zero=2 or zero=3"),
    ("pp=2 mb=4 zero=2 offload=auto", r"offload with pipeline parallelism \(pp=2\) is not "
                                      "available yet: use pp=1 or offload=none"),
    ("pp=2 mb=4 zero=1 offload=auto", r"pipeline parallelism \(pp=2\)"),
]


@pytest.mark.parametrize("text, message", REFUSED)
def test_impossible_offload_plans_name_the_field_and_a_fix(text, message):
    with pytest.raises(PlanError, match=message):
        Plan.parse(text).validate(Plan.parse(text).pp * 2)


@pytest.mark.parametrize("plan, message", [
    (Plan(dp=2, zero_stage=2, offload="auto", device_mem=-5), "device_mem=-5: "),
    (Plan(dp=2, zero_stage=2, offload="auto", host_mem=-1), "host_mem=-1 is negative"),
    (Plan(dp=2, zero_stage=3, offload="static", offload_params=float("nan")), "from 0 to 1"),
])
def test_code_built_budgets_and_shares_are_checked_too(plan, message):
    with pytest.raises(PlanError, match=message):
        plan.validate(2)


ACCEPTED = [
    ("dp=2 zero=3 offload=auto device_mem=256MiB host_mem=1GiB", 2),
    ("dp=2 zero=2 offload=static offload_optim=1 offload_params=0.5 host_mem=0", 2),
    ("zero=3 offload=auto", 1),  # one rank offloading to its own host: ZeRO at dp=1 is fine
    ("tp=2 zero=2 offload=static offload_grads=0.25", 4),
    ("dp=2 zero=3 offload=static offload_params=1 offload_grads=1 offload_optim=1", 2),
]


@pytest.mark.parametrize("text, world", ACCEPTED)
def test_offload_plans_that_work_validate(text, world):
    p = Plan.parse(text).validate(world)
    assert p.offload != "none" and p.dp == world // p.tp


def test_plans_without_offload_still_refuse_zero_at_dp_1():
    with pytest.raises(PlanError, match="dp=1"):
        Plan.parse("zero=3").validate(1)
