# The README's commands. Everything is installed into .venv; nothing else on the machine
# is needed but Python 3.11+ and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: run test services services-down manage bench lint install install-dev clean

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed (set PYTHON=python3.12)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: requirements.txt $(VENV)/bin/python
	$(PY) -m pip install --quiet -r requirements.txt
	@touch $@

$(VENV)/.installed-dev: requirements.txt requirements-dev.txt $(VENV)/.installed
	$(PY) -m pip install --quiet -r requirements-dev.txt
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

## make run: migrate, roles, demo data (DEBUG on), web + worker + beat; Ctrl-C stops all.
run: $(VENV)/.installed
	DEBUG=$${DEBUG-1} PORT=$(PORT) $(PY) -m console.devserver

## make test: install, start embedded servers if needed, run the whole suite.
test: $(VENV)/.installed-dev
	DEBUG=1 $(PY) -m console.embedded run -- $(PY) -m pytest $(PYTEST_ARGS)

## make services / services-down: the embedded PostgreSQL and Redis alone.
services: $(VENV)/.installed
	$(PY) -m console.embedded up

services-down: $(VENV)/.installed
	$(PY) -m console.embedded down

## make manage ARGS="operations list --status unknown"
manage: $(VENV)/.installed
	@$(PY) manage.py $(ARGS)

bench: $(VENV)/.installed-dev
	$(PY) -m console.embedded run -- $(PY) -m tests.bench

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) staticfiles .pytest_cache
