# The commands a new user runs. Everything installs into .venv from the package registry;
# torch is pinned first (2.13.0: a CPU build that this kind of machine has on disk; an unpinned
# torch would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint bench proto reliability soak clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[server,client,text,dev]"
	touch $@

install: $(VENV)/.installed

## demo: prepare a small image dataset, start a data server, train a CNN from it
demo: install
	$(PY) examples/demo.py

## test: lint, check the generated protobuf code, run the test suite
test: install lint
	$(PY) protos/generate.py --check
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check .

## bench: every benchmark scenario; writes results/*.json and docs/benchmarks.md
## (the SPDL peer also needs FFmpeg 5.1's libraries: apt-get install libavcodec59
## libavformat59 libavfilter8 libavutil57 libavdevice59; without them the pipeline scenarios
## leave it out and say so on the page)
bench: install
	$(PY) -m benchmarks

## reliability: the fault, load and bad-input tests; writes docs/reliability.md from their ledger
reliability: install
	$(PY) -m pytest -q --reliability-json=results/reliability.json
	$(PY) tests/reliability.py results/reliability.json docs/soak.json > docs/reliability.md

## soak: clients stream for MINUTES (default 30) from 2 servers killed and restarted in turn
soak: install
	$(PY) tests/soak.py --minutes $(or $(MINUTES),30) --out results/soak.json

## proto: regenerate protos/stoker/v1/*_pb2*.py after editing the .proto
proto: install
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) data results
