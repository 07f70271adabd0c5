"""The Python API on a stream: scikit-learn's digits as 5 tasks of 2 classes, mini-batches of 10
seen once, learned by `edgefcl.Learner` (a BI-ranked replay memory of 100 samples). Prints the
accuracy on every task seen so far after each task: what replay keeps of the earlier ones.

    python examples/learner.py [--seed N]
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.datasets import load_digits

import edgefcl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    X, y = load_digits(return_X_y=True)
    X = (X / 16).astype(np.float32)
    rng = np.random.default_rng(args.seed)
    learner = edgefcl.Learner(classes=10, learn=edgefcl.LearnConfig(memory_size=100),
                              seed=args.seed)
    tests: list[np.ndarray] = []
    for task, classes in enumerate([(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]):
        idx = rng.permutation(np.flatnonzero(np.isin(y, classes)))
        train, test = idx[:-60], idx[-60:]
        tests.append(test)
        for i in range(0, len(train), 10):
            learner.learn_many(X[train[i:i + 10]], y[train[i:i + 10]], task=task)
        accs = [(learner.predict_many(X[t]) == y[t]).mean() for t in tests]
        print(f"after task {task + 1}: " + "  ".join(f"T{i + 1} {100 * a:5.1f}"
                                                      for i, a in enumerate(accs)))


if __name__ == "__main__":
    main()
