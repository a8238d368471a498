"""The ``flowalign`` sub-commands that build concrete models (``tiny``, ``pretrain-tiny``); listed in
``pipelines.PLUGINS["commands"]`` and the ``flowalign.commands`` entry points."""
