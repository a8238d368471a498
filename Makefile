# Two commands on a fresh machine: `make demo` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch comes from the wheels on this machine's disk; pin it here rather than hope a resolver picks it
TORCH   := torch==2.14.1 torchvision==0.29.1
PYTEST_ARGS ?=

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]" $(TORCH)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) scripts/bench.py rollout

clean:
	rm -rf $(VENV) runs .pytest_cache
