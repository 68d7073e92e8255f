# The two commands of the README. Each runs its own (idempotent) set-up first.
#   make serve [ARGS="--port 9000 ..."]     serve the embedded model on 127.0.0.1:8000
#   make test  [PYTEST_ARGS="-k chat"]      run the whole test suite
.PHONY: setup serve test

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/turboserve serve $(ARGS)

# One torch thread per process: CI has 2 cores, shared with the server the API tests start.
test: setup
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q $(PYTEST_ARGS)
