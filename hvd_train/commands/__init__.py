"""The subcommands of ``hvd-train``: one module each, with ``add_parser`` and ``run``."""
