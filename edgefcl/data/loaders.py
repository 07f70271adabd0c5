"""Dataset loaders: turn a dataset spec string into a validated `Dataset`.

Specs: `digits`, `mnist1d`, `npz:PATH`, `embeddings:PATH`, `cifar10:DIR`, `cifar100:DIR`,
`medmnist:PATH`. Every loader returns float32 inputs (images (N, C, H, W) in [0, 1], vectors
(N, D)) and int64 labels remapped to 0..n_classes-1 (sorted unique labels of train and test).
"""

from __future__ import annotations

import importlib.util
import pickle
import random
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgefcl.config import NAMES, DataConfig
from edgefcl.data.cache import cached_arrays
from edgefcl.data.types import DataError, Dataset

SPEC_FORMS = (
    "digits",
    "mnist1d",
    "npz:PATH",
    "embeddings:PATH",
    "cifar10:DIR",
    "cifar100:DIR",
    "medmnist:PATH",
)

NAMES["datasets"] = {form.partition(":")[0]: form for form in SPEC_FORMS}
"""What configs check a dataset spec's kind against (and whether it takes a path)."""

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def load_dataset(spec: str, cfg: DataConfig | None = None, seed: int = 0) -> Dataset:
    """Load the dataset named by `spec` (see module doc); raises DataError on bad input.

    `seed` only matters for generated data (mnist1d); `cfg.mnist1d_samples` sets its size.
    """
    cfg = cfg or DataConfig()
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind in ("digits", "mnist1d"):
        if arg:
            raise DataError(f"dataset spec '{spec}': '{kind}' takes no path; use '{kind}'")
        arrays = _digits() if kind == "digits" else _mnist1d(cfg.mnist1d_samples, seed)
        return _finish(kind, *arrays, source=kind)
    loaders: dict[str, Callable[[Path], Arrays]] = {
        "npz": _npz,
        "embeddings": _embeddings,
        "cifar10": lambda p: _cifar(p, 10),
        "cifar100": lambda p: _cifar(p, 100),
        "medmnist": _medmnist,
    }
    if kind not in loaders:
        raise DataError(f"unknown dataset spec '{spec}'; valid forms: {', '.join(SPEC_FORMS)}")
    if not arg:
        raise DataError(f"dataset spec '{spec}' needs a path: '{kind}:PATH'")
    path = Path(arg).expanduser()
    if not path.exists():
        raise DataError(f"{kind}: file or folder not found: {path}")
    return _finish(f"{kind}:{path.name}", *loaders[kind](path), source=str(path))


# --------------------------------------------------------------------------- built-in data


def _digits() -> Arrays:
    """scikit-learn's 8x8 digits (1,797 images), read from the CSV file the package ships,
    as `sklearn.datasets.load_digits` reads it: importing scikit-learn takes about 2 s (a
    fleet's every role paid it), reading the file 20 ms."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    folder = spec.submodule_search_locations if spec is not None else None
    if not folder:
        raise DataError("the digits dataset needs scikit-learn: pip install 'edgefcl[train]'")
    path = Path(next(iter(folder))) / "datasets" / "data" / "digits.csv.gz"
    if not path.exists():  # another layout: the library's own loader
        from sklearn.datasets import load_digits

        d = load_digits()
        return (d.images.astype(np.float32) / 16.0)[:, None, :, :], d.target, None, None
    data = np.loadtxt(path, delimiter=",")
    x = (data[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0)[:, None, :, :]
    return x, data[:, -1].astype(int), None, None


def write_digits28(path: Path) -> Path:
    """Write scikit-learn's digits upscaled to 28x28 images (bilinear, `align_corners=False`,
    clipped to [0, 1]) as an npz that `npz:PATH` reads; returns `path`. The memory study's and
    `edgefcl bench client`'s 28x28 configuration."""
    import torch
    import torch.nn.functional as F

    x, y, _, _ = _digits()
    big = F.interpolate(torch.from_numpy(x), size=(28, 28), mode="bilinear",
                        align_corners=False).clamp(0, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, x=big.numpy(), y=y.astype(np.int64))
    return path


def _mnist1d(n_samples: int, seed: int) -> Arrays:
    if n_samples < 10:
        raise DataError(f"mnist1d_samples must be >= 10 (one per class), got {n_samples}")
    from importlib.metadata import version

    def make() -> dict[str, np.ndarray]:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples = n_samples
        args.seed = seed
        # make_dataset reseeds the global numpy / random generators: restore them afterwards.
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            d = make_dataset(args)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        return {k: np.asarray(d[k]) for k in ("x", "y", "x_test", "y_test")}

    d = cached_arrays(f"mnist1d-{version('mnist1d')}-n{n_samples}-s{seed}", make)
    return d["x"], d["y"], d["x_test"], d["y_test"]


# --------------------------------------------------------------------------- file formats


def _open_npz(path: Path) -> dict[str, np.ndarray]:
    if path.is_dir():
        raise DataError(f"{path} is a folder; expected an .npz file")
    if not zipfile.is_zipfile(path):  # numpy would try it as a pickle, and say so
        raise DataError(f"{path} is not an .npz file (numpy.savez writes one: a zip of .npy "
                        "arrays)")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: cannot read as .npz: {e}") from e


def _key(d: dict[str, np.ndarray], key: str, path: Path) -> np.ndarray:
    if key not in d:
        raise DataError(f"{path}: missing key '{key}' (keys in file: {sorted(d)})")
    return d[key]


def _npz(path: Path) -> Arrays:
    d = _open_npz(path)
    x, y = _key(d, "x", path), _key(d, "y", path)
    xt, yt = _optional_pair(d, ("x_test", "y_test"), path)
    return _npz_inputs(x, f"{path}['x']"), y, _maybe(xt, f"{path}['x_test']"), yt


def _maybe(x: np.ndarray | None, where: str) -> np.ndarray | None:
    return None if x is None else _npz_inputs(x, where)


def _npz_inputs(x: np.ndarray, where: str) -> np.ndarray:
    """Vectors (N, D) stay; images (N, H, W) or (N, C, H, W) are scaled to [0, 1]."""
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        # channels-last arrays (N, H, W, C) are accepted when unambiguous
        if x.shape[1] not in (1, 3, 4) and x.shape[3] in (1, 3, 4):
            x = x.transpose(0, 3, 1, 2)
    else:
        raise DataError(
            f"{where}: expected vectors (N, D) or images (N, H, W) / (N, C, H, W), "
            f"got shape {x.shape}"
        )
    return _scale_images(x, where)


def _scale_images(x: np.ndarray, where: str) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        if x.size and (x.min() < 0 or x.max() > 255):
            raise DataError(f"{where}: integer images must be in 0..255")
        return x.astype(np.float32) / np.float32(255.0)
    return x


def _optional_pair(
    d: dict[str, np.ndarray], keys: tuple[str, str], path: Path
) -> tuple[np.ndarray | None, np.ndarray | None]:
    a, b = keys
    if (a in d) != (b in d):
        have, missing = (a, b) if a in d else (b, a)
        raise DataError(f"{path}: has '{have}' but is missing key '{missing}'")
    return (d[a], d[b]) if a in d else (None, None)


_EMBED_KEYS = (
    (("x", "y"), (("x_test", "y_test"),)),
    (
        ("embeddings", "labels"),
        (("test_embeddings", "test_labels"), ("embeddings_test", "labels_test")),
    ),
)


def _embeddings(path: Path) -> Arrays:
    d = _open_npz(path)
    for (kx, ky), test_keys in _EMBED_KEYS:
        if kx in d or ky in d:
            x, y = _key(d, kx, path), _key(d, ky, path)
            xt = yt = None
            for pair in test_keys:
                xt, yt = _optional_pair(d, pair, path)
                if xt is not None:
                    break
            for name, arr in ((kx, x), ("test embeddings", xt)):
                if arr is not None and arr.ndim != 2:
                    raise DataError(
                        f"{path}['{name}']: embeddings must be 2-D (N, D), got shape {arr.shape}"
                    )
            return x, y, xt, yt
    raise DataError(
        f"{path}: missing key 'x' (or 'embeddings'); an embeddings file needs x/y or "
        f"embeddings/labels (keys in file: {sorted(d)})"
    )


def _unpickle(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"CIFAR folder is missing file: {path}")
    try:
        with path.open("rb") as f:
            raw = pickle.load(f, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise DataError(f"{path}: cannot read CIFAR pickle: {e}") from e
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(raw).__name__}")
    return {k.decode() if isinstance(k, bytes) else str(k): v for k, v in raw.items()}


def _cifar(folder: Path, n: int) -> Arrays:
    if not folder.is_dir():
        raise DataError(f"cifar{n}: expected a folder, got file {folder}")
    inner = folder / ("cifar-10-batches-py" if n == 10 else "cifar-100-python")
    if inner.is_dir():  # the parent of the extracted archive also works
        folder = inner
    if n == 10:
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        test_files, label_key = ["test_batch"], "labels"
    else:
        train_files, test_files, label_key = ["train"], ["test"], "fine_labels"

    def read(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for name in names:
            p = folder / name
            d = _unpickle(p)
            x = np.asarray(_key(d, "data", p))
            y = np.asarray(_key(d, label_key, p))
            if x.ndim != 2 or x.shape[1] != 3072:
                raise DataError(f"{p}: 'data' must have shape (N, 3072), got {x.shape}")
            if len(x) != len(y):
                raise DataError(f"{p}: {len(x)} images but {len(y)} '{label_key}'")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(y)
        return _scale_images(np.concatenate(xs), str(folder)), np.concatenate(ys)

    return *read(train_files), *read(test_files)


def _medmnist(path: Path) -> Arrays:
    d = _open_npz(path)
    parts = {}
    for split in ("train", "val", "test"):
        if split == "val" and "val_images" not in d and "val_labels" not in d:
            continue
        x = _key(d, f"{split}_images", path)
        y = _key(d, f"{split}_labels", path)
        where = f"{path}['{split}_images']"
        if x.ndim == 3:
            x = x[:, None]
        elif x.ndim == 4 and x.shape[3] in (1, 3):
            x = x.transpose(0, 3, 1, 2)
        else:
            raise DataError(
                f"{where}: expected (N, H, W) or (N, H, W, C) with C in 1 or 3, got shape "
                f"{x.shape} (3-D MedMNIST volumes are not supported)"
            )
        if y.ndim == 2 and y.shape[1] != 1:
            raise DataError(
                f"{path}['{split}_labels']: shape {y.shape} is multi-label; only single-label "
                "MedMNIST sets are supported"
            )
        if len(x) != len(y):
            raise DataError(f"{path}: {len(x)} {split}_images but {len(y)} {split}_labels")
        parts[split] = (_scale_images(x, where), y.reshape(len(y), -1)[:, 0])
    # the task split draws its own validation data: fold MedMNIST's val split into train
    train = [parts["train"]] + ([parts["val"]] if "val" in parts else [])
    x_train = np.concatenate([p[0] for p in train])
    y_train = np.concatenate([p[1] for p in train])
    return x_train, y_train, *parts["test"]


# --------------------------------------------------------------------------- validation


def _finish(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    x_test: np.ndarray | None,
    y_test: np.ndarray | None,
    source: str,
) -> Dataset:
    """Check shapes and values, cast to float32 / int64 and remap labels to 0..C-1."""
    x, y = _check_pair(x, y, source, "train")
    if x_test is not None and y_test is not None:
        x_test, y_test = _check_pair(x_test, y_test, source, "test")
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(
                f"{source}: test samples have shape {x_test.shape[1:]} but train samples "
                f"{x.shape[1:]}"
            )
        labels, inverse = np.unique(np.concatenate([y, y_test]), return_inverse=True)
        y, y_test = inverse[: len(y)], inverse[len(y) :]
    else:
        labels, y = np.unique(y, return_inverse=True)
    return Dataset(
        name=name,
        x_train=x,
        y_train=y.astype(np.int64),
        x_test=x_test,
        y_test=None if y_test is None else y_test.astype(np.int64),
        n_classes=int(len(labels)),
        labels=[v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                for v in labels.tolist()],
    )


def _check_pair(x: Any, y: Any, source: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim not in (2, 4):
        raise DataError(f"{source}: {split} inputs have shape {x.shape}; need (N, D) or (N,C,H,W)")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"{source}: {split} labels must be 1-D (N,), got shape {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{source}: {len(x)} {split} samples but {len(y)} {split} labels")
    if len(x) == 0:
        raise DataError(f"{source}: the {split} split is empty")
    if not (np.issubdtype(x.dtype, np.number) and not np.iscomplexobj(x)):
        raise DataError(f"{source}: {split} inputs must be real numbers, got dtype {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).reshape(len(x), -1).any(axis=1).sum())
        raise DataError(f"{source}: {split} inputs contain NaN or Inf in {bad} samples")
    if np.issubdtype(y.dtype, np.floating):
        if not np.isfinite(y).all() or (y != np.round(y)).any():
            raise DataError(f"{source}: {split} labels must be whole numbers, got {y.dtype}")
        y = y.astype(np.int64)
    elif not (np.issubdtype(y.dtype, np.integer) or y.dtype.kind in "USb"):
        raise DataError(f"{source}: {split} labels have unsupported dtype {y.dtype}")
    return x, y
