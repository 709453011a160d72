# fullshard: `make demo` trains the MNIST job on real data, `make test` runs the suite.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test typecheck clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --no-compile torch==2.13.0
	$(VPY) -m pip install -q --no-compile -e '.[dev]'
	@# pip byte-compiles on one core (166 s for both installs here); compileall on all cores
	@# (84 s + 49 s). Some packages ship files that never compile (templates): ignored.
	-$(VPY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1
	touch $(STAMP)

demo: venv
	$(VENV)/bin/fullshard train mnist --nproc 2

test: venv
	$(VPY) tools/check_layers.py
	@# bytecode for the package and tests, which every worker process imports (where
	@# PYTHONDONTWRITEBYTECODE is set, nothing else writes it and each process compiles again)
	$(VPY) -m compileall -q -j 0 src tests > /dev/null
	$(VPY) -m ruff check src tests tools examples
	$(VPY) -m ruff format --check src tests tools examples
	@# mypy (a minute from a cold cache, one core) runs beside the suite, whose workers often
	@# wait on the processes they start; its report follows the suite's, and either failing fails
	rm -f .mypy.out; ($(VPY) -m mypy > .mypy.out 2>&1; echo $$? >> .mypy.out) & \
	$(VPY) -m pytest -q -n 2 --dist loadfile; rc=$$?; wait; \
	echo "mypy:"; cat .mypy.out; test "$$(tail -n 1 .mypy.out)" = 0 && test $$rc = 0

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache
