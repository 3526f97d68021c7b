"""The one exception type that reaches users, and the one line of any other error that a message quotes."""

from __future__ import annotations

import re


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


def first_line(error: BaseException | str, named: bool = False, limit: int = 300) -> str:
    """The first line of an error (or of an error's message), for a one-line message.

    TensorFlow's decorations (``{{function_node ...}}`` before the reason,
    `` [Op:Name]`` or `` [[{{node Name}}]]`` after it) and the ``user:password@`` of any URL it quotes
    (botocore quotes the request's) are taken out. An error without a
    message gives its type's name; ``named`` puts the type's name first
    anyway; a text longer than ``limit`` is cut there.
    """
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line)
    line = re.sub(r"\s*\[Op:\w+\].*$", "", line).split(" [[", 1)[0]  # "... [[{{node X}}]]": the op's name
    line = re.sub(r"(\w+://)[^/@\s\"']+@", r"\1", line)[:limit]
    if isinstance(error, str):
        return line
    if not line:
        return type(error).__name__
    return f"{type(error).__name__}: {line}" if named else line
