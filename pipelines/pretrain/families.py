"""The families of ``flowalign pretrain-tiny FAMILY``, by name.

Each family's module holds its options (``HELP``, ``DEFAULTS``, ``add_arguments``, an optional ``check``; its
docstring is the sub-command's description) beside its training code, which imports torch and diffusers
inside its functions: the command's parser reads every family's module at each ``--help``.
"""

from __future__ import annotations

from pipelines.pretrain import anyflow_far, kontext, kontext_sr, qwen_image_edit, sd3, wan

FAMILIES = {"sd3": sd3, "wan": wan, "kontext": kontext, "kontext_sr": kontext_sr,
            "anyflow_far": anyflow_far, "qwen_image_edit": qwen_image_edit}
