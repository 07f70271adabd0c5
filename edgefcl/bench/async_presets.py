"""The async study's named rules (`edgefcl bench async --async-rules`): [fed] fields over a
run's config. Apart from the study, so that the command line names them without importing
it (the study imports torch through the report's plots)."""

from __future__ import annotations

BASE: dict[str, object] = {"mode": "async", "fold": "model", "staleness": "constant",
                           "staleness_a": 0.5, "staleness_b": 4.0, "buffer": 0, "mix": 0.5,
                           "device_merge": "replace", "task_decay": 1.0, "task_gate": 60.0}
"""Every field the study varies, at its default: a preset sets all of them, so that it means
the same whatever the defaults."""


def _rule(**fields: object) -> dict[str, object]:
    return BASE | fields


PRESETS: dict[str, dict[str, object]] = {
    "lockstep": {"mode": "sync"},
    "replace": _rule(),
    "replace-ungated": _rule(task_gate=0.0),
    "fedavg": _rule(device_merge="delta"),
    "fedasync-poly": _rule(staleness="polynomial"),
    "fedasync-hinge": _rule(staleness="hinge", staleness_a=10.0, staleness_b=1.0),
    "fedbuff": _rule(fold="delta", buffer=3, device_merge="delta"),
    "fedbuff-poly": _rule(fold="delta", buffer=3, staleness="polynomial", device_merge="delta"),
    "fedbuff-merge-staleness": _rule(fold="delta", buffer=3, staleness="polynomial",
                                     device_merge="staleness"),
    "fedbuff-lr1": _rule(fold="delta", buffer=4, mix=1.0, device_merge="delta"),
    "task-aware": _rule(device_merge="delta", task_decay=0.5),
    "task-aware-ungated": _rule(device_merge="delta", task_decay=0.5, task_gate=0.0),
    "task-aware-poly": _rule(device_merge="delta", task_decay=0.5, staleness="polynomial"),
    "fedbuff-task": _rule(fold="delta", buffer=4, mix=1.0, device_merge="delta",
                          task_decay=0.1),
}
"""Named rules of the study: [fed] fields over the run's config. `replace` (the task gate,
the replace merge, no task lag) is the default since the study of docs/async.md;
`task-aware-ungated` is the default before it."""
