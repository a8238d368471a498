"""User-facing errors: one line naming the problem and the fix, shown without a traceback."""


class UserError(Exception):
    """A mistake in what the user asked for (a path, a flag, a config value).

    The CLI prints ``error: <message>`` and exits with status 2; library callers can catch it. The
    message should name the offending field or value and say how to fix it.
    """
