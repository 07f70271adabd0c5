"""Keep Python's garbage collector off a daemon's message path.

A full (generation 2) collection walks every live container object: in a process that holds a
model and its libraries that is a pause of 100-300 ms in the middle of some message. What a
daemon builds at start-up lives as long as the process, so it is moved out of the collector's
reach once, when start-up is over (`gc.freeze`); later collections only walk what messages
create.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how
    many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
