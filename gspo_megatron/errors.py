"""The project's user-error types, in one place: every module imports them from here, and this
module imports nothing of the project.

A user error is one line naming the file, key or tensor at fault; entry points turn these (and
only these) into `prog: error: <line>` and exit status 2 (cli_util.user_errors). A bare
`ValueError` raised by our own code is a bug and keeps its traceback.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line naming the offending key."""


class ModelConfigError(ConfigError):
    """A model architecture (an HF config) this backend does not support; names the source."""


class InputError(ValueError):
    """Bad user input (file, key, value) detected by an entry point."""


class CheckpointError(InputError):
    """A checkpoint that cannot be used; the message names the file or tensor."""

