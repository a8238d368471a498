"""``python -m tests.warm_call MODULE:FUNCTION JSON_ARGS``: call ``FUNCTION(*args)`` (:func:`tests.warm_start.spawn`)."""

import importlib
import json
import sys

if __name__ == "__main__":
    module, name = sys.argv[1].split(":")
    getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))
