"""Several small training runs in one process: ``python -m tests.flowalign.trainers.fsdp_many RUNS.json``, a
JSON list of override lists (``flowalign train /dev/null OVERRIDES...`` each). Under torchrun every run
shares one process group, so the FSDP equality tests start the interpreter, torch and the ranks once
instead of once per trainer."""

import json
import sys

from flowalign.config import load_config
from flowalign.parallel import process_group_released
from flowalign.train import train

if __name__ == "__main__":
    with process_group_released():
        for overrides in json.loads(open(sys.argv[1]).read()):
            train(load_config("/dev/null", overrides))
