"""Write scikit-learn's 8x8 digits upscaled to 28x28 (bilinear) as an npz dataset:
`python examples/digits28.py data/digits28.npz`, then `edgefcl simulate --dataset
npz:data/digits28.npz` (a larger image and model than the 8x8 demo, same labels)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy.ndimage import zoom
from sklearn.datasets import load_digits


def main(path: str) -> None:
    d = load_digits()
    x = d.images.astype(np.float32) / 16.0  # (N, 8, 8) in [0, 1]
    big = np.clip(zoom(x, (1, 28 / 8, 28 / 8), order=1), 0.0, 1.0).astype(np.float32)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, x=big, y=d.target.astype(np.int64))
    print(f"wrote {path}: x {big.shape}, y {d.target.shape}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/digits28.npz")
