# ptq: set up with `make install` (done by `run` and `test` when needed), then `make run` / `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PTQ := $(BIN)/ptq
# The real assets (CIFAR-10 and the MLPerf Tiny ResNet8): one setting, exported to ptq and the tests.
PTQ_ASSETS ?= ../shared/assets
export PTQ_ASSETS
ONNX2TORCH := onnx2torch==1.5.15

.PHONY: install qemu cxx run tune sweep test test-fast lint docs benchmarks-page bench bench-runtimes bench-int8 bench-speed peers clean

install: $(VENV)/.installed qemu cxx

# `--backend pt2e` models run through torch.compile, whose Inductor builds C++ kernels: a C++ compiler (Debian's g++).
cxx:
	@command -v g++ >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } || \
		echo "g++ not installed (needs apt-get as root): --backend pt2e models cannot be compiled for x86"

# qemu-user (Debian) runs onnxruntime's real kernels as an AVX2 CPU without VNNI, so that a VNNI machine
# can measure the saturating int8 path (`ptq evaluate --int8-path saturating`); ptq says so when it is missing.
# Where Linux can fault CPUID, a C compiler builds ptq's shim that runs them natively instead (x86/emulate.py).
qemu:
	@command -v qemu-x86_64 >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null; } || \
		echo "qemu-user not installed (needs apt-get as root): the saturating int8 path runs slower, or not at all, on a VNNI CPU"

# torch is pinned to 2.13.0, the local CPU build; onnx2torch goes in with --no-deps because its
# metadata requires torchvision, whose registry build is CUDA-only (docs/pytorch.md).
# uv installs what pip would, in a fraction of its time (docs/installing.md); it reads neither pip's configuration
# (tools/uv_options.py passes it on) nor pip's rule of the best version over all indexes (unsafe-best-match is
# that rule). Where uv cannot install, pip does.
EXTRAS := '.[keras,dev,openvino,litert,executorch,ray]'
UV_VERSION := uv==0.13.9
$(VENV)/.installed: pyproject.toml Makefile tools/uv_options.py
	$(PYTHON) -m venv $(VENV)
	{ $(BIN)/pip install --quiet $(UV_VERSION) && $(BIN)/uv pip install --quiet --system-certs --compile-bytecode --python $(BIN)/python \
		--index-strategy unsafe-best-match $$($(BIN)/python tools/uv_options.py) -e $(EXTRAS); } || \
		{ $(BIN)/pip install --quiet --upgrade pip && $(BIN)/pip install --quiet -e $(EXTRAS); }
	$(BIN)/pip install --quiet --no-deps $(ONNX2TORCH)
	touch $@

# The whole study in one command; stages whose inputs are unchanged (by sha256) are skipped, see
# results/manifest.json. `make run FORCE=--force` runs every stage again.
run: install
	$(PTQ) run $(FORCE)

# After `make run`: tune ONNX Runtime int8 and uint8, PyTorch int8 and NNCF int8 on the validation split, then judge the choices on the test set.
tune: install
	$(PTQ) tune --dtype int8
	$(PTQ) tune --dtype uint8
	$(PTQ) tune --backend pytorch
	$(PTQ) tune --backend openvino
	$(PTQ) evaluate --model models/resnet8_int8_tuned.onnx --model models/resnet8_uint8_tuned.onnx --model models/resnet8_pytorch_int8_tuned.pt \
		--model models/resnet8_openvino_int8_tuned.xml
	$(PTQ) report --markdown

# After `make run`: prune at 0/30/50/70% (global), quantize int8, evaluate; then the report with its charts.
sweep: install
	$(PTQ) sweep --sparsity 0,0.3,0.5,0.7 --dtype int8
	$(PTQ) report --markdown --plot

# Two pytest workers (pytest-xdist): the study's `ptq run` on one, the other tests beside it (tests/conftest.py groups
# them, and orders the groups longest first: xdist hands them out in that order).
test: install
	$(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=40

# Everything but the real-asset tests (no study run, no CIFAR): in-process, synthetic models and data;
# the fuzz harness runs a quarter of its cases.
# ruff (pyproject's rules: pycodestyle, pyflakes, isort, bugbear, simplify, pyupgrade, complexity <= 15) and mypy on ptq_cli.
lint: install
	$(BIN)/ruff check ptq_cli tests benchmarks tools
	$(BIN)/mypy
	$(BIN)/python tools/cli_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"

# docs/benchmarks.md from the study's records (after `make run`): the report's tables, none typed by hand.
benchmarks-page: install
	$(BIN)/python tools/benchmarks_page.py --results-dir results

# The documentation site: the CLI reference regenerated from the app, then built (MkDocs, strict) into site/.
docs: install
	$(BIN)/python tools/cli_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test-fast: install
	PTQ_FUZZ_SCALE=0.25 $(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder -m "not real_assets"

bench: install
	$(BIN)/python benchmarks/pipeline.py

bench-runtimes: install
	$(BIN)/python benchmarks/runtimes.py

# ptq's default models on both x86 int8 paths and their speed, with issue 22's targets for this CPU's instruction set.
bench-int8: install
	$(BIN)/python benchmarks/int8_paths.py

# Each classifier's 8-bit models (ptq on onnxruntime and OpenVINO, NNCF on OpenVINO) against FP32 at batch 1 and 32 (benchmarks/speed.py).
bench-speed: install
	$(BIN)/python benchmarks/speed.py $(if $(WORKDIR),--workdir $(WORKDIR))

# ptq against plain onnxruntime, NNCF (full bias correction) and AIMET-ONNX (AdaRound) on EfficientNet-Lite0 and photos
# (benchmarks/peers.py). AIMET-ONNX gets its own virtual environment (2 GB), outside `make test` and CI. STAMPS=DIR measures on Tux Paint's stamp photographs, WORKDIR=DIR keeps the files.
PEERS_VENV ?= .venv-peers
peers: install $(PEERS_VENV)/.installed
	$(BIN)/python benchmarks/peers.py --aimet-python $(PEERS_VENV)/bin/python $(if $(STAMPS),--stamps $(STAMPS)) $(if $(WORKDIR),--workdir $(WORKDIR))

# AIMET-ONNX leaves torch unpinned: the local CPU build (torch==2.13.0) goes in first, and onnx2torch without its
# torchvision (as in ptq's own environment); AIMET's other requirements are its wheel's, named here.
AIMET_REQUIRES := Jinja2 PyYAML 'bokeh>=3.3.0' 'hvplot>=0.10.0' jsonschema numpy onnx 'onnx_ir>=0.1.16' 'onnxruntime>=1.19' \
	'onnxscript>=0.4.0' osqp pandas psutil pybind11 scikit-learn scipy tqdm
$(PEERS_VENV)/.installed:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/pip install --quiet torch==2.13.0 $(AIMET_REQUIRES)
	$(PEERS_VENV)/bin/pip install --quiet --no-deps aimet-onnx==2.42.0 $(ONNX2TORCH)
	touch $@

clean:
	rm -rf models calibration results reports
