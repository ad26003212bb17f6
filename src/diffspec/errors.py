"""Errors a user can cause and fix. The CLI prints them as one line and exits with code 2."""


class DiffspecError(ValueError):
    """Bad input or configuration: the message names the problem and, where possible, the fix."""


def positive_int(text: str, message: str) -> int:
    """The integer >= 1 that `text` spells; anything else raises DiffspecError(message)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise DiffspecError(message)
    return value
