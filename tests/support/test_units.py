"""Byte counts as people read them: one unit system (SI) everywhere a table shows bytes."""

from __future__ import annotations

import pytest

from edgefcl.support.units import fmt_bytes


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (1_075_500, "1.1 MB"),
    (11_830_406, "11.8 MB"), (2_500_000_000, "2.5 GB"), (7.5e12, "7500.0 GB"), (-2048, "-2.0 kB"),
])
def test_bytes_in_si_units(n, text):
    assert fmt_bytes(n) == text
