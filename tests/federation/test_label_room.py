"""The label room (`federation/robust/label_room.py`): which new labels enter the prototype
library, by hand and as properties."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefcl.config import FedConfig
from edgefcl.data.labels import MAX_LABELS
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.robust.label_room import admit, quota


def table(labels) -> LabelRows:
    n = len(labels)
    return LabelRows(tuple(labels), np.arange(2 * n, dtype=np.float32).reshape(n, 2),
                     np.ones(n, np.int64))


def test_the_quota_is_the_share_caps_bound() -> None:
    assert quota(FedConfig(clients=3), 3) == MAX_LABELS // 2  # 2/3, at most half
    assert quota(FedConfig(clients=100), 100) == 20  # 2/100 of 1,024
    assert quota(FedConfig(max_share=0.25), 3) == 256
    assert quota(FedConfig(max_share=1.0), 3) == MAX_LABELS  # off


def test_shared_labels_first_then_each_devices_own_in_turns() -> None:
    library = table([f"k{i}" for i in range(MAX_LABELS - 4)])  # room for 4 new labels
    sent = [table(["a1", "a2", "a3", "both"]), table(["b1", "both", "k0"])]
    counters: Counter = Counter()
    out, owners = admit(sent, ["a", "b"], library, {"k0": "a"}, limit=10, counters=counters)
    # "both" (two senders) first, charged to b (a holds k0), then a1, b1, a2 in turns; a3
    # is left out
    assert out[0].labels == ("a1", "a2", "both") and out[1].labels == ("b1", "both", "k0")
    assert out[0].rows.tolist() == [[0, 1], [2, 3], [6, 7]]  # the kept labels' own rows
    assert owners == {"k0": "a", "both": "b", "a1": "a", "a2": "a", "b1": "b"}
    assert counters["prototype_labels_left_out"] == 1


def test_a_device_at_its_quota_adds_nothing_and_a_shared_label_stays_charged() -> None:
    library = table(["x", "y"])
    owners = {"x": "a", "y": "a"}
    out, after = admit([table(["x", "z"])], ["a"], library, owners, limit=2,
                       counters=Counter())
    assert out[0].labels == ("x",) and after == owners
    # b sends x too: x stays a's, so a still has no room; z, sent by both, is charged to b
    out, after = admit([table(["z", "w"]), table(["x", "z"])], ["a", "b"], library, owners,
                       limit=2, counters=Counter())
    assert out[0].labels == ("z",) and after == {"x": "a", "y": "a", "z": "b"}
    assert owners == {"x": "a", "y": "a"}  # the caller's owners are left as they were


def test_two_colluders_cannot_launder_labels_past_their_quotas() -> None:
    # a reviewer helper's attack: a label stopped counting against its owner once another
    # device sent it, so two devices that each sent the other's labels of the last round (or
    # the same new ones together) freed their quotas every round: 1,022 of the 1,024 slots
    library, owners, last = table(["cat", "dog"]), {}, {"a": [], "b": []}
    for r in range(30):
        new = {c: [f"{c}{r:02d}-{i:02d}" for i in range(20)] for c in "ab"}
        both = [f"ab{r:02d}-{i:02d}" for i in range(20)]  # new labels sent by both
        tables = [table(sorted(new["a"] + last["b"] + both)),
                  table(sorted(new["b"] + last["a"] + both))]
        out, owners = admit(tables, ["a", "b"], library, owners, limit=20, counters=Counter())
        entered = sorted(set().union(*(t.labels for t in out)) - set(library.labels))
        library = table([*library.labels, *entered])
        last = new
    assert len(library.labels) - 2 <= 40  # the two quotas
    assert Counter(owners.values()) == {"a": 20, "b": 20}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), max_size=30), min_size=1, max_size=4),
       st.integers(0, 30), st.integers(1, 20))
def test_no_device_owns_more_than_its_quota_and_the_library_never_overflows(
        sends, held, limit) -> None:
    library = table([f"k{i}" for i in range(MAX_LABELS - held)])
    clients = [f"c{i}" for i in range(len(sends))]
    tables = [table(sorted({f"n{v}" for v in s})) for s in sends]
    out, owners = admit(tables, clients, library, {}, limit, Counter())
    new = set().union(*(t.labels for t in out))
    assert len(library.labels) + len(new) <= MAX_LABELS
    assert all(n <= limit for n in Counter(owners.values()).values())
    for t, kept in zip(tables, out, strict=True):
        assert set(kept.labels) <= set(t.labels)  # only left out, never added
    assert set(owners) == new  # every label that entered is charged to one of its senders
    for label, owner in owners.items():
        assert any(label in t.labels for c, t in zip(clients, tables, strict=True)
                   if c == owner)
