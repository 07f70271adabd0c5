"""Write scikit-learn's 8x8 digits upscaled to 28x28 (bilinear) as an npz dataset:
`python examples/digits28.py data/digits28.npz`, then `edgefcl simulate --dataset
npz:data/digits28.npz` (a larger image and model than the 8x8 demo, same labels). These are the
images of the memory study's and `edgefcl bench client`'s `digits28`."""

from __future__ import annotations

import sys
from pathlib import Path

from edgefcl.data.loaders import write_digits28


def main(path: str) -> None:
    out = write_digits28(Path(path))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/digits28.npz")
