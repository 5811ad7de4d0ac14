# Two entry points for a fresh machine (see README.md):
#   make run    set up .venv and run the default pipeline (config/config.yaml)
#   make test   set up .venv with the test extras and run the test suite (unit tests + tiny real Snakemake runs + lint)
# On a GPU box keep its CUDA build of torch: `make run TORCH=torch` (or any pip requirement).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# Beside the CPU torch pin, a Triton whose wheel lies on our machines' disk, so setup does not
# download the newest 285 MB wheel (a dropped download failed CI once). 3.8.0, not the GPU device's
# 3.6.0: 3.6's interpreter breaks on numpy 2.4 (L1_1's legit GEMM: "only 0-dimensional arrays can be
# converted to Python scalars"). With any other TORCH, torch picks its Triton.
TRITON ?= $(if $(filter torch==2.13.0,$(TORCH)),triton==3.8.0,)
# A dropped download (seen in CI) reruns the command, up to three times; pip's own resume retries first.
RETRY = for attempt in 1 2 3; do $(1) && break; if [ $$attempt = 3 ]; then exit 1; fi; \
	echo "setup step failed (attempt $$attempt of 3); retrying in 15 s" >&2; sleep 15; done
PIP_INSTALL = echo "pip install $(1)"; $(call RETRY,$(BIN)/python -m pip install -q --retries 10 --resume-retries 10 $(1))
CORES ?= 2
# `make test` runs the suite on this many pytest-xdist workers (0: one process), each module on one
# worker (its module-scoped fixtures run once), the longest modules first (tests/conftest.py)
TEST_WORKERS ?= 2
SNAKEMAKE_ARGS ?=
BIN := $(VENV)/bin
# kpipe's own bytecode, at every setup (so before every run and test): pip compiles the packages it
# installs but not an editable project's src/, and where PYTHONDONTWRITEBYTECODE is set (our machines)
# each job's and each KernelGym worker's interpreter compiled the kpipe modules it imports again,
# about 1.6 s of a job's start: the default run took 3 min 47 s of Snakemake without it, 3 min 15 s
# with it (2 CPU cores). Files already compiled are skipped; an edited one is compiled again.
COMPILE_SRC = $(BIN)/python -m compileall -q src
STAMP := $(VENV)/.kpipe-installed
# the test extras (pytest, schemathesis, Ray, the Slurm plugin) on top: `make run` never needs them,
# and Ray with its dependencies was most of a fresh machine's setup time
DEV_STAMP := $(VENV)/.kpipe-dev-installed

.PHONY: setup setup-dev run test test-browser lint test-snakemake-floor clean wheelhouse wheelhouse-vllm setup-offline

# The torch requirement the venv was set up with: `make setup TORCH=torch` on an existing .venv (a GPU
# box that got the CPU pin) replaces torch and Triton by what TORCH names; pip alone would keep the
# installed torch, which satisfies a bare `torch`.
# A venv set up before this stamp existed had the default pin.
TORCH_STAMP := $(VENV)/.kpipe-torch
TORCH_WANTED = $(strip $(TORCH) $(TRITON))
TORCH_HAD = $$(cat $(TORCH_STAMP) 2>/dev/null || echo "torch==2.13.0 triton==3.8.0")
SWITCH_TORCH = if [ -x $(BIN)/python ] && [ "$(TORCH_HAD)" != "$(TORCH_WANTED)" ]; then \
	echo "torch requirement changed: $(TORCH_HAD) -> $(TORCH_WANTED)"; \
	$(BIN)/python -m pip uninstall -q -y torch triton; $(call PIP_INSTALL,"$(TORCH)" $(TRITON)); \
	echo "$(TORCH_WANTED)" > $(TORCH_STAMP); fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "pip install --upgrade pip"; $(call RETRY,$(BIN)/python -m pip install -q --retries 10 --upgrade pip)
	@$(SWITCH_TORCH)
	@$(call PIP_INSTALL,"$(TORCH)" $(TRITON))
	@echo "$(TORCH_WANTED)" > $(TORCH_STAMP)
	@$(call PIP_INSTALL,-e .)
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	@$(call PIP_INSTALL,-e ".[dev]")
	touch $(DEV_STAMP)

setup: $(STAMP)
	@$(SWITCH_TORCH)
	@$(COMPILE_SRC)

setup-dev: $(DEV_STAMP)
	@$(SWITCH_TORCH)
	@$(COMPILE_SRC)

run: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS)

# tests/test_viewer.py runs the viewer's page in headless Chromium (and fails without it): as root,
# Debian's chromium is installed when missing (apt); otherwise `make test` stops at once with the command
test-browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "apt-get install -y chromium (tests/test_viewer.py)"; apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
		echo "make test needs Chromium for tests/test_viewer.py; run: sudo apt-get install -y chromium" >&2; exit 1; \
	fi

test: test-browser setup-dev
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --lint

# The floor of Snakemake's pin (kpipe.infra.snakemake_adapter.TESTED_SNAKEMAKE): that version in a venv
# layered over the project's, then the adapter's tests, the lint and the default DAG's plan under it
SNAKEMAKE_FLOOR ?= 9.17.0
FLOOR_VENV ?= .venv-snakemake-floor
test-snakemake-floor: setup-dev
	rm -rf $(FLOOR_VENV) && $(BIN)/python -m venv $(FLOOR_VENV)
	$(BIN)/python -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(FLOOR_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/project-venv.pth"
	$(FLOOR_VENV)/bin/python -m pip install -q "snakemake==$(SNAKEMAKE_FLOOR)"
	PATH="$(abspath $(FLOOR_VENV))/bin:$$PATH" PYTHONPATH="$(abspath src)" $(FLOOR_VENV)/bin/python -m pytest \
		-p no:randomly -n 0 tests/test_snakemake_adapter.py
	PYTHONPATH="$(abspath src)" $(FLOOR_VENV)/bin/python -m snakemake --lint
	PYTHONPATH="$(abspath src)" $(FLOOR_VENV)/bin/python -m snakemake -n --quiet rules

# For a machine without internet (HPC clusters, the lent GPU device): the wheels kpipe needs beyond
# what the target has (HAVE: its `python -m pip list --format=freeze`), for its Python, in parts of
# at most 60 MiB (scripts/wheelhouse.py). On the target: `make setup-offline` (or install part by part).
WHEELHOUSE ?= wheelhouse
TARGET_PYTHON ?= 3.12
HAVE ?= target-freeze.txt
wheelhouse: setup
	$(BIN)/python scripts/wheelhouse.py --have $(HAVE) --python $(TARGET_PYTHON) --out $(WHEELHOUSE)

# vLLM 0.26.0 alone for the GPU device (docs/vllm-on-the-device.md): what it imports on the paths
# kpipe takes (in-process LLM, `vllm serve`) beyond the device image (docs/device-freeze.txt), in
# parts of 58 MiB (a call carries 64 MiB, the repo included). VLLM_SKIP: requirements vLLM never
# imports there; xgrammar 0.2.7, the newest that takes vLLM's apache-tvm-ffi==0.1.10; VLLM_DROP:
# files of the vLLM wheel a Hopper GPU never loads (`make wheelhouse-vllm VLLM_DROP=
# VLLM_WHEELHOUSE=wheelhouse-vllm-full` keeps the wheel whole: 6 calls instead of 3).
VLLM_SKIP ?= flashinfer-python nvidia-cudnn-frontend nvidia-cutlass-dsl quack-kernels tilelang tokenspeed-mla \
	humming-kernels torchcodec pynvvideocodec nvtx fastsafetensors numba setuptools depyf setproctitle blake3 \
	compressed-tensors mistral-common lm-format-enforcer outlines-core lark jsonschema ijson python-json-logger \
	anthropic mcp opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp opentelemetry-semantic-conventions-ai \
	fastapi-cli fastar python-multipart email-validator pydantic-settings pydantic-extra-types httptools python-dotenv \
	websockets supervisor
VLLM_DROP ?= vllm:vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm:vllm/vllm-rs
VLLM_WHEELHOUSE ?= wheelhouse-vllm
wheelhouse-vllm: setup
	$(BIN)/python scripts/wheelhouse.py --have docs/device-freeze.txt --python 3.12 --also vllm==0.26.0 --without-kpipe \
		$(addprefix --skip ,$(VLLM_SKIP)) --pin xgrammar==0.2.7 $(addprefix --drop ,$(VLLM_DROP)) --part-mib 58 \
		--out $(VLLM_WHEELHOUSE)

# On the target, with no index, into the environment $(PYTHON) belongs to (the one holding the
# machine's CUDA torch; activate it first): kpipe's missing wheels from every part (a wheel cut
# into chunks joined again, every wheel checked against SHA256SUMS), then kpipe itself, editable,
# built with the wheelhouse's setuptools. Then run `snakemake --cores N` there.
setup-offline:
	rm -rf $(WHEELHOUSE)/all && mkdir $(WHEELHOUSE)/all && for p in $(WHEELHOUSE)/part-*; do cp $$p/* $(WHEELHOUSE)/all/; done
	cd $(WHEELHOUSE)/all && for c in *.chunk-00; do [ -e "$$c" ] || continue; w=$${c%.chunk-00}; \
		cat "$$w".chunk-* > "$$w" && rm "$$w".chunk-*; done; sha256sum -c --ignore-missing --quiet SHA256SUMS
	$(PYTHON) -m pip install -q --no-index --no-deps $(WHEELHOUSE)/all/*.whl
	$(PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	$(PYTHON) -m pip check
	$(PYTHON) -m compileall -q src

clean:
	rm -rf results logs .snakemake
