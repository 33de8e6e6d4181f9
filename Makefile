# The two commands the README promises: `make demo` (the main job) and `make test` (the tests).
# Both set up .venv on first use, so each works alone on a fresh machine.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvguard-installed

.PHONY: demo test lint typecheck pytest install clean

# setup.py and the C source: an edited planner extension is rebuilt by the next make.
$(STAMP): pyproject.toml setup.py kvguard/zeroize/_plan.c scripts/bootstrap.sh
	VENV=$(VENV) scripts/bootstrap.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvguard policy validate examples/policies/*.yaml
	$(BIN)/kvguard demo

lint: $(STAMP)
	$(BIN)/ruff check kvguard tests benchmarks
	$(BIN)/ruff format --check kvguard tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	scripts/ensure-postgres.sh
	VENV=$(VENV) scripts/install-browser.sh
	$(BIN)/pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
