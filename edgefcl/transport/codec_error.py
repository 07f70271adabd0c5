"""The one error type of the wire layer: a payload rejected with a machine-readable reason."""

from __future__ import annotations


class CodecError(ValueError):
    """A payload that cannot be encoded or was rejected on decode.

    `reason` is a short machine-readable tag used for logging and counting rejections.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)
