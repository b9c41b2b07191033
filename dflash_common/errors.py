"""Errors a user can cause and fix. Every dflash command ends on one of them with one sentence naming
the thing and the fix, and exit code 2, never a traceback (dflash_common/cli.py `user_errors_exit`).
The store, the drafter and every stage raise them, so they live apart from the command-line module."""

from __future__ import annotations


class UserError(RuntimeError):
    """Something the user can fix (bad path, wrong store for this drafter): one sentence, no traceback."""
