"""MQTT topic names of one fleet (the README's "Networked runtime (MQTT)" lists them).

All topics live under `<root>/<fleet>/`:

    config              aggregator -> all       QoS 1, retained
    global              aggregator -> clients   QoS 1, retained
    tick                aggregator -> clients   QoS 1 (lock-step answers)
    update/<client>     client -> aggregator    QoS 1
    status/<client>     client -> all           QoS 1, retained (last will: offline)
    stream/<client>     replayer -> client      QoS 1
    control             operator -> all         QoS 1
    aggregator/status   aggregator -> all       QoS 1, retained (last will: offline)
    partial/<worker>    worker -> root          QoS 1 (sharded aggregation)
    workers/<worker>    worker -> root          QoS 1, retained (last will: offline)
    grant/<worker>      root -> worker          QoS 1 (the clients its next partial may hold)
"""

from __future__ import annotations

from edgefcl.transport.kinds import kinds_on

_FORBIDDEN = ("/", "+", "#", "\x00")
TOPIC_KINDS = {family: kinds_on(family) for family in ("update", "status", "stream")}
"""Message kinds accepted on each per-client topic (`transport/kinds.py`)."""
UPDATE_KINDS, STATUS_KINDS = TOPIC_KINDS["update"], TOPIC_KINDS["status"]
CONTROL_KINDS = kinds_on("control")
MAX_ID_LEN = 128


def validate_id(value: str, what: str = "client id") -> str:
    """Return `value` if it can be one MQTT topic level; raise ValueError saying what is wrong."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    bad = [c for c in _FORBIDDEN if c in value]
    if bad:
        raise ValueError(
            f"{what} {value!r} contains {', '.join(repr(c) for c in bad)}; "
            "use letters, digits, '-', '_' or '.' (no '/', '+', '#')"
        )
    if value.startswith("$"):
        raise ValueError(f"{what} {value!r} must not start with '$' (reserved by MQTT brokers)")
    if len(value) > MAX_ID_LEN:
        raise ValueError(f"{what} {value[:20]!r}... is longer than {MAX_ID_LEN} characters")
    return value


def _validate_root(root: str) -> str:
    if not isinstance(root, str) or not root or root.startswith("/") or root.endswith("/"):
        raise ValueError(f"topic root must be non-empty without leading/trailing '/', got {root!r}")
    for level in root.split("/"):
        validate_id(level, "topic root level")
    return root


class Topics:
    """Topic names for fleet `fleet` under `root` (default `edgefcl/<fleet>/...`)."""

    def __init__(self, fleet: str, root: str = "edgefcl") -> None:
        self.fleet = validate_id(fleet, "fleet id")
        self.root = _validate_root(root)
        self.base = f"{self.root}/{self.fleet}"

    def __repr__(self) -> str:
        return f"Topics(fleet={self.fleet!r}, root={self.root!r})"

    @property
    def longest(self) -> int:
        """The length of the fleet's longest possible topic (a kind and an id of MAX_ID_LEN):
        anything longer is no topic of this fleet's."""
        return len(self.base) + len("/workers/") + MAX_ID_LEN

    @property
    def config(self) -> str:
        """Run configuration (schedule, encoding, model spec hash); retained."""
        return f"{self.base}/config"

    @property
    def global_(self) -> str:
        """The current global model; retained."""
        return f"{self.base}/global"

    @property
    def global_delta(self) -> str:
        """The change from the previous global version to the new one (sparse downlink); not
        retained."""
        return f"{self.base}/global/delta"

    @property
    def tick(self) -> str:
        """Lock-step answers from the aggregator to the clients; not retained."""
        return f"{self.base}/tick"

    @property
    def control(self) -> str:
        """Operator commands (pause, resume, stop)."""
        return f"{self.base}/control"

    @property
    def aggregator_status(self) -> str:
        """The aggregator's own status (online/offline last will); retained."""
        return f"{self.base}/aggregator/status"

    def update(self, client: str) -> str:
        """Where `client` publishes its updates and lock-step ticks."""
        return f"{self.base}/update/{validate_id(client)}"

    def status(self, client: str) -> str:
        """Retained status of `client` (its last will says offline)."""
        return f"{self.base}/status/{validate_id(client)}"

    def stream(self, client: str) -> str:
        """Mini-batches replayed to `client`."""
        return f"{self.base}/stream/{validate_id(client)}"

    def partial(self, worker: str) -> str:
        """Where aggregator worker `worker` sends its partial aggregates to the root."""
        return f"{self.base}/partial/{validate_id(worker, 'worker id')}"

    def worker_status(self, worker: str) -> str:
        """Retained status of aggregator worker `worker` (its last will says offline)."""
        return f"{self.base}/workers/{validate_id(worker, 'worker id')}"

    def grant(self, worker: str) -> str:
        """Where the root answers aggregator worker `worker`'s claims."""
        return f"{self.base}/grant/{validate_id(worker, 'worker id')}"

    @property
    def partials(self) -> str:
        """Subscription pattern for every worker's partials."""
        return f"{self.base}/partial/+"

    @property
    def worker_statuses(self) -> str:
        """Subscription pattern for every worker's status."""
        return f"{self.base}/workers/+"

    def shared(self, pattern: str, group: str) -> str:
        """`pattern` as an MQTT 5 shared subscription of `group` (each message goes to one
        member of the group)."""
        return f"$share/{validate_id(group, 'share group')}/{pattern}"

    def worker_from(self, topic: str) -> tuple[str, str]:
        """(kind, worker id) of a `partial/<worker>` or `workers/<worker>` topic; raises
        ValueError for any other topic."""
        prefix = self.base + "/"
        parts = topic[len(prefix):].split("/") if topic.startswith(prefix) else []
        if len(parts) != 2 or parts[0] not in ("partial", "workers"):
            raise ValueError(f"topic {topic!r} is not a partial/<worker> or workers/<worker> "
                             f"topic of fleet {self.fleet!r}")
        return parts[0], validate_id(parts[1], "worker id")

    @property
    def updates(self) -> str:
        """Subscription pattern for every client's updates."""
        return f"{self.base}/update/+"

    @property
    def statuses(self) -> str:
        """Subscription pattern for every client's status."""
        return f"{self.base}/status/+"

    @property
    def streams(self) -> str:
        """Subscription pattern for every client's stream."""
        return f"{self.base}/stream/+"

    def kinds_on(self, topic: str) -> frozenset[str]:
        """The message kinds a receiver accepts on `topic` (empty for unknown topics).

        Devices own `update/<id>` (updates and lock-step ticks) and `status/<id>`; only the
        operator may write `control` (the broker's ACL enforces who can publish where).
        """
        if topic == self.control:
            return CONTROL_KINDS
        try:
            self.client_from(topic)
        except ValueError:
            return frozenset()
        return TOPIC_KINDS[topic[len(self.base) + 1:].split("/")[0]]

    def client_from(self, topic: str) -> str:
        """The client id of an `update/`, `status/` or `stream/` topic of this fleet.

        Raises ValueError for any other topic (another fleet, another kind, extra levels).
        """
        prefix = self.base + "/"
        if not isinstance(topic, str) or not topic.startswith(prefix):
            raise ValueError(f"topic {topic!r} is not under {prefix!r}")
        parts = topic[len(prefix):].split("/")
        if len(parts) != 2 or parts[0] not in ("update", "status", "stream"):
            raise ValueError(
                f"topic {topic!r} is not an update/<client>, status/<client> or "
                f"stream/<client> topic of fleet {self.fleet!r}"
            )
        return validate_id(parts[1])
