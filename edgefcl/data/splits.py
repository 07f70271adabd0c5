"""Class-incremental task splits of a dataset over federated clients.

`split_tasks` returns `tasks[client][task]`. Each task is a set of `classes_per_task` classes;
a client never sees a class twice. In `overlap` mode all clients share one class order and get
disjoint training samples; in `non-overlap` mode every client draws its own class order and the
samples of a class are dealt disjointly among the clients that use it. Everything is drawn from
`numpy.random.default_rng(seed)` (independent child streams per stage, so e.g. changing
`val_fraction` does not change which samples a client is dealt).
"""

from __future__ import annotations

import numpy as np

from edgefcl.config import ConfigError, DataConfig
from edgefcl.data.types import DataError, Dataset, TaskData


def split_tasks(ds: Dataset, cfg: DataConfig, n_clients: int, seed: int) -> list[list[TaskData]]:
    """Split `ds` into `cfg.tasks` class-incremental tasks for each of `n_clients` clients.

    Test data of a task is the whole test set of its classes (arrays are shared between
    clients/tasks with the same classes: treat them as read-only). Raises DataError when the
    dataset cannot support the requested split.
    """
    _check_config(cfg, n_clients)
    r_carve, r_order, r_deal, r_pick = np.random.default_rng(seed).spawn(4)
    x_tr, y_tr, x_te, y_te = _train_test(ds, cfg.test_fraction, r_carve)
    n_tasks, n_classes = cfg.tasks, ds.n_classes
    cpt = classes_per_task(n_classes, cfg)

    # class order per client: (K, T*cpt), and the task of each (client, class) or -1
    if cfg.split == "overlap":
        orders = np.tile(r_order.permutation(n_classes)[: n_tasks * cpt], (n_clients, 1))
    else:
        perms = [r_order.permutation(n_classes) for _ in range(n_clients)]
        orders = np.stack(perms)[:, : n_tasks * cpt]
    task_of = np.full((n_clients, n_classes), -1, dtype=np.int64)
    task_of[np.arange(n_clients)[:, None], orders] = np.arange(n_tasks * cpt) // cpt

    owner = _deal(y_tr, task_of >= 0, r_deal)
    dealt = np.flatnonzero(owner >= 0)
    group = owner[dealt] * n_tasks + task_of[owner[dealt], y_tr[dealt]]  # client * T + task

    # imbalance and validation: stratified by class within each (client, task) group
    rank = _ranks(group * n_classes + y_tr[dealt], r_pick)
    cell = group * n_classes + y_tr[dealt]
    n_cell = np.bincount(cell, minlength=n_clients * n_tasks * n_classes)[cell]
    frac = _task_fractions(cfg.imbalance, n_tasks)[group % n_tasks]
    n_keep = np.maximum(1, _round(frac * n_cell))
    n_val = np.clip(_round(cfg.val_fraction * n_keep), 0, n_keep - 1)
    is_val = rank < n_val
    is_train = (rank >= n_val) & (rank < n_keep)

    # group samples in a random order (not sorted by class)
    shuffle = r_pick.permutation(len(dealt))
    train_groups = _groups(dealt[shuffle], group[shuffle], is_train[shuffle], n_clients * n_tasks)
    val_groups = _groups(dealt[shuffle], group[shuffle], is_val[shuffle], n_clients * n_tasks)

    test_cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
    out: list[list[TaskData]] = []
    for k in range(n_clients):
        tasks = []
        for t in range(n_tasks):
            classes = np.sort(orders[k, t * cpt : (t + 1) * cpt])
            tr, va = train_groups[k * n_tasks + t], val_groups[k * n_tasks + t]
            if len(tr) == 0:
                raise DataError(
                    f"client {k} task {t} (classes {classes.tolist()}) got no training samples: "
                    f"too few samples for {n_clients} clients; use fewer clients or tasks"
                )
            key = tuple(classes.tolist())
            if key not in test_cache:
                m = np.isin(y_te, classes)
                test_cache[key] = (x_te[m], y_te[m])
                if not m.any():
                    raise DataError(
                        f"task {t} (classes {classes.tolist()}) got no test samples: too few "
                        "samples to test it; use a larger dataset or fewer tasks")
            tasks.append(
                TaskData(t, classes, x_tr[tr], y_tr[tr], x_tr[va], y_tr[va], *test_cache[key])
            )
        out.append(tasks)
    return out


def classes_per_task(n_classes: int, cfg: DataConfig) -> int:
    """Classes per task (`cfg.classes_per_task`, or n_classes // tasks when it is 0)."""
    cpt = cfg.classes_per_task or n_classes // cfg.tasks
    if cpt < 1:
        raise DataError(f"{cfg.tasks} tasks need at least {cfg.tasks} classes (one a task) but "
                        f"the dataset has {n_classes}; lower --tasks")
    if cfg.tasks * cpt > n_classes:
        raise DataError(f"{cfg.tasks} tasks x {cpt} classes per task need {cfg.tasks * cpt} "
                        f"classes but the dataset has {n_classes}; lower --tasks or "
                        "--classes-per-task")
    return cpt


def _check_config(cfg: DataConfig, n_clients: int) -> None:
    checks = [
        (n_clients >= 1, f"clients must be >= 1, got {n_clients}"),
        (cfg.tasks >= 1, f"tasks must be >= 1, got {cfg.tasks}"),
        (cfg.classes_per_task >= 0, "classes_per_task must be >= 0"),
        (cfg.split in ("overlap", "non-overlap"), "split must be overlap or non-overlap"),
        (0 < cfg.imbalance <= 1, "imbalance must be in (0, 1]"),
        (0 <= cfg.val_fraction < 1, "val_fraction must be in [0, 1)"),
        (0 < cfg.test_fraction < 1, "test_fraction must be in (0, 1)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def _train_test(
    ds: Dataset, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dataset's train/test arrays, carving a stratified test split if it has none."""
    x, y = np.asarray(ds.x_train, dtype=np.float32), np.asarray(ds.y_train, dtype=np.int64)
    if len(x) != len(y):
        raise DataError(f"dataset '{ds.name}': {len(x)} train samples but {len(y)} labels")
    if len(y) and (y.min() < 0 or y.max() >= ds.n_classes):
        raise DataError(f"dataset '{ds.name}': labels must be in [0, {ds.n_classes})")
    if ds.x_test is not None and ds.y_test is not None:
        xt, yt = np.asarray(ds.x_test, dtype=np.float32), np.asarray(ds.y_test, dtype=np.int64)
        if len(xt) != len(yt):
            raise DataError(f"dataset '{ds.name}': {len(xt)} test samples but {len(yt)} labels")
        return x, y, xt, yt
    n_c = np.bincount(y, minlength=ds.n_classes)[y]
    n_test = np.where(n_c >= 2, np.clip(_round(test_fraction * n_c), 1, n_c - 1), 0)
    test = _ranks(y, rng) < n_test
    return x[~test], y[~test], x[test], y[test]


def _deal(y: np.ndarray, uses: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Owner client of each sample (-1: no client uses its class), dealt evenly per class.

    `uses[k, c]` says client k learns class c. The samples of class c, in a random order, are
    dealt round-robin to its users (starting at a class-dependent user so remainders spread).
    """
    n_clients, n_classes = uses.shape
    slot_of = np.cumsum(uses, axis=0) - 1  # position of client k among the users of class c
    table = np.full((n_classes, n_clients), -1, dtype=np.int64)
    ks, cs = np.nonzero(uses)
    table[cs, slot_of[ks, cs]] = ks
    n_users = uses.sum(axis=0)[y]
    slot = (_ranks(y, rng) + y) % np.maximum(n_users, 1)
    return np.where(n_users > 0, table[y, slot], -1)


def _ranks(keys: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random rank (0..count-1) of every element among the elements with the same key."""
    n = len(keys)
    perm = rng.permutation(n)
    order = perm[np.argsort(keys[perm], kind="stable")]
    sk = keys[order]
    new_group = np.r_[True, sk[1:] != sk[:-1]] if n else np.zeros(0, dtype=bool)
    starts = np.flatnonzero(new_group)
    start_of = np.repeat(starts, np.diff(np.r_[starts, n]))
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.arange(n) - start_of
    return ranks


def _groups(idx: np.ndarray, group: np.ndarray, mask: np.ndarray, n: int) -> list[np.ndarray]:
    """Split `idx[mask]` by `group` into n arrays, keeping the order within each group."""
    idx, group = idx[mask], group[mask]
    order = np.argsort(group, kind="stable")
    return np.split(idx[order], np.cumsum(np.bincount(group, minlength=n))[:-1])


def _task_fractions(imbalance: float, n_tasks: int) -> np.ndarray:
    """Fraction of training samples task t keeps: imbalance ** (t / (T - 1))."""
    if n_tasks == 1:
        return np.ones(1)
    return imbalance ** (np.arange(n_tasks) / (n_tasks - 1))


def _round(v: np.ndarray) -> np.ndarray:
    """Round half up to int64."""
    return np.floor(np.asarray(v) + 0.5).astype(np.int64)
