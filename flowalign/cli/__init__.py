"""The ``flowalign`` command: one module per sub-command, each with ``add_parser`` and ``run``."""
