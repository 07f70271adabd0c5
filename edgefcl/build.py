"""The factory every driver builds a run from: the in-process simulation, the networked runtime
(`edgefcl client`, `edgefcl aggregator`, the MQTT fleet) and firmware_sim. It sits below the
drivers: nothing here knows how a run is driven."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from threadpoolctl import threadpool_limits

from edgefcl.config import FedConfig, LearnConfig, RunConfig, resolve_current_share, resolve_fed
from edgefcl.data.types import Dataset, TaskData
from edgefcl.data.workload import client_id, load_workload
from edgefcl.federation.label_rows import LabelRows
from edgefcl.federation.messages import Tensors
from edgefcl.federation.registry import get_encoding
from edgefcl.learn.client import Client
from edgefcl.learn.compiled_step import compile_step
from edgefcl.learn.drift import make_monitor
from edgefcl.learn.global_format import global_tensors
from edgefcl.learn.learner import Clock, StreamLearner, resolve_device
from edgefcl.learn.memory import ClassBalanced, MemorySpec
from edgefcl.learn.memory_policies import get_policy
from edgefcl.learn.methods import get_method, load
from edgefcl.learn.model_heads import head_for, head_of
from edgefcl.learn.models import build_model
from edgefcl.learn.optimizers import OPTIMIZERS, LocalOptimizer
from edgefcl.learn.scoring.perturb import make_perturber
from edgefcl.learn.scoring.snapshot import make_client_onnx
from edgefcl.learn.selection import get_selection
from edgefcl.learn.variational import client_hooks


def use_cpu_threads(threads: int) -> None:
    """Run the process's torch ops and the BLAS libraries loaded so far (numpy's) on `threads`
    threads (LearnConfig.threads). BLAS matters too: the TTA views solve small homographies
    with numpy, and OpenBLAS's default of one thread per core (each woken, then spinning, at
    every call) slowed the scoring thread and the trainer beside it (README, Speed)."""
    torch.set_num_threads(threads)
    threadpool_limits(threads, user_api="blas")


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
    model = build_model(cfg.learn.model, ds.sample_shape, ds.n_classes, cfg.learn.hidden,
                        cfg.learn.bn_momentum)
    model = head_for(cfg).wrap(model)  # prototypes: the output layer becomes the library
    model = client_hooks(cfg.learn.method, cfg.learn, cfg.fed).prepare_model(model)
    return Setup(ds, tasks, model)


def initial_global(cfg: RunConfig, setup: Setup) -> Tensors:
    """Tensors of the first global model, named like the run's updates (gaussian: W::mu,
    W::sigma)."""
    return global_tensors(setup.initial, cfg.fed.encoding)


def initial_prototypes(setup: Setup, encoding: str = "dense") -> LabelRows | None:
    """The first global prototype library (empty, of the run's row width; Gaussian rows with
    the gaussian encoding), or None for a fixed head."""
    model = setup.initial
    return head_of(model).empty_table(model, get_encoding(encoding).bayesian)


def for_method(cfg: RunConfig, method: str) -> RunConfig:
    """`cfg` for a run of `method` (vfcl / fedbnn imply the gaussian encoding)."""
    return dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, method=method),
                               fed=resolve_fed(method, cfg.fed))


def make_optimizer(model: torch.nn.Module, learn: LearnConfig) -> LocalOptimizer:
    """The local optimizer over all of `model`'s parameters: `learn.optimizer` at `learn.lr`
    (`learn/optimizers.py`: torch's kernels without torch.optim's start-up cost)."""
    return OPTIMIZERS[learn.optimizer](model.parameters(), lr=learn.lr)


def new_client(cid: str, model: torch.nn.Module, learn: LearnConfig, fed: FedConfig,
               data_kind: str, seed: int = 0) -> Client:
    """A client `cid` training `model` (taken over, not copied): builds its collaborators
    from the configuration and injects them into a StreamLearner and its federated wrapper."""
    device = resolve_device(learn.device)
    if learn.score_chunk == 0:
        learn = dataclasses.replace(learn, score_chunk=4096 if device.type == "cuda" else 256)
    hooks = client_hooks(learn.method, learn, fed)
    model = hooks.prepare_model(model).to(device)
    opt = make_optimizer(model, learn)
    spec = get_method(learn.method)
    selection = get_selection(learn.selection)  # unknown names fail here, early
    policy = load(get_policy(spec.memory).memory) if spec.memory is not None else None
    memory = (MemorySpec(learn.memory_size, policy, selection, device, learn.rank_past,
                         ClassBalanced(), resolve_current_share(learn.current_share,
                                                                policy.name), learn.rescore)
              if learn.memory_size > 0 and policy is not None else None)
    perturber = (make_perturber(data_kind, learn.perturbations, learn.noise_std, seed)
                 if policy is not None and policy.scored else None)
    encoder = get_encoding(fed.encoding).make_encoder(fed)
    sigma = learn.bayes_sigma if get_encoding(fed.encoding).bayesian else None
    protos = head_of(model).trainer(model, learn, device, sigma)
    learner = StreamLearner(cid, model, learn, data_kind, device, opt,
                      torch.Generator().manual_seed(seed), memory, spec.score, perturber,
                      make_monitor(learn), make_client_onnx(learn), protos, Clock(device),
                      compile_step(learn))
    return Client(learner, fed, encoder, hooks)


def make_client(cfg: RunConfig, setup: Setup, k: int, method: str, seed: int,
                cid: str | None = None) -> Client:
    """Client k of a run (named `cid`, by default its index's id), starting from the shared
    initial model."""
    learn = dataclasses.replace(cfg.learn, method=method)
    return new_client(cid or client_id(k), copy.deepcopy(setup.initial), learn, cfg.fed,
                      setup.dataset.kind, seed=seed * 1000 + k)
