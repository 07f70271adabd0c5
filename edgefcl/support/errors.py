"""Errors a user can fix: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """An error caused by input or environment the user controls (a fleet process that failed
    on a bad option, a device that does not match its fleet); the message says what to fix."""
