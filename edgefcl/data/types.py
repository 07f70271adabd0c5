"""Plain containers shared by loaders, splits, streams and the learners."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class DataError(ValueError):
    """A dataset that cannot be loaded or split; the message says what to fix."""


@dataclass
class Dataset:
    """Arrays of one dataset.

    x arrays are float32: images as (N, C, H, W) scaled to [0, 1], vectors/signals as (N, D).
    y arrays are int64 class labels in [0, n_classes). The test split may be absent (None);
    the task split then carves one out of the training data.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    n_classes: int
    labels: list[str] | None = None  # original label of class c (None: the class number)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def kind(self) -> str:
        """'image' for (N, C, H, W) data, 'vector' otherwise."""
        return "image" if self.x_train.ndim == 4 else "vector"


@dataclass
class TaskData:
    """One task of one client: its classes and its train / validation / test arrays."""

    task: int
    classes: np.ndarray
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass
class Batch:
    """One mini-batch of a stream. `index` counts batches within the task from 1."""

    x: np.ndarray
    y: np.ndarray
    task: int
    index: int
    end_of_task: bool
