"""The factory every driver builds a run from: the in-process simulation, the networked runtime
(`edgefcl client`, `edgefcl aggregator`, the MQTT fleet) and firmware_sim. It sits below the
drivers: nothing here knows how a run is driven."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from edgefcl.config import RunConfig, resolve_fed
from edgefcl.data.types import Dataset, TaskData
from edgefcl.data.workload import client_id, load_workload
from edgefcl.federation.messages import Tensors
from edgefcl.federation.prototypes import PrototypeTable
from edgefcl.learn.client import Client
from edgefcl.learn.global_format import global_tensors
from edgefcl.learn.models import build_model
from edgefcl.learn.prototypes import ProtoNet, proto_model, resolve_head
from edgefcl.learn.variational import client_hooks


@dataclass
class Setup:
    """Everything a run is built from, shared by the in-process and MQTT drivers."""

    dataset: Dataset
    tasks: list[list[TaskData]]  # [client][task]
    initial: torch.nn.Module


def prepare(cfg: RunConfig, seed: int) -> Setup:
    """Load the data, split it into per-client tasks and build the initial model."""
    work = load_workload(cfg, seed)
    ds, tasks = work.dataset, work.tasks
    torch.manual_seed(seed)
    model = build_model(cfg.learn.model, ds.sample_shape, ds.n_classes, cfg.learn.hidden)
    if resolve_head(cfg.learn.head, cfg.learn.method) == "prototypes":
        model = proto_model(model)  # the output layer becomes the label-keyed library
    model = client_hooks(cfg.learn.method, cfg.learn, cfg.fed).prepare_model(model)
    return Setup(ds, tasks, model)


def initial_global(cfg: RunConfig, setup: Setup) -> Tensors:
    """Tensors of the first global model, named like the run's updates (gaussian: W::mu,
    W::sigma)."""
    return global_tensors(setup.initial, cfg.fed.encoding)


def initial_prototypes(setup: Setup) -> PrototypeTable | None:
    """The first global prototype library (empty, of the run's row width), or None for a
    fixed head."""
    model = setup.initial
    return PrototypeTable.empty(model.dim + 1) if isinstance(model, ProtoNet) else None


def for_method(cfg: RunConfig, method: str) -> RunConfig:
    """`cfg` for a run of `method` (vfcl / fedbnn imply the gaussian encoding)."""
    return dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, method=method),
                               fed=resolve_fed(method, cfg.fed))


def make_client(cfg: RunConfig, setup: Setup, k: int, method: str, seed: int) -> Client:
    """Client k of a run, starting from the shared initial model."""
    learn = dataclasses.replace(cfg.learn, method=method)
    return Client(client_id(k), copy.deepcopy(setup.initial), learn, cfg.fed,
                  setup.dataset.kind, seed=seed * 1000 + k, label_names=setup.dataset.labels)
