# Set-up and everyday commands. Everything installs into .venv with constraints.txt.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The old end of the transformers range (upstream pins 5.0.0): a venv that sees $(VENV)'s packages
# (a .pth adds its site-packages after its own) and holds only what differs: transformers 5.0.0 and
# its pins. ~20 s to build instead of a second full install.
VENV_TF50 ?= .venv-tf5.0
STAMP_TF50 := $(VENV_TF50)/.installed
# The end-to-end tests run again on transformers 5.0.0 (upstream's pin): the family tests and one
# framework recipe run by upstream's executor/scripts/infer.sh. `make test` has to stay within its budget.
OLD_END_TESTS ?= tests/e2e/test_families.py tests/e2e/test_framework_target.py::test_framework_recipe_runs_through_upstreams_infer_sh_with_parity

.PHONY: install install-tf50 demo test test-main test-tf50 test-all
install: $(STAMP)
install-tf50: $(STAMP_TF50)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

$(STAMP_TF50): $(STAMP) constraints-transformers-5.0.txt
	rm -rf $(VENV_TF50)
	python3 -m venv $(VENV_TF50)
	echo "import site; site.addsitedir('$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
		> "$$($(VENV_TF50)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_infer_migrator_base.pth"
	$(VENV_TF50)/bin/python -m pip install -q -c constraints-transformers-5.0.txt transformers
	$(VENV_TF50)/bin/python -c "import transformers, agent; assert transformers.__version__ == '5.0.0', transformers.__version__"
	touch $(STAMP_TF50)

demo: install
	$(VENV)/bin/migrator demo --output-dir models

# Two workers: most tests are subprocess runs of one Python thread each. The slowest 25 are listed at the
# end (the budget: docs/tests.md). A module goes to one worker
# (--dist loadscope), so its module-scoped fixtures (a migrated recipe, a copied checkout) are built once,
# not once per worker. `make test` runs the suite on the tested transformers (constraints.txt), then the
# end-to-end family tests on transformers 5.0.0.
test: test-main test-tf50

# install-tf50 first: tests/e2e/test_recipe_on_transformers_5_0.py vendors from .venv-tf5.0's 5.0.0 and runs the recipe in it
test-main: install install-tf50
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=25

test-tf50: install-tf50
	$(VENV_TF50)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(OLD_END_TESTS)

test-all: install
	$(PY) -m pytest -q -n 2 --dist loadscope -m ''
