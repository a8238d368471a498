"""A process for ``tests/test_warm_start.py``: ``python -m tests.warm_probe ACTION [ARG]``."""

import os
import sys
import time

if __name__ == "__main__":
    action, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    print(f"argv {sys.argv[1:]} cwd {os.getcwd()}")
    if action == "env":
        print(f"{arg}={os.environ.get(arg)}")
    elif action == "exit":
        sys.exit(int(arg))
    elif action == "message":
        sys.exit(arg)
    elif action == "raise":
        raise RuntimeError(arg)
    elif action == "sleep":
        print("sleeping", flush=True)
        time.sleep(float(arg))
    elif action == "atexit":
        import atexit

        atexit.register(lambda: print("shut down as an interpreter does"))
        sys.exit(int(arg))
    elif action == "rank":  # rank 1 fails at once; rank 0 would sleep for a minute
        if os.environ["RANK"] == "1":
            sys.exit(5)
        time.sleep(60)
