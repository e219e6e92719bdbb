# The commands a new user runs. Everything installs into .venv from the package registry;
# torch is pinned first (2.13.0: a CPU build that this kind of machine has on disk; an unpinned
# torch would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Each venv installs through uv (from the registry, into the venv by pip first): it fetches,
# unpacks and byte-compiles in parallel, and resolves the same versions as pip. .venv on a
# fresh clone, on the loaded 2-core machine: pip 807 s wall (155 CPU s), uv 154 s (92 CPU s);
# all three venvs 248 s. It must compile: where PYTHONDONTWRITEBYTECODE is set (this machine) no
# import writes a .pyc, and every process compiles torch's modules again (Lightning's docs
# example: 15.6 -> 36.6 CPU s). uv reads no pip configuration: tools/uv_args.py passes pip's
# index, find-links and constraint settings on (where the machine keeps torch's CPU build);
# --index-strategy unsafe-best-match picks from every index as pip does.
# The extras of .venv and .venv-frameworks (variables: a comma in $(call)'s arguments splits them).
DEV_EXTRAS := server,client,text,video,dev
FW_EXTRAS := server,client,lightning,hf,ray
# $(call new_venv,VENV): the venv, with uv in it; $(call uv_install,PYTHON,PACKAGES...)
new_venv = $(PYTHON) -m venv $(1) && $(1)/bin/python -m pip install --quiet --no-compile uv
uv_install = $(1) -m uv pip install --quiet --python $(1) --index-strategy unsafe-best-match \
	--compile-bytecode $$($(1) tools/uv_args.py) $(2)
# The training-framework integrations' tests (tests/frameworks) run from a venv of their own:
# Lightning imports torchvision when it is installed, and the dev extra's torchvision (a CUDA
# build LitData pulls in) fails to import beside the CPU torch. This venv has no torchvision.
FW_VENV ?= .venv-frameworks
FW_PY := $(FW_VENV)/bin/python
# TensorFlow (tests/test_format_tfrecord.py's writer and parser, the tf.data service peer of
# the benchmarks) in a venv of its own: its pins stay apart from the dev venv's.
TF_VENV ?= .venv-tf
TF_PY := $(TF_VENV)/bin/python
# Test processes (pytest-xdist) for the main suite: CI's machine has 2 cores. Tests marked
# `serial` (timing figures a second process beside them would bend) run alone, after.
JOBS ?= 2
# Each run of `make test` lists its slowest tests (call, setup and teardown each), so that CI's
# output shows where the suite's time goes.
DURATIONS ?= --durations=30

.PHONY: install install-frameworks install-tf demo test test-frameworks lint bench proto reliability soak clean

$(VENV)/.installed: pyproject.toml
	$(call new_venv,$(VENV))
	$(call uv_install,$(PY),torch==2.13.0)
	$(call uv_install,$(PY),-e ".[$(DEV_EXTRAS)]")
	@$(PY) -c "import stoker.server._jpeg" 2>/dev/null || echo "note: stoker.server._jpeg \
	was not built (it needs gcc and libjpeg62-turbo-dev): JPEGs are decoded whole"
	touch $@

install: $(VENV)/.installed

$(FW_VENV)/.installed: pyproject.toml
	$(call new_venv,$(FW_VENV))
	$(call uv_install,$(FW_PY),torch==2.13.0)
	$(call uv_install,$(FW_PY),-e ".[$(FW_EXTRAS)]" \
		"pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "cryptography>=42")
	@! $(FW_PY) -c "import torchvision" 2>/dev/null || \
		{ echo "$(FW_VENV) must not have torchvision (Lightning would import it)"; exit 1; }
	touch $@

install-frameworks: $(FW_VENV)/.installed

$(TF_VENV)/.installed: pyproject.toml
	$(call new_venv,$(TF_VENV))
	$(call uv_install,$(TF_PY),-e ".[tf]")
	touch $@

install-tf: $(TF_VENV)/.installed

## demo: prepare a small image dataset, start a data server, train a CNN from it
demo: install
	$(PY) examples/demo.py

## test: lint, check the generated protobuf code, run the test suite, then the framework tests
test: install install-frameworks install-tf lint
	$(PY) protos/generate.py --check
	$(PY) -m pytest -n $(JOBS) -m "not serial" $(DURATIONS)
	$(PY) -m pytest -m serial $(DURATIONS)
	$(FW_PY) -m pytest -n $(JOBS) --dist loadfile -m frameworks tests/frameworks $(DURATIONS)

## test-frameworks: Lightning, the HF Trainer, torch.distributed.checkpoint and Ray, for real
test-frameworks: install-frameworks
	$(FW_PY) -m pytest -n $(JOBS) --dist loadfile -m frameworks tests/frameworks

lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

## bench: every benchmark scenario; writes results/*.json and docs/benchmarks.md
## (the SPDL peer also needs FFmpeg 5.1's libraries: apt-get install libavcodec59
## libavformat59 libavfilter8 libavutil57 libavdevice59; without them the pipeline scenarios
## leave it out and say so on the page)
bench: install install-tf
	$(PY) -m benchmarks

## reliability: the fault, load and bad-input tests, and the frameworks' resume tests (from
## their own venv); writes docs/reliability.md from both ledgers
reliability: install install-frameworks install-tf
	$(PY) -m pytest -q -n $(JOBS) -m "not serial" --reliability-json=results/reliability.json
	$(PY) -m pytest -q -m serial --reliability-json=results/reliability-serial.json
	$(FW_PY) -m pytest -q -m frameworks tests/frameworks \
		--reliability-json=results/reliability-frameworks.json
	$(PY) tests/reliability.py results/reliability.json results/reliability-serial.json \
		results/reliability-frameworks.json \
		docs/soak.json > docs/reliability.md

## soak: clients stream for MINUTES (default 30) from 2 servers killed and restarted in turn
soak: install
	$(PY) tests/soak.py --minutes $(or $(MINUTES),30) --out results/soak.json

## proto: regenerate protos/stoker/v1/*_pb2*.py after editing the .proto
proto: install
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) $(FW_VENV) $(TF_VENV) data results
