# fullshard: `make demo` trains the MNIST job on real data, `make test` runs the suite.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test typecheck clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/fullshard train mnist --nproc 2

test: venv
	$(VPY) tools/check_layers.py
	$(VPY) -m ruff check src tests tools examples
	$(VPY) -m ruff format --check src tests tools examples
	$(VPY) -m mypy
	$(VPY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache
