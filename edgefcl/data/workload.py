"""A replayed dataset as a fleet workload: per-client task splits and their one-pass streams.

Torch-free, so the stream replayer never pays for importing torch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from edgefcl.config import RunConfig
from edgefcl.data.labels import name_tasks
from edgefcl.data.loaders import load_dataset
from edgefcl.data.splits import split_tasks
from edgefcl.data.streams import stream_batches
from edgefcl.data.types import Batch, Dataset, TaskData
from edgefcl.federation.heads import library_head


def client_id(k: int) -> str:
    """The id of the k-th client of a replayed dataset (c000, c001, ...)."""
    return f"c{k:03d}"


@dataclass
class Workload:
    dataset: Dataset
    tasks: list[list[TaskData]]  # [client][task]


def load_workload(cfg: RunConfig, seed: int) -> Workload:
    """Load the dataset and split it into per-client class-incremental tasks. With the
    prototype head the tasks' labels are names (the dataset's label list is applied here,
    once: streams, test sets and devices only ever see names); a fixed head keeps the class
    numbers its output layer is indexed by."""
    ds = load_dataset(cfg.data.dataset, cfg.data, seed)
    tasks = split_tasks(ds, cfg.data, cfg.fed.clients, seed)
    if library_head(cfg):
        tasks = name_tasks(tasks, ds.labels)
    return Workload(ds, tasks)


def client_stream(cfg: RunConfig, tasks: list[TaskData], k: int, seed: int) -> Iterator[Batch]:
    """Client k's one-pass stream (its own shuffling seed)."""
    return stream_batches(tasks, cfg.data.batch_size, seed * 1000 + k)
