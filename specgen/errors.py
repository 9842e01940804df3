"""Errors a user can act on.

`SpecgenError` is raised for anything the user must fix (missing file, bad option, invalid
layer list). The stage entry points print its message on one line and exit non-zero without
a traceback. `RowError` describes one malformed input row; the data stage turns it into an
entry of `rejected.jsonl` (or a `SpecgenError` when `data.on_bad_row=fail`).
"""


class SpecgenError(Exception):
    """A problem the user must fix; the message says what was wrong, where, and what to do."""


class RowError(SpecgenError):
    """One input row cannot be used. `reason` is a short stable code used to count rejections."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message
