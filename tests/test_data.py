"""Data layer: loaders on real file formats, class-incremental splits, one-pass streams."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest

from edgefcl.config import ConfigError, DataConfig
from edgefcl.data.loaders import load_dataset, write_digits28
from edgefcl.data.splits import split_tasks
from edgefcl.data.streams import count_batches, stream_batches
from edgefcl.data.types import DataError, Dataset, TaskData

# --------------------------------------------------------------------------- helpers


def synthetic(n_classes: int = 10, per_class: int = 30, with_test: bool = False) -> Dataset:
    """Vectors whose first feature is the sample id, so splits can be checked by id."""
    n = n_classes * per_class
    y = np.tile(np.arange(n_classes), per_class)
    x = np.stack([np.arange(n), y, np.zeros(n)], axis=1).astype(np.float32)
    xt = yt = None
    if with_test:
        yt = np.repeat(np.arange(n_classes), 5)
        xt = np.stack([1000 + np.arange(len(yt)), yt, np.ones(len(yt))], 1).astype(np.float32)
    return Dataset("synthetic", x, y, xt, yt, n_classes)


def ids(x: np.ndarray) -> np.ndarray:
    return x[:, 0].astype(np.int64)


def write_cifar(folder: Path, n_classes: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Write a tiny CIFAR-10 / CIFAR-100 python-pickle folder; return the raw arrays."""
    folder.mkdir(parents=True)
    if n_classes == 10:
        names, key = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels"
    else:
        names, key = ["train", "test"], b"fine_labels"
    raw = {}
    for name in names:
        n = 3 if name.startswith("test") else 4
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, n_classes, size=n).tolist()
        d = {b"data": data, key: labels, b"batch_label": name.encode()}
        if n_classes == 100:
            d[b"coarse_labels"] = [0] * n
        with (folder / name).open("wb") as f:
            pickle.dump(d, f)
        raw[name] = data
    return raw


# --------------------------------------------------------------------------- built-in loaders


def test_digits_images_scaled_without_test_split():
    # read from scikit-learn's CSV file without importing it: the loader's arrays exactly
    from sklearn.datasets import load_digits

    ds = load_digits()
    d = load_dataset("digits")
    assert d.x_train.shape == (1797, 1, 8, 8) and d.x_train.dtype == np.float32
    assert d.x_test is None and d.y_test is None
    assert d.n_classes == 10 and d.kind == "image"
    np.testing.assert_array_equal(d.x_train[:, 0] * 16, ds.images)
    np.testing.assert_array_equal(d.y_train, ds.target)
    assert d.x_train.min() == 0.0 and d.x_train.max() == 1.0


def test_digits28_is_the_bilinear_upscale_read_by_npz(tmp_path):
    digits = load_dataset("digits")
    src = digits.x_train[:, 0]
    d = load_dataset(f"npz:{write_digits28(tmp_path / 'd28.npz')}")
    assert d.x_train.shape == (1797, 1, 28, 28) and d.n_classes == 10
    np.testing.assert_array_equal(d.y_train, digits.y_train)
    x = d.x_train[:, 0]
    assert x.min() >= 0.0 and x.max() <= 1.0
    # output pixel i samples the source at (i + 0.5) * 8 / 28 - 0.5, clamped at the border
    np.testing.assert_allclose(x[:, 0, 0], src[:, 0, 0], atol=1e-6)
    np.testing.assert_allclose(x[:, 27, 27], src[:, 7, 7], atol=1e-6)
    w = 14.5 * 8 / 28 - 0.5 - 3  # row 14 lies between source rows 3 and 4
    np.testing.assert_allclose(x[:, 14, 0], (1 - w) * src[:, 3, 0] + w * src[:, 4, 0], atol=1e-6)


def test_mnist1d_generated_for_seed_and_keeps_global_rng():
    cfg = DataConfig(mnist1d_samples=100)
    np.random.seed(123)
    expected_next = np.random.rand()
    np.random.seed(123)
    a = load_dataset("mnist1d", cfg, seed=3)
    assert np.random.rand() == expected_next  # the package's global reseed was undone
    assert a.x_train.shape == (80, 40) and a.x_test.shape == (20, 40)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64
    assert a.n_classes == 10 and a.kind == "vector"
    b = load_dataset("mnist1d", cfg, seed=3)
    c = load_dataset("mnist1d", cfg, seed=4)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, c.x_train)


# --------------------------------------------------------------------------- npz / embeddings


def test_npz_vectors_labels_remapped_over_train_and_test(tmp_path):
    p = tmp_path / "v.npz"
    x = np.arange(12, dtype=np.float64).reshape(4, 3)
    np.savez(p, x=x, y=np.array([7, 3, 7, 9]), x_test=x[:2] + 1, y_test=np.array([[11], [3]]))
    d = load_dataset(f"npz:{p}")
    assert d.n_classes == 4  # sorted unique of {3, 7, 9, 11}
    np.testing.assert_array_equal(d.y_train, [1, 0, 1, 2])
    np.testing.assert_array_equal(d.y_test, [3, 0])
    np.testing.assert_array_equal(d.x_train, x.astype(np.float32))
    assert d.x_train.dtype == np.float32 and d.sample_shape == (3,)


def test_npz_uint8_images_get_channel_axis_and_scale(tmp_path):
    p = tmp_path / "img.npz"
    x = np.array([[[0, 255], [51, 102]], [[255, 0], [0, 0]]], dtype=np.uint8)  # (N, H, W)
    np.savez(p, x=x, y=np.array([1, 0]))
    d = load_dataset(f"npz:{p}")
    assert d.x_train.shape == (2, 1, 2, 2)
    np.testing.assert_allclose(d.x_train[0, 0], [[0, 1], [0.2, 0.4]], rtol=1e-6)
    p4 = tmp_path / "img4.npz"
    x4 = np.zeros((3, 3, 4, 5), dtype=np.uint8)
    x4[1, 2, 3, 4] = 255
    np.savez(p4, x=x4, y=np.array([0, 1, 0]))
    d4 = load_dataset(f"npz:{p4}")
    assert d4.x_train.shape == (3, 3, 4, 5) and d4.x_train[1, 2, 3, 4] == 1.0
    assert d4.x_train.sum() == 1.0
    pl = tmp_path / "last.npz"  # channels-last (N, H, W, 3) is moved to (N, 3, H, W)
    xl = np.zeros((3, 6, 5, 3), dtype=np.uint8)
    xl[1, 4, 2, 0] = 255
    np.savez(pl, x=xl, y=np.array([0, 1, 0]))
    dl = load_dataset(f"npz:{pl}")
    assert dl.x_train.shape == (3, 3, 6, 5) and dl.x_train[1, 0, 4, 2] == 1.0


def test_embeddings_keys_and_test_split(tmp_path):
    p = tmp_path / "emb.npz"
    e = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    labels = np.array(["cat", "dog", "cat", "eel", "dog", "eel"])
    np.savez(p, embeddings=e, labels=labels, test_embeddings=e[:2], test_labels=labels[:2])
    d = load_dataset(f"embeddings:{p}")
    np.testing.assert_array_equal(d.x_train, e)
    np.testing.assert_array_equal(d.y_train, [0, 1, 0, 2, 1, 2])
    np.testing.assert_array_equal(d.y_test, [0, 1])
    q = tmp_path / "emb2.npz"
    np.savez(q, x=e, y=np.arange(6))
    d2 = load_dataset(f"embeddings:{q}")
    assert d2.x_test is None and d2.n_classes == 6


@pytest.mark.parametrize(
    ("spec", "arrays", "match"),
    [
        ("npz", {"x": np.zeros((3, 2))}, r"missing key 'y'"),
        ("npz", {"x": np.zeros((3, 2)), "y": np.zeros(4)}, r"3 train samples but 4"),
        ("npz", {"x": np.zeros(3), "y": np.zeros(3)}, r"shape \(3,\)"),
        ("npz", {"x": np.zeros((2, 1, 1, 1, 1)), "y": np.zeros(2)}, r"shape \(2, 1, 1, 1, 1\)"),
        ("npz", {"x": np.array([[0.0], [np.nan]]), "y": np.zeros(2)}, r"NaN or Inf in 1"),
        ("npz", {"x": np.zeros((2, 2)), "y": np.array([0.5, 1])}, r"whole numbers"),
        ("npz", {"x": np.zeros((2, 2)), "y": np.zeros(2), "x_test": np.zeros((1, 2))}, "y_test"),
        (
            "npz",
            {
                "x": np.zeros((2, 2)),
                "y": np.zeros(2),
                "x_test": np.zeros((1, 3)),
                "y_test": np.zeros(1),
            },
            r"test samples have shape \(3,\)",
        ),
        ("embeddings", {"x": np.zeros((2, 2, 2)), "y": np.zeros(2)}, r"must be 2-D"),
        ("embeddings", {"embeddings": np.zeros((2, 2))}, r"missing key 'labels'"),
        ("embeddings", {"feats": np.zeros((2, 2))}, r"missing key 'x'.*feats"),
        ("embeddings", {"x": np.array([[np.inf, 0]]), "y": np.zeros(1)}, r"NaN or Inf"),
    ],
)
def test_file_errors_name_the_problem(tmp_path, spec, arrays, match):
    p = tmp_path / "bad.npz"
    np.savez(p, **arrays)
    with pytest.raises(DataError, match=match) as e:
        load_dataset(f"{spec}:{p}")
    assert "bad.npz" in str(e.value)


def test_missing_file_and_unknown_spec(tmp_path):
    with pytest.raises(DataError, match=r"not found: .*nope\.npz"):
        load_dataset(f"npz:{tmp_path / 'nope.npz'}")
    with pytest.raises(DataError, match=r"valid forms: .*cifar10:DIR.*medmnist:PATH"):
        load_dataset("imagenet:/data")
    with pytest.raises(DataError, match="needs a path"):
        load_dataset("npz:")
    (tmp_path / "garbage.npz").write_bytes(b"not a zip")  # numpy's message spoke of pickles
    with pytest.raises(DataError, match=r"garbage\.npz is not an \.npz file \(numpy\.savez"):
        load_dataset(f"npz:{tmp_path / 'garbage.npz'}")


# --------------------------------------------------------------------------- CIFAR / MedMNIST


def test_cifar10_pickle_folder(tmp_path):
    raw = write_cifar(tmp_path / "c10", 10, np.random.default_rng(1))
    d = load_dataset(f"cifar10:{tmp_path / 'c10'}")
    assert d.x_train.shape == (20, 3, 32, 32) and d.x_test.shape == (3, 3, 32, 32)
    assert d.x_train.dtype == np.float32
    row = raw["data_batch_2"][1]  # train sample 4 + 1 = 5
    c, h, w = 2, 5, 31
    assert d.x_train[5, c, h, w] == np.float32(row[c * 1024 + h * 32 + w]) / np.float32(255)
    np.testing.assert_allclose(d.x_test[2].ravel(), raw["test_batch"][2] / 255.0, rtol=1e-6)
    assert d.x_train.min() >= 0 and d.x_train.max() <= 1
    assert d.y_train.max() == d.n_classes - 1
    # the parent of the extracted archive also works
    (tmp_path / "root").mkdir()
    (tmp_path / "c10").rename(tmp_path / "root" / "cifar-10-batches-py")
    d2 = load_dataset(f"cifar10:{tmp_path / 'root'}")
    np.testing.assert_array_equal(d2.x_train, d.x_train)
    (tmp_path / "root" / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match="missing file: .*data_batch_3"):
        load_dataset(f"cifar10:{tmp_path / 'root'}")


def test_cifar100_uses_fine_labels(tmp_path):
    write_cifar(tmp_path / "c100", 100, np.random.default_rng(2))
    fine = {}
    for name in ("train", "test"):
        with (tmp_path / "c100" / name).open("rb") as f:
            fine[name] = pickle.load(f, encoding="bytes")[b"fine_labels"]
    d = load_dataset(f"cifar100:{tmp_path / 'c100'}")
    assert d.x_train.shape == (4, 3, 32, 32) and d.x_test.shape == (3, 3, 32, 32)
    labels = np.unique(fine["train"] + fine["test"])  # remap: rank among the labels present
    assert d.n_classes == len(labels)
    np.testing.assert_array_equal(d.y_train, np.searchsorted(labels, fine["train"]))
    np.testing.assert_array_equal(d.y_test, np.searchsorted(labels, fine["test"]))
    with (tmp_path / "c100" / "test").open("wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DataError, match="missing key 'fine_labels'"):
        load_dataset(f"cifar100:{tmp_path / 'c100'}")


def test_medmnist_npz_gray_and_rgb(tmp_path):
    rng = np.random.default_rng(3)
    p = tmp_path / "pathmnist.npz"
    tr = rng.integers(0, 256, size=(5, 6, 6, 3), dtype=np.uint8)
    np.savez(
        p,
        train_images=tr,
        train_labels=np.array([[0], [2], [2], [5], [0]]),
        val_images=tr[:2],
        val_labels=np.array([[5], [0]]),
        test_images=tr[:3],
        test_labels=np.array([[2], [0], [5]]),
    )
    d = load_dataset(f"medmnist:{p}")
    assert d.x_train.shape == (7, 3, 6, 6) and d.x_test.shape == (3, 3, 6, 6)
    assert d.x_train[3, 1, 4, 2] == np.float32(tr[3, 4, 2, 1]) / np.float32(255)
    np.testing.assert_array_equal(d.y_train, [0, 1, 1, 2, 0, 2, 0])
    assert d.n_classes == 3
    g = tmp_path / "gray.npz"
    np.savez(
        g,
        train_images=np.full((2, 4, 4), 255, np.uint8),
        train_labels=np.array([[0], [1]]),
        test_images=np.zeros((1, 4, 4), np.uint8),
        test_labels=np.array([[1]]),
    )
    dg = load_dataset(f"medmnist:{g}")
    assert dg.x_train.shape == (2, 1, 4, 4) and dg.x_train.min() == 1.0
    bad = tmp_path / "chest.npz"
    np.savez(
        bad,
        train_images=np.zeros((2, 4, 4), np.uint8),
        train_labels=np.zeros((2, 14)),
        test_images=np.zeros((1, 4, 4), np.uint8),
        test_labels=np.zeros((1, 14)),
    )
    with pytest.raises(DataError, match="multi-label"):
        load_dataset(f"medmnist:{bad}")
    np.savez(bad, train_images=np.zeros((2, 4, 4), np.uint8), train_labels=np.zeros((2, 1)))
    with pytest.raises(DataError, match="missing key 'test_images'"):
        load_dataset(f"medmnist:{bad}")


# --------------------------------------------------------------------------- splits


def all_ids(tasks: list[TaskData]) -> np.ndarray:
    return np.concatenate([np.r_[ids(t.x_train), ids(t.x_val)] for t in tasks])


def test_overlap_split_disjoint_samples_same_classes():
    ds = synthetic(with_test=True)
    cfg = DataConfig(tasks=5, val_fraction=0.0)
    split = split_tasks(ds, cfg, n_clients=3, seed=0)
    assert len(split) == 3 and all(len(c) == 5 for c in split)
    for t in range(5):
        classes = split[0][t].classes
        assert len(classes) == 2
        for c in split:
            np.testing.assert_array_equal(c[t].classes, classes)
            assert c[t].task == t
            assert set(c[t].y_train) == set(classes)
            np.testing.assert_array_equal(ds.y_train[ids(c[t].x_train)], c[t].y_train)
    used = np.concatenate([all_ids(c) for c in split])
    assert len(np.unique(used)) == len(used) == 300  # disjoint and every sample dealt
    # 30 samples per class dealt evenly over 3 clients: 10 each
    for c in split:
        for t in c:
            np.testing.assert_array_equal(np.bincount(t.y_train)[t.classes], [10, 10])
    assert sorted(np.concatenate([t.classes for t in split[0]])) == list(range(10))


def test_classes_per_task_and_too_many_tasks():
    ds = synthetic()
    split = split_tasks(ds, DataConfig(tasks=3, classes_per_task=2), 2, seed=1)
    seen = np.concatenate([t.classes for t in split[0]])
    assert len(seen) == 6 and len(np.unique(seen)) == 6
    assert [len(t.classes) for t in split[1]] == [2, 2, 2]
    auto = split_tasks(ds, DataConfig(tasks=3), 1, seed=1)
    assert [len(t.classes) for t in auto[0]] == [3, 3, 3]  # 10 // 3
    with pytest.raises(DataError, match="need 12 classes but the dataset has 10; lower --tasks "
                       "or --classes-per-task"):
        split_tasks(ds, DataConfig(tasks=4, classes_per_task=3), 2, seed=0)
    with pytest.raises(DataError, match=r"^11 tasks need at least 11 classes \(one a task\) "
                       r"but the dataset has 10; lower --tasks$"):
        split_tasks(ds, DataConfig(tasks=11), 2, seed=0)
    with pytest.raises(ConfigError, match="split must be"):
        split_tasks(ds, DataConfig(split="mixed"), 2, seed=0)
    with pytest.raises(DataError, match="no training samples"):
        split_tasks(synthetic(per_class=2), DataConfig(tasks=5), 3, seed=0)
    only_0 = synthetic(with_test=True)  # a test set of class 0 alone: 4 tasks untestable
    keep = only_0.y_test == 0
    only_0 = dataclasses.replace(only_0, x_test=only_0.x_test[keep], y_test=only_0.y_test[keep])
    with pytest.raises(DataError, match=r"^task \d \(classes \[\d, \d\]\) got no test "
                       "samples: too few samples to test it"):
        split_tasks(only_0, DataConfig(tasks=5), 1, seed=0)


def test_non_overlap_orders_differ_and_samples_disjoint():
    ds = synthetic(with_test=True)
    cfg = DataConfig(tasks=2, classes_per_task=3, split="non-overlap", val_fraction=0.0)
    split = split_tasks(ds, cfg, n_clients=4, seed=0)
    orders = [tuple(np.concatenate([t.classes for t in c])) for c in split]
    assert len(set(orders)) > 1
    for c in split:
        seen = np.concatenate([t.classes for t in c])
        assert len(np.unique(seen)) == 6  # a client never sees a class twice
    used = np.concatenate([all_ids(c) for c in split])
    assert len(np.unique(used)) == len(used)
    # each class's 30 samples are dealt evenly among the clients that use it
    users = np.zeros(10, dtype=int)
    for c in split:
        users[np.concatenate([t.classes for t in c])] += 1
    for cls in range(10):
        got = [int((np.concatenate([t.y_train for t in c]) == cls).sum()) for c in split]
        nonzero = [g for g in got if g]
        assert len(nonzero) == users[cls]
        if users[cls]:
            assert sum(nonzero) == 30 and max(nonzero) - min(nonzero) <= 1


def test_imbalance_and_validation_counts():
    ds = synthetic(per_class=40, with_test=True)
    cfg = DataConfig(tasks=3, classes_per_task=2, imbalance=0.25, val_fraction=0.0)
    tasks = split_tasks(ds, cfg, 1, seed=5)[0]
    # fractions 0.25 ** (t / 2) = 1, 0.5, 0.25 of 40 samples per class
    assert [len(t.y_train) for t in tasks] == [80, 40, 20]
    for t, per_class in zip(tasks, [40, 20, 10], strict=True):
        np.testing.assert_array_equal(np.bincount(t.y_train)[t.classes], [per_class] * 2)
    cfg = DataConfig(tasks=2, classes_per_task=2, val_fraction=0.25)
    tasks = split_tasks(ds, cfg, 2, seed=5)[0]
    for t in tasks:  # 20 samples per class per client, 5 of them validation
        np.testing.assert_array_equal(np.bincount(t.y_val)[t.classes], [5, 5])
        np.testing.assert_array_equal(np.bincount(t.y_train)[t.classes], [15, 15])
        assert not set(ids(t.x_val)) & set(ids(t.x_train))


def test_carved_test_split_is_stratified_and_shared():
    ds = synthetic(per_class=30)  # no test split: 20% carved per class
    split = split_tasks(ds, DataConfig(tasks=5, test_fraction=0.2), 3, seed=2)
    train_ids = np.concatenate([all_ids(c) for c in split])
    for t in range(5):
        test = split[0][t]
        np.testing.assert_array_equal(np.bincount(test.y_test)[test.classes], [6, 6])
        assert set(test.y_test) == set(test.classes)
        np.testing.assert_array_equal(ds.y_train[ids(test.x_test)], test.y_test)
        assert not set(ids(test.x_test)) & set(train_ids)
        for c in split[1:]:
            np.testing.assert_array_equal(c[t].x_test, test.x_test)
    assert len(train_ids) == 300 - 60


def test_given_test_split_per_task_has_all_and_only_its_classes():
    ds = synthetic(with_test=True)
    split = split_tasks(ds, DataConfig(tasks=2, split="non-overlap"), 3, seed=4)
    for c in split:
        for t in c:
            expected = np.flatnonzero(np.isin(ds.y_test, t.classes))
            np.testing.assert_array_equal(ids(t.x_test), 1000 + expected)
            np.testing.assert_array_equal(t.y_test, ds.y_test[expected])


def test_split_deterministic_for_seed():
    ds = synthetic()
    cfg = DataConfig(tasks=5, split="non-overlap", imbalance=0.5)
    a, b = split_tasks(ds, cfg, 3, seed=7), split_tasks(ds, cfg, 3, seed=7)
    c = split_tasks(ds, cfg, 3, seed=8)
    for ca, cb in zip(a, b, strict=True):
        for ta, tb in zip(ca, cb, strict=True):
            for f in ("classes", "x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
                np.testing.assert_array_equal(getattr(ta, f), getattr(tb, f))
    assert any(
        not np.array_equal(ta.x_train, tc.x_train)
        for ca, cc in zip(a, c, strict=True)
        for ta, tc in zip(ca, cc, strict=True)
    )


# --------------------------------------------------------------------------- streams


def small_tasks() -> list[TaskData]:
    return split_tasks(synthetic(per_class=23), DataConfig(tasks=3, classes_per_task=2), 1, 0)[0]


def test_stream_one_pass_batches_flags_and_index():
    tasks = small_tasks()
    counts = count_batches(tasks, 4)
    assert counts == [-(-len(t.y_train) // 4) for t in tasks]
    batches = list(stream_batches(tasks, 4, seed=3))
    assert len(batches) == sum(counts)
    start = 0
    for t, n_b in zip(tasks, counts, strict=True):
        own = batches[start : start + n_b]
        start += n_b
        assert [b.task for b in own] == [t.task] * n_b
        assert [b.index for b in own] == list(range(1, n_b + 1))
        assert [b.end_of_task for b in own] == [False] * (n_b - 1) + [True]
        sizes = [len(b.y) for b in own]
        assert sizes[:-1] == [4] * (n_b - 1) and sizes[-1] == len(t.y_train) - 4 * (n_b - 1)
        seen = np.concatenate([ids(b.x) for b in own])
        np.testing.assert_array_equal(np.sort(seen), np.sort(ids(t.x_train)))
        assert not np.array_equal(seen, ids(t.x_train))  # shuffled within the task
        for b in own:  # labels travel with their inputs (synthetic x[:, 1] is the label)
            np.testing.assert_array_equal(b.y, b.x[:, 1].astype(np.int64))
            assert set(b.y) <= set(t.classes)


def test_stream_deterministic_and_resumable():
    tasks = small_tasks()
    a = [ids(b.x) for b in stream_batches(tasks, 5, seed=1)]
    b = [ids(b.x) for b in stream_batches(tasks, 5, seed=1)]
    c = [ids(b.x) for b in stream_batches(tasks, 5, seed=2)]
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    assert not all(np.array_equal(u, v) for u, v in zip(a, c, strict=True))
    tail = [ids(b.x) for b in stream_batches(tasks[1:], 5, seed=1)]
    assert all(np.array_equal(u, v) for u, v in zip(a[-len(tail) :], tail, strict=True))


def test_stream_order_differs_between_tasks_of_same_size():
    t0 = small_tasks()[0]
    t1 = dataclasses.replace(t0, task=1)
    a, b = (np.concatenate([ids(b.x) for b in stream_batches([t], 4, 0)]) for t in (t0, t1))
    assert not np.array_equal(a, b)


def test_stream_rejects_empty_task_and_bad_batch_size():
    tasks = small_tasks()
    no_samples = np.zeros(0, dtype=np.int64)
    empty = dataclasses.replace(
        tasks[0], task=7, x_train=tasks[0].x_train[no_samples], y_train=no_samples
    )
    with pytest.raises(DataError, match="task 7 .* no training samples"):
        stream_batches([*tasks, empty], 4, seed=0)  # raised at call time, not on iteration
    with pytest.raises(DataError, match="task 7"):
        count_batches([empty], 4)
    with pytest.raises(DataError, match="batch_size must be >= 1"):
        stream_batches(tasks, 0, seed=0)


def test_digits_end_to_end_split_and_stream():
    ds = load_dataset("digits")
    split = split_tasks(ds, DataConfig(tasks=5), 3, seed=0)
    total = sum(len(t.y_train) + len(t.y_val) for c in split for t in c)
    assert total == len(ds.y_train) - sum(len(t.y_test) for t in split[0])
    batches = list(stream_batches(split[1], 10, seed=0))
    assert sum(len(b.y) for b in batches) == sum(len(t.y_train) for t in split[1])
    assert batches[0].x.shape[1:] == (1, 8, 8) and batches[0].x.dtype == np.float32


def test_generated_data_is_kept_on_disk_and_made_again_when_unreadable(tmp_path, monkeypatch,
                                                                      caplog):
    from edgefcl.data.cache import cached_arrays

    monkeypatch.setenv("EDGEFCL_CACHE_DIR", str(tmp_path / "c"))
    made = []

    def make():
        made.append(1)
        return {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.array([0, 1])}

    a = cached_arrays("toy", make)
    b = cached_arrays("toy", make)
    assert len(made) == 1 and sorted(p.name for p in (tmp_path / "c").iterdir()) == ["toy.npz"]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    (tmp_path / "c" / "toy.npz").write_bytes(b"PK\x03\x04 cut")  # a damaged file
    np.testing.assert_array_equal(cached_arrays("toy", make)["x"], a["x"])
    assert len(made) == 2 and "unreadable" in caplog.text
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("EDGEFCL_CACHE_DIR", str(blocker / "sub"))  # cannot be created
    np.testing.assert_array_equal(cached_arrays("toy", make)["y"], a["y"])
    assert len(made) == 3 and "EDGEFCL_CACHE_DIR" in caplog.text

