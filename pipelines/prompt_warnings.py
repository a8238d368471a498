"""One short line, once, when a prompt is longer than a text encoder reads.

diffusers warns on every encode of a too-long prompt and echoes the whole cut-off text, once per text
encoder (SD3 has three), and transformers adds its own line per tokenizer: a 10,000-character prompt
printed ~30 KB of warnings. A filter on the two libraries' log handlers keeps the first such warning of
the process, shortened to its reason, and drops the rest.
"""

from __future__ import annotations

import logging

TRUNCATED = "The following part of your input was truncated because "
TOO_LONG = "Token indices sequence length is longer than the specified maximum sequence length"


class TruncationOnce(logging.Filter):
    """Passes the first truncation warning (shortened), drops later ones and the tokenizers' own."""

    shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(TOO_LONG):
            return False  # the truncation warning says the same, with the limit that applies
        if not message.startswith(TRUNCATED):
            return True
        if TruncationOnce.shown:
            return False
        TruncationOnce.shown = True
        reason = message.removeprefix(TRUNCATED).split(":", 1)[0].strip()
        record.msg, record.args = f"a prompt is cut to what its text encoder reads ({reason}); the rest is ignored " \
                                  "(said once)", ()
        return True


def install() -> None:
    """Add the filter to diffusers' and transformers' log handlers (idempotent)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for name, library in (("diffusers", diffusers_logging), ("transformers", transformers_logging)):
        library.get_logger(name)  # sets up the library's handler if nothing logged yet
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, TruncationOnce) for f in handler.filters):
                handler.addFilter(TruncationOnce())
