"""The ``flowalign`` sub-commands that need concrete rewards (``serve-judge``, ``train-reward``); listed in
``rewards.PLUGINS["commands"]`` and the ``flowalign.commands`` entry points."""
