"""Label room: the prototype library's MAX_LABELS slots are shared by the fleet, so that one
device cannot fill them with labels it invents (the open label space's share cap).

Every label in the library is charged to one device (`owners`): the one that introduced it,
or of the devices that introduced it in the same round the one with the most room left. A
device may be charged at most `quota` labels: the share cap's bound (`fed.max_share`; 0: twice
an equal share of the roster, at most half) of MAX_LABELS, and none at all with `max_share` >= 1
(off). A label stays charged when other devices send it later: freed once another device sent
it, two colluding devices that each resent the other's labels of the last round had their
quotas freed every round and took 1,022 of the 1,024 slots. Each round the new labels enter in
this order while the library has room: those two devices or more sent (charged to the sender
with the most room; left out when none has room), then each device's own in name order, taken
in turns (one each per turn, devices in id order) up to its quota. A new label left out is left
out of that round's tables (`prototype_labels_left_out`, one per row); it may enter later, when
a sender of it has room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from edgefcl.config import FedConfig
from edgefcl.data.labels import MAX_LABELS
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.share_cap import default_cap


def quota(fed: FedConfig, roster: int) -> int:
    """The most library labels one device may own among a roster of `roster` devices."""
    if fed.max_share >= 1:
        return MAX_LABELS
    cap = fed.max_share if fed.max_share > 0 else default_cap(roster)
    return max(1, int(cap * MAX_LABELS))


def admit(tables: Sequence[LabelRows], senders: Sequence[str], library: LabelRows,
          owners: dict[str, str], limit: int, counters: Counter
          ) -> tuple[list[LabelRows], dict[str, str]]:
    """`tables` (sent by `senders`, one each) without the rows of the new labels that do not
    enter the `library` this round, and the owners after the round (label -> the device it is
    charged to; a new dict, `owners` is left as it is)."""
    owners = dict(owners)
    known = set(library.labels)
    new: dict[str, set[str]] = {}
    for client, t in zip(senders, tables, strict=True):
        for label in t.labels:
            if label not in known:
                new.setdefault(label, set()).add(client)
    if not new:
        return list(tables), owners
    room = MAX_LABELS - len(known)
    held = Counter(owners.values())
    enter: list[str] = []
    for label in sorted(lb for lb, clients in new.items() if len(clients) > 1):
        payer = min(new[label], key=lambda c: (held[c], c))  # the most room, then by id
        if room > 0 and held[payer] < limit:
            enter.append(label)
            owners[label] = payer
            held[payer] += 1
            room -= 1
    own: dict[str, list[str]] = {}
    for label in sorted(new):
        if len(new[label]) == 1:
            own.setdefault(next(iter(new[label])), []).append(label)
    queues = {c: iter(labels) for c, labels in sorted(own.items())}
    while room > 0 and queues:  # one label per device per turn, while it has quota
        for client in list(queues):
            label = next(queues[client], None) if held[client] < limit else None
            if label is None:
                del queues[client]
            elif room > 0:
                enter.append(label)
                owners[label] = client
                held[client] += 1
                room -= 1
    keep = known | set(enter)
    out = []
    for t in tables:
        mask = np.array([label in keep for label in t.labels], dtype=bool)
        if mask.all():
            out.append(t)
            continue
        counters["prototype_labels_left_out"] += int((~mask).sum())
        out.append(LabelRows(tuple(lb for lb, k in zip(t.labels, mask, strict=True) if k),
                             t.rows[mask], t.counts[mask],
                             None if t.sigmas is None else t.sigmas[mask]))
    return out, owners
