# Two commands on a fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install everything first (torch before the rest, so pip keeps the CPU wheel).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meridian-installed
export RAY_USAGE_STATS_ENABLED := 0
# Material for MkDocs prints an end-of-life banner on every build otherwise.
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meridian demo

# The web page test drives Debian's chromium through Playwright; install it when missing and root.
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q chromium; \
	else echo "chromium missing and not root: the browser test will be skipped"; fi

# The store's PostgreSQL tests start a throwaway server with Debian's initdb/pg_ctl; install them when missing
# and root (elsewhere those tests skip, saying why).
POSTGRES := /usr/share/postgresql-common/pg_wrapper

$(POSTGRES):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q postgresql; \
	else echo "postgresql missing and not root: the PostgreSQL store tests will be skipped"; fi

test: $(STAMP) $(CHROMIUM) $(POSTGRES)
	$(BIN)/python -m pytest -q --durations=30

lint: $(STAMP)
	$(BIN)/ruff check api service workers bench cli lab tests

# The documentation site into site/ (open site/index.html; no server or network needed). make test builds it too.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .meridian .pytest_cache site
