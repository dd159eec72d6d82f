# megascale-data: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Pinned before the project is installed: this version is the local CPU wheel; any other torch
# spec may pull a multi-GB CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
# The reference environment of the vision-language checks (tests/vlm): transformers with torch and
# torchvision, where AutoProcessor builds the Qwen-VL processors whole. These wheels (a CUDA build,
# ~5.5 GB) install from this machine's own package store in about a minute and a half.
VLM_VENV := .venv-vlm
VLM_STAMP := $(VLM_VENV)/.installed
VLM_TORCH := torch==2.14.1 torchvision==0.29.1
VLM_TRANSFORMERS := transformers==5.24.0
# videos: PyAV (the workers' decoder, FFmpeg bundled), torchcodec (transformers' own video loader, the
# reference), and the project's own dependencies, so that a whole job with video workers runs there
VLM_VIDEO := av==18.1.0 torchcodec==0.17.0 num2words==0.5.14 pyzmq msgpack uvloop orjson zstandard pyzstd pyarrow prometheus-client

.PHONY: install .venv-vlm demo test lint simulate test-unit test-integration test-docs docs bench bench-remote-env bench-packing-env bench-vlm-env clean image k8s-manifests

# tools/install.sh is the one install script: the container image (Dockerfile) runs it too.
$(STAMP): pyproject.toml setup.py coordinator/_greedy.c coordinator/_whole.c coordinator/_feistel.c msd_common/formats/_lines.c Makefile tools/install.sh
	PYTHON=$(PYTHON) tools/install.sh --editable $(VENV) 'test,torch,torchtitan,plots,docs' $(TORCH)
	touch $(STAMP)

install: $(STAMP)

$(VLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLM_VENV)
	$(VLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(VLM_TORCH)
	$(VLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(VLM_TRANSFORMERS)
	$(VLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(VLM_VIDEO)
	touch $(VLM_STAMP)

.venv-vlm: $(VLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/msd demo --steps 50 --ranks 2 --workers 2 --json demo-summary.json

test: $(STAMP) $(VLM_STAMP) lint
	$(PY) -m pytest -q

# imports and line length ([tool.ruff] in pyproject.toml)
lint: $(STAMP)
	$(PY) -m ruff check .

# the deterministic simulation (msd/sim): SEEDS fresh seeds of whole jobs with faults; a failing seed
# prints its trace and the command that replays it. make test runs a fixed corpus and a few fresh seeds.
SEEDS ?= 200
simulate: $(STAMP)
	$(PY) -m msd.sim --seeds $(SEEDS) --steps 40 --json simulate.json

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

test-docs: $(STAMP)
	$(PY) -m pytest -q tests/docs

# the documentation site, into site/ (--strict: a broken link or a page left out of the nav fails)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The container image of the coordinator, workers and relays (deploy/helm/msd runs it), where Docker runs.
IMAGE ?= megascale-data/msd:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image:
	@command -v docker >/dev/null || { echo "make image: no docker here; the Dockerfile installs with tools/install.sh, as CI does" >&2; exit 1; }
	docker build -t $(IMAGE) .

# deploy/kubernetes/: the Helm chart rendered with its default values (tests/deploy checks it is current)
k8s-manifests: $(STAMP)
	$(PY) tools/render_chart.py --out deploy/kubernetes

bench: $(STAMP)
	$(PY) tools/bench_dataplane.py --json bench-dataplane.json

# tools/bench_packing.py's torchtune baseline, kept out of the project's venv (torchtune pins torchao)
# Megatron-Energon in the vision-language reference environment, for tools/bench_vlm.py
bench-vlm-env: $(VLM_STAMP)
	$(VLM_VENV)/bin/pip install --quiet megatron-energon==7.4.1

bench-packing-env:
	$(PYTHON) -m venv .venv-torchtune
	.venv-torchtune/bin/pip install --quiet $(TORCH)
	.venv-torchtune/bin/pip install --quiet torchtune==0.6.1 torchao==0.10.0

clean:
	rm -rf $(VENV) $(VLM_VENV) *.egg-info .pytest_cache demo-summary.json site

# tools/bench_remote.py's two outside parts, kept out of the project's venv: npm's s3rver (the
# S3-compatible server the benchmark serves from) and Mosaic Streaming in a venv of its own
# (it pins numpy < 2.2 and imports torchvision, whose PyPI build needs torch 2.14.1 here).
bench-remote-env:
	mkdir -p .bench && cd .bench && npm install --silent --no-audit --no-fund s3rver@3.7.1
	$(PYTHON) -m venv .venv-mosaic
	.venv-mosaic/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1
	.venv-mosaic/bin/pip install --quiet mosaicml-streaming==0.13.0
