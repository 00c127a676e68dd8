# The two quickstart commands: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned: any other spec may pull a multi-GB CUDA build (see README).
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= out/demo

.PHONY: setup demo test bench clean

$(BIN)/diffq: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(BIN)/diffq

setup: $(BIN)/diffq

demo: setup
	$(BIN)/diffq tiny-pipeline out/tiny-flux2-klein
	rm -rf $(DEMO_OUT)
	$(BIN)/diffq run examples/prompts.jsonl --model out/tiny-flux2-klein --out $(DEMO_OUT) --workers 2 --batch-size 4 --steps 4
	@echo "images are in $(DEMO_OUT)/images (records in $(DEMO_OUT)/records)"

# The suite's budget: 20 minutes on the 2-core CI machine (19.9 min measured quiet, 1,821 tests;
# sequential it was over 50). Its tests wait on servers and subprocesses more than they
# compute, so 3 workers on 2 cores; each test file runs whole on one worker (its
# module-scoped servers started once), longest files first (tests/durations.json, which
# scripts/test-durations.py refreshes), so no long file is dealt last to run alone. The run
# ends with its total and its ten slowest tests, so a regression shows in CI's log the day
# it lands.
TEST_WORKERS ?= 3
test: setup
	bash scripts/test-services.sh
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

bench: setup
	$(BIN)/python -m pip install -q -e ".[test,bench]"  # Ray Data, for the comparison only
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) out
