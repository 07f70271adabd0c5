VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/edgefcl simulate --transport mqtt --out runs/demo
	@echo "the edgefcl command is in $(VENV)/bin: source $(VENV)/bin/activate"

# Everything, including the slow fault-injection and fleet tests over real brokers (what CI runs).
test: $(STAMP)
	$(VENV)/bin/pytest -m "not cuda or cuda"

# The quick loop: unit and fast integration tests (slow ones deselected in pyproject.toml).
test-fast: $(STAMP)
	$(VENV)/bin/pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The docs site (user guide, studies, API reference from the docstrings), strict: a broken link
# or reference fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

bench: $(STAMP)
	$(VENV)/bin/edgefcl bench client --seeds 3 --out runs/bench
	$(VENV)/bin/edgefcl bench transport --out runs/bench

clean:
	rm -rf runs .pytest_cache .ruff_cache
