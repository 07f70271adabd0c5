"""One incoming message handled as a daemon must: a failure is counted and logged, never
raised (the daemon never exits on input), and the handling's CPU time counts against its
sender's share of the main loop (`Inbox.charging`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from edgefcl.runtime.inbox import Inbox
from edgefcl.transport.codec import CodecError


def handle_safely(step: Callable[[], None], topic: str, sender: str | None, inbox: Inbox,
                  counters: Counter, log: logging.Logger) -> None:
    """Run `step` (handling a message on `topic`), charged to `sender` (None: no one);
    a CodecError counts as `rejected_<reason>`, any other exception (a bug reached by input)
    as `rejected_internal`."""
    with inbox.charging(sender):
        try:
            step()
        except CodecError as e:
            counters[f"rejected_{e.reason}"] += 1
            log.warning("rejected payload on %s: %s", topic, e,
                        extra={"device": topic if sender is None else sender})
        except Exception:
            counters["rejected_internal"] += 1
            log.exception("internal error while handling a message on %s", topic)
