# The two commands of the README. Each builds .venv on first use, so a fresh clone needs nothing else.
# On CPU machines torch is pinned to the 2.13.0 CPU wheel (an unpinned torch pulls GBs of CUDA);
# on a machine with an NVIDIA driver the newest CUDA build is taken (GPU clusters: environment.yml).
VENV   := .venv
PY     := $(VENV)/bin/python
DLO    := $(VENV)/bin/dlo
STAMP  := $(VENV)/.installed
TORCH  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
OUT    ?= runs/make-run
PYTEST_ARGS ?=

.PHONY: run test lint venv release check clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# Execute every day's solutions notebook headlessly (tiny profile on CPU, full on GPU nodes),
# then autograde the executed notebooks as a reference submission: the table must show full marks.
run: $(STAMP)
	rm -rf $(OUT)
	$(DLO) run --all --profile auto --out $(OUT)/submitted/reference
	$(DLO) grade $(OUT)/submitted --out $(OUT)/grading --require-full

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
	rm -rf $(VENV) runs grading gradebook.db
