"""What every module may raise at a user: bad input as one line and exit 2, never a traceback.

The ground floor: it imports nothing of the package, so the command line, the data, the checkpoint directory and
the tools all take their errors from here without importing each other. `litespark-train` (pretrain.main) prints
`PROG: error: <message>` for a UserError and exits 2.
"""

PROG = "litespark-train"


class UserError(Exception):
    """Bad input the user can fix: printed as one line, exit code 2, no traceback."""


class ConfigError(UserError, ValueError):
    """A configuration that cannot run. The message says what is wrong and what to do."""
