# Set-up and everyday commands. Everything installs into .venv with constraints.txt.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all
install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/migrator demo --output-dir models

# Two workers: most tests are subprocess runs of one Python thread each.
test: install
	$(PY) -m pytest -q -n 2

test-all: install
	$(PY) -m pytest -q -n 2 -m ''
