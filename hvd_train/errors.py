"""The one exception type that reaches users."""


class UserError(Exception):
    """A problem the user can fix: bad input, a bad option, a missing file.

    The message is one line that names the thing, the value and the fix. The
    CLI prints it without a traceback and exits with status 2.

    Attributes:
        agreed: every rank raised this same error (after a collective check),
            so only rank 0 needs to print it and no rank has to be aborted.
    """

    exit_code = 2

    def __init__(self, message: str, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


class Diverged(UserError):
    """Training diverged: the loss turned non-finite on some rank (``training.divergence``).

    Every rank raises it after the same step, with no checkpoint of the
    non-finite weights written; the command exits with status 3, which a
    sweep's trial, a job script or a scheduler can tell from other failures.
    """

    exit_code = 3
