"""Errors a user can cause and fix. The CLI prints them as one line and exits with code 2."""


class DiffspecError(ValueError):
    """Bad input or configuration: the message names the problem and, where possible, the fix."""
