"""One-pass mini-batch streams over a client's task sequence."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from edgefcl.data.types import Batch, DataError, TaskData


def count_batches(tasks: Sequence[TaskData], batch_size: int) -> list[int]:
    """Number of mini-batches of each task's stream (ceil(n_train / batch_size))."""
    _check(tasks, batch_size)
    return [-(-len(t.y_train) // batch_size) for t in tasks]


def stream_batches(tasks: Sequence[TaskData], batch_size: int, seed: int) -> Iterator[Batch]:
    """Yield every training sample once: tasks in order, shuffled within each task.

    Batches have `batch_size` samples (a task's last batch may be smaller), `index` counts
    batches within the task from 1, and `end_of_task` marks the task's last batch. The order
    within task t depends only on (seed, t.task), so a stream can be resumed at any task.
    Raises DataError (at call time) for a bad batch size or a task without training samples.
    """
    _check(tasks, batch_size)
    return _stream(list(tasks), batch_size, seed)


def _stream(tasks: list[TaskData], batch_size: int, seed: int) -> Iterator[Batch]:
    for t in tasks:
        n = len(t.y_train)
        order = np.random.default_rng([seed, t.task]).permutation(n)
        n_batches = -(-n // batch_size)
        for b in range(n_batches):
            idx = order[b * batch_size : (b + 1) * batch_size]
            yield Batch(
                x=t.x_train[idx],
                y=t.y_train[idx],
                task=t.task,
                index=b + 1,
                end_of_task=b == n_batches - 1,
            )


def _check(tasks: Sequence[TaskData], batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise DataError(f"batch_size must be an integer, got {batch_size!r}")
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    for i, t in enumerate(tasks):
        if len(t.x_train) != len(t.y_train):
            raise DataError(
                f"task {t.task} (position {i}): {len(t.x_train)} inputs but {len(t.y_train)} labels"
            )
        if len(t.y_train) < 1:
            raise DataError(
                f"task {t.task} (position {i}) has no training samples; a stream needs >= 1"
            )
