"""Byte quantities: parsing "2GiB"-style strings and formatting counts."""

from __future__ import annotations

import re

import pytest

from scamp_jax._units import format_bytes, format_share, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("16GB", 16 * 10**9),
        ("1.5k", 1536),
        ("100", 100),
        ("3 B", 3),
        ("1e3 kb", 10**6),
        (" 4 TiB ", 4 * 2**40),
        ("2g", 2 * 2**30),
    ],
)
def test_parse_bytes_reads_binary_and_decimal_units(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_accepts_numbers():
    assert parse_bytes(4096) == 4096
    assert parse_bytes(1.9e3) == 1900


@pytest.mark.parametrize("bad", ["", "GiB", "2 parsecs", "-1GiB", "1..5GB", "two GiB"])
def test_parse_bytes_rejects_unreadable_strings_with_the_value_in_the_message(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [0, -5, "0GiB", "0 B"])
def test_parse_bytes_rejects_sizes_that_are_not_positive(bad):
    with pytest.raises(ValueError, match="positive"):
        parse_bytes(bad)


@pytest.mark.parametrize(("bad", "advice"), [
    (1.5, "did you leave out its unit? e.g. '1.5GiB' or '1.5GB'"),
    ("1.5", "did you leave out its unit? e.g. '1.5GiB' or '1.5GB'"),
    (0.4, "did you leave out its unit? e.g. '0.4GiB' or '0.4GB'"),
    ("0.4 B", "give it in a larger unit, e.g. GiB")])
def test_a_fraction_of_a_byte_is_a_size_whose_unit_was_left_out(bad, advice):
    """``--memory-per-device 1.5`` (meant: 1.5 GiB) is not one byte: the error names the units
    it may have meant. A larger fraction (a size computed, e.g. 0.9 of a GiB) is cut off."""
    with pytest.raises(ValueError, match=re.escape(
            f"memory size {bad!r} is not a whole number of bytes; {advice}")):
        parse_bytes(bad)
    assert parse_bytes(0.9 * 2**30) == 966_367_641 and parse_bytes("1024.5") == 1024


@pytest.mark.parametrize("bad", [True, None, [1], b"1GiB"])
def test_parse_bytes_rejects_other_types(bad):
    with pytest.raises(TypeError, match="2GiB"):
        parse_bytes(bad)


@pytest.mark.parametrize(
    ("count", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 * 2**30, "3.00 GiB"),
     (1.5 * 2**20, "1.50 MiB"), (-2048, "-2.00 KiB"), (5 * 2**50, "5120.00 TiB")],
)
def test_format_bytes_uses_binary_units(count, text):
    assert format_bytes(count) == text


def test_format_then_parse_round_trips_to_the_printed_precision():
    for count in (1, 1000, 123_456_789, 7 * 2**40):
        assert abs(parse_bytes(format_bytes(count).replace(" ", "")) - count) <= 0.005 * count + 1


@pytest.mark.parametrize(("fraction", "text"), [
    (0.5492, "54.9%"), (0.003, "0.3%"), (0.0005, "0.05%"), (0.0004, "0.04%"),
    (0.0000213, "0.0021%"), (0.00000026, "0.000026%"), (0.0, "0%"), (1.0, "100.0%")])
def test_a_share_too_small_for_one_decimal_is_not_shown_as_none(fraction, text):
    """A study's mean memory booked of a large pool (20 MiB of 8 GiB) is no "0.0%"."""
    assert format_share(fraction) == text


def test_a_long_reason_is_cut_at_a_word_unless_that_loses_most_of_it():
    from scamp_jax._units import shortened

    assert shortened("ValueError: bad\n  width", 120) == "ValueError: bad width"
    assert shortened("one two three four five six", 16) == "one two ..."
    # a path is cut inside it, not left out whole; so is one long word
    path = "FileNotFoundError: No such file: '/data/" + "x" * 200 + "/a.png'"
    cut = shortened(path, 60)
    assert len(cut) == 60 and cut.startswith("FileNotFoundError: No such file: '/data/xxx")
    assert cut.endswith("x ...")
    assert shortened("y" * 300, 10) == "yyyyyy ..."
