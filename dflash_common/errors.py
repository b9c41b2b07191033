"""Errors a user can cause and fix. Every dflash command ends on one of them with one sentence naming
the thing and the fix, and exit code 2, never a traceback (dflash_common/cli.py `user_errors_exit`).
The store, the drafter and every stage raise them, so they live apart from the command-line module."""

from __future__ import annotations


class UserError(RuntimeError):
    """Something the user can fix (bad path, wrong store for this drafter): one sentence, no traceback."""


class SkippedRecord(ValueError):
    """An input record that cannot be used (a UserError ends a command; this ends one record):
    skipped and counted under `reason` (a short category such as `unknown_role` or
    `template_error`), with `detail` for the first few reported."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
