# Two entry points a new user needs: `make demo` (start the stack, send a request) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 is pinned so pip takes the CPU build that lies on this machine's disk, never a multi-GB
# CUDA download; nixl is installed without its deps because its meta package drags both CUDA variants in;
# xgrammar likewise, because it drags in triton (its other deps are in the engine extra).
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,test]'
	$(BIN)/pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1 xgrammar==0.2.9
	$(BIN)/pip install -q --no-deps triton==3.6.0  # its interpreter checks the CUDA kernels on CPU (tests/triton_kernels_check.py)

demo: install
	$(BIN)/python -m splitserve_demo

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider
