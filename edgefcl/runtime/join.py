"""The join check: a device compares what it is (model, data shape, method, encoding) with the
fleet's retained `config` before it trains, and refuses to train alone on a mismatch."""

from __future__ import annotations

import time
from typing import Any

from edgefcl.config import RunConfig
from edgefcl.data.types import Dataset
from edgefcl.federation.messages import Tensors
from edgefcl.support.errors import UserError
from edgefcl.transport.codec import spec_hash, tensor_spec

KEYS = ("mode", "model", "sample_shape", "n_classes", "method", "encoding", "aggregation",
        "wire_dtype", "seed", "tasks", "batch_size", "burn_in", "jump", "max_backpressure")
"""What must agree between a device and its aggregator, in the order differences are named:
the round mode, the model, the protocol, and the stream's shape and schedule (a device on
another seed, task count, batch size or burn-in would send updates the aggregator refuses; one
with a lower cap on the backpressure factor would send more than the daemon's pace lets
through: `UpdateQuota.paced`)."""
AT_LEAST = frozenset({"max_backpressure"})
"""Keys a device may set higher than its aggregator (it follows the factor advertised)."""


class JoinRefused(UserError):
    """The device does not match the fleet it was pointed at."""


def fleet_profile(cfg: RunConfig, initial: Tensors | None = None,
                  dataset: Dataset | None = None) -> dict[str, Any]:
    """What defines a fleet's model and protocol: published in the aggregator's `config` and
    computed by each device the same way. Without the initial tensors the spec hash, without
    the dataset the shape keys are left out (a device checks those before it loads anything)."""
    out: dict[str, Any] = {"mode": cfg.fed.mode, "method": cfg.learn.method,
                           "encoding": cfg.fed.encoding, "aggregation": cfg.fed.aggregation,
                           "wire_dtype": cfg.mqtt.wire_dtype, "seed": cfg.seed,
                           "tasks": cfg.data.tasks, "batch_size": cfg.data.batch_size,
                           "burn_in": cfg.fed.burn_in, "jump": cfg.fed.jump}
    if cfg.fed.mode == "async":
        out["max_backpressure"] = cfg.fed.max_backpressure
    if initial is not None:
        out["spec_hash"] = spec_hash(tensor_spec(initial))
    if dataset is not None:
        from edgefcl.learn.export import architecture_spec  # torch: only once the model is built

        spec = architecture_spec(cfg.learn.model, dataset.sample_shape, dataset.n_classes,
                          cfg.learn.hidden)
        out.update(model=spec["model"], sample_shape=spec["sample_shape"],
                   n_classes=spec["n_classes"])
    elif cfg.learn.model != "auto":
        out["model"] = cfg.learn.model
    return out


def differences(mine: dict[str, Any], fleet: dict[str, Any]) -> list[str]:
    """Human-readable differences between a device's profile and the fleet's (empty: match).
    Keys one side does not state are not compared; the tensor spec hash is compared last and
    named only when nothing else explains it."""
    out = []
    for key in KEYS:
        if key not in mine or key not in fleet:
            continue
        if key in AT_LEAST:  # a higher cap here is no harm: the device follows what is said
            if not _at_least(mine[key], fleet[key]):
                out.append(f"{key} {_show(mine[key])} here, below {_show(fleet[key])} at the "
                           "aggregator")
        elif _norm(mine[key]) != _norm(fleet[key]):
            out.append(f"{key} {_show(mine[key])} here, {_show(fleet[key])} at the aggregator")
    if (not out and "spec_hash" in fleet and "spec_hash" in mine
            and mine["spec_hash"] != fleet["spec_hash"]):
        out.append(f"model tensors differ (names or shapes, e.g. --hidden): spec "
                   f"{mine.get('spec_hash')} here, {fleet['spec_hash']} at the aggregator")
    return out


def _at_least(mine: Any, theirs: Any) -> bool:
    """Whether `mine` is a number at least `theirs` (a value of another type is not)."""
    try:
        return float(mine) >= float(theirs)
    except (TypeError, ValueError):
        return False


def check_join(cid: str, fleet_name: str, mine: dict[str, Any], fleet: dict[str, Any]) -> None:
    """Raise JoinRefused naming every difference between this device and the fleet."""
    diff = differences(mine, fleet)
    if diff:
        raise JoinRefused(f"{cid} does not match fleet '{fleet_name}': {'; '.join(diff)}; "
                          "use the aggregator's configuration (the same --config)")


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, (list, tuple)) else v


def _show(v: Any) -> str:
    return "x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def preflight(cfg: RunConfig, cid: str, mine: dict[str, Any], timeout: float = 5.0
              ) -> dict[str, Any] | None:
    """Before the (slow) data and model are loaded: read the fleet's retained config over a
    short-lived connection and refuse on a mismatch of what `mine` states. Returns the fleet's
    config, or None when none came within `timeout` s (no aggregator yet: the device runner
    waits for it), or at once for a device that logs in with a username or a client
    certificate: a broker may take that identity as the client id (the shipped one does), and
    then the short connection would end the device's own session and its queued stream; the
    device runner checks the config on its own session instead."""
    if cfg.mqtt.username or cfg.mqtt.tls_cert:
        return None
    import secrets
    import threading

    from edgefcl.runtime.bodies import body_fault
    from edgefcl.runtime.links import open_link, topics
    from edgefcl.transport.codec import CodecError, Message, decode, encode

    got: dict[str, Any] = {}
    ready = threading.Event()

    def on_config(topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, cfg.mqtt.fleet)
        except CodecError:
            return
        if isinstance(msg, Message) and msg.kind == "config" and \
                body_fault("config", msg.body) is None:
            got.update(msg.body)
            ready.set()

    t = topics(cfg.mqtt)
    link = open_link(cfg.mqtt, f"{cfg.mqtt.fleet}-{cid}-join-{secrets.token_hex(3)}",
                     clean_start=True)
    try:
        link.subscribe(t.config, on_config)
        if not ready.wait(timeout):
            return None
        try:
            check_join(cid, cfg.mqtt.fleet, mine, got)
        except JoinRefused as e:  # the operator's status view says why this device stopped
            body = {"state": "refused", "reason": str(e), "time": round(time.time(), 3)}
            link.publish(t.status(cid), encode(Message("status", body), fleet=cfg.mqtt.fleet,
                                               sender=cid), qos=1, retain=True, wait=True)
            raise
    finally:
        link.close()
    return got
