"""The share cap's water-filling (federation/share_cap.py): hand-computed values, and the
grouped form against the plain one on every member's row."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefcl.federation.share_cap import capped_columns, capped_member_columns


def test_a_lone_member_is_capped_at_its_share_by_hand():
    # 4 members of 60 and one of 2e6, cap 0.4: the large one at L with L = 0.4 (240 + L),
    # L = 160 (160 / 400 = 0.4); the others as they were
    out = capped_member_columns(np.array([[60.0, 1.0], [2e6, 1.0]]), np.array([4, 1]), 0.4)
    np.testing.assert_allclose(out, [[60.0, 1.0], [160.0, 1.0]])


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5).flatmap(lambda p: st.tuples(
    st.lists(st.integers(1, 4), min_size=p, max_size=p),
    st.lists(st.lists(st.floats(0.0, 1e6), min_size=3, max_size=3), min_size=p, max_size=p),
    st.floats(0.05, 0.7))))
def test_groups_capped_as_every_member_alone(case):
    members, weights, cap = case
    w, n = np.asarray(weights), np.asarray(members)
    grouped = capped_member_columns(w, n, cap)
    each = capped_columns(np.repeat(w, n, axis=0), cap)
    first = np.cumsum(n) - n  # each group's first member
    np.testing.assert_allclose(grouped, each[first], rtol=1e-9, atol=1e-9)
