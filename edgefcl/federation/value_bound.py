"""The bound on every value a device accepts in a global (numpy-free constant, so that every
federation module can import it): tensors (`global_check`), update values (`strategy`,
`sparse`, `q8`) and a library head's rows and sigmas (`label_rows`). A value beyond it can
only make a global that every device rejects."""

from __future__ import annotations

MAX_VALUE = 1e6
"""Largest magnitude of a value in an update, a global or a library row: a weighted mean of
accepted values stays within it, so no accepted input makes a global devices reject."""
