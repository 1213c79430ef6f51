# The two commands of the README. Each builds .venv on first use, so a fresh clone needs nothing else.
# .venv holds the locked versions: requirements/cpu.lock (hashes checked; torch's CPU build) or
# requirements/gpu.txt (the same versions, torch's CUDA build); `make venv` says which, and why, in one line.
# `make lock` re-resolves the lock from pyproject.toml's ranges; `make newest` tries the newest releases.
VENV   := .venv
PY     := $(VENV)/bin/python
DLO    := $(VENV)/bin/dlo
STAMP  := $(VENV)/.installed
# Which lock: GPU=1 the CUDA one (from a login node without a GPU, for the GPU nodes that share its files),
# GPU=0 the CPU one; neither: the one .venv was installed from (the stamp records it), else the CUDA one where
# nvidia-smi answers. A .venv is never switched in place (pip keeps an installed torch 2.13.0+cpu for the CUDA
# lock's torch==2.13.0): GPU=0/1 or LOCK against a .venv of another lock is refused, with what to do.
HELD   := $(firstword $(shell cat $(STAMP) 2>/dev/null))
ifeq ($(GPU),1)
  LOCK ?= requirements/gpu.txt
  REASON = GPU=1: torch's CUDA 13.0 build, for GPU nodes with an NVIDIA driver >= 580
else ifeq ($(GPU),0)
  LOCK ?= requirements/cpu.lock
  REASON = GPU=0: torch's CPU build
else ifneq ($(HELD),)
  LOCK ?= $(HELD)
  REASON = what $(VENV) was installed from; GPU=1 or GPU=0 for the other, in a new $(VENV)
else
  FOUND = $(eval FOUND := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1))$(FOUND)# asked once, when needed
  LOCK ?= $(if $(FOUND),requirements/gpu.txt,requirements/cpu.lock)
  REASON = $(if $(FOUND),nvidia-smi answers here,no nvidia-smi here; for GPU nodes from a login node: make venv GPU=1)
endif
WHY     = $(if $(filter command line environment,$(origin LOCK)),LOCK given,$(REASON))
ifneq ($(HELD),)
ifneq ($(HELD),$(LOCK))
ifeq ($(filter clean,$(MAKECMDGOALS)),)
  $(error make venv: $(VENV) holds $(HELD), not $(LOCK) ($(WHY)); pip would keep its torch build: rm -rf $(VENV), then make venv again)
endif
endif
endif
# The interpreter .venv is made from. The locks are resolved for CPython 3.11 (cpu.lock's torch wheel is cp311's)
# and need 3.11.5 or newer (soupsieve 4.1.3 requires it; Debian 12's python3 is 3.11.2): any other is refused in
# one line before anything is made. PYTHON=/path/to/python3.11 picks another.
PYTHON ?= python3
# Where torch's CPU build is published; asked only when pip finds no torch==X+cpu in its usual places.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
OUT    ?= runs/make-run
PYTEST_ARGS ?=

.PHONY: run test lint venv lock newest release check clean

venv: $(STAMP)

# pip's retry on PyTorch's CPU index is for the CPU lock only: from there the CUDA lock's torch==2.13.0 would
# be met by 2.13.0+cpu.
$(STAMP): pyproject.toml requirements/cpu.lock requirements/gpu.txt
	@v=$$($(PYTHON) -c 'import platform; print(platform.python_version())' 2>/dev/null); case "$$v" in \
	  3.11.[5-9]|3.11.[1-9][0-9]) ;; \
	  *) echo "make venv: $(PYTHON) is Python $${v:-(not found)}; the locks need CPython 3.11.5 or a newer 3.11: make venv PYTHON=/path/to/python3.11 (or conda: environment.yml)" >&2; exit 2;; esac
	@echo "make venv: installing $(LOCK) into $(VENV) ($(WHY))"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r $(LOCK) $(if $(filter requirements/cpu.lock,$(LOCK)),|| { \
	  echo "make venv: retrying with $(TORCH_CPU_INDEX) for torch's CPU build" >&2; \
	  $(PY) -m pip install -q --extra-index-url $(TORCH_CPU_INDEX) -r $(LOCK); })
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pip check
	echo $(LOCK) > $(STAMP)

# Re-resolve requirements/cpu.lock from pyproject.toml's ranges and requirements/cpu.in (pip-tools; existing
# pins are kept unless UPGRADE=1), then derive requirements/gpu.txt from it. Commit all three files.
lock: $(STAMP)
	$(PY) -m pip install -q "pip-tools>=7.4,<8"
	$(VENV)/bin/pip-compile -q --generate-hashes --allow-unsafe --strip-extras --all-extras --no-emit-index-url \
	  --no-emit-find-links $(if $(UPGRADE),--upgrade) -o requirements/cpu.lock pyproject.toml requirements/cpu.in
	$(PY) requirements/gpu.py

# Not part of make test: the suite against the newest releases pyproject.toml allows (torch stays the locked
# CPU build and its Triton, requirements/cpu.in), in a venv of its own, so that a breaking release is seen
# before a term starts; first the list of what is newer still, outside the ranges.
newest:
	python3 -m venv .venv-newest
	.venv-newest/bin/python -m pip install -q --no-deps -r requirements/cpu.lock
	.venv-newest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c requirements/cpu.in -e ".[browser]"
	.venv-newest/bin/python -m pip list --outdated --not-required
	.venv-newest/bin/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# Execute every day's solutions notebook headlessly (tiny profile on CPU, full on GPU nodes; two at a
# time where there are 2 cores or more, each counting on its share of them: dlo run --jobs), and autograde
# each executed notebook as a reference submission as soon as it has run, in the same slots (dlo run
# --grade: the cells up to the last graded one, the same scores as dlo grade after the run): full marks
# required; then every claims table the run printed walked row by row (dlo.claims_audit: each verdict
# from its evidence, a fraction of a second), whatever the grading said.
run: $(STAMP)
	rm -rf $(OUT)
	$(PY) -m compileall -q lib  # dlo's bytecode, once: not compiled again by each of the run's ~50 processes
	$(DLO) run --all --profile auto --out $(OUT)/submitted/reference --grade $(OUT)/grading --require-full; ran=$$?; \
	$(PY) -m dlo.claims_audit $(OUT)/submitted/reference; audited=$$?; \
	[ $$ran = 0 ] || exit $$ran; exit $$audited

# Style first (seconds), then the suite on two workers (pytest-xdist), a test file (or a test class) per
# worker at a time: the course's grading (tests/harness/test_course.py, a class per day: the untouched
# release here, the solutions in `pytest -m solutions`, a CI step of its own) is spread over both and
# starts first (tests/conftest.py orders the files; xdist must keep that order, not put the largest
# files first). PYTEST_ARGS="-n 0" runs it serially.
test: $(STAMP) lint
	$(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# Style is checked, not remembered: ruff (pyproject.toml [tool.ruff]) on the library, the tests and the
# notebooks of solutions/ (course/ is generated from them).
lint: $(STAMP)
	$(VENV)/bin/ruff check lib tests solutions

release: $(STAMP)
	$(DLO) release

check: $(STAMP)
	$(DLO) check

clean:
	rm -rf $(VENV) .venv-newest runs grading gradebook.db
