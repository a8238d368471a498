"""Several small training runs in one process: ``python -m tests.flowalign.trainers.fsdp_many RUNS.json``, a
JSON list of override lists (``flowalign train /dev/null OVERRIDES...`` each, or ``flowalign train CONFIG.yaml
OVERRIDES...`` where the list starts with a YAML file). Under torchrun every run shares one process group,
so the FSDP equality tests start the interpreter, torch and the ranks once instead of once per trainer."""

import json
import sys

from flowalign.config import load_config
from flowalign.parallel import process_group_released
from flowalign.train import train

if __name__ == "__main__":
    with process_group_released():
        for run in json.loads(open(sys.argv[1]).read()):
            config, overrides = (run[0], run[1:]) if run and run[0].endswith(".yaml") else ("/dev/null", run)
            train(load_config(config, overrides))
