"""How ``--model`` names a backbone of the user's own (``FILE.py:FUNCTION`` or ``PACKAGE.MODULE:FUNCTION``).

String checks alone, which the configuration needs before anything is
built; ``hvd_train.model.own`` loads the function.
"""

from __future__ import annotations

import os


def is_own(name: str) -> bool:
    """Whether ``--model`` names a function of the user's rather than a Keras applications model."""
    return ":" in name


def absolute(name: str) -> str:
    """``name`` with a relative ``FILE.py`` made absolute (any other name as it is): a run names it from anywhere."""
    where, _, function = name.rpartition(":")
    if where.endswith(".py") and not os.path.isabs(where):
        return f"{os.path.abspath(where)}:{function}"
    return name
