# fullshard: `make demo` trains the MNIST job on real data, `make test` runs the suite.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test typecheck clean

# Bytecode is written as modules are first imported, so only what runs gets compiled, once: pip's
# byte-compiling of every installed file took 166 s here (19,000 files, on one core), compileall
# on both cores 49 s, while a run imports a fraction of them. Where the environment sets
# PYTHONDONTWRITEBYTECODE, every process would compile its imports again (torch's alone take
# seconds), so it is not passed on to this Makefile's commands.
unexport PYTHONDONTWRITEBYTECODE

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --no-compile torch==2.13.0
	$(VPY) -m pip install -q --no-compile -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/fullshard train mnist --nproc 2

test: venv
	$(VPY) tools/check_layers.py
	$(VPY) -m ruff check src tests tools examples
	$(VPY) -m ruff format --check src tests tools examples
	@# --no-loadscope-reorder: files go to the workers in collection order, the longest first
	@# (tests/conftest.py), not sorted by their number of tests, which put the few long tests last
	@# mypy (a minute from a cold cache, one core) runs beside the suite, whose workers often
	@# wait on the processes they start; its report follows the suite's, and either failing fails
	rm -f .mypy.out; ($(VPY) -m mypy > .mypy.out 2>&1; echo $$? >> .mypy.out) & \
	$(VPY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder; rc=$$?; wait; \
	echo "mypy:"; cat .mypy.out; test "$$(tail -n 1 .mypy.out)" = 0 && test $$rc = 0

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache
