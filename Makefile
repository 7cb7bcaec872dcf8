# The two commands a newcomer types. Both create or refresh .venv and install what they need.
#   make demo   prepare the stdlib corpus into token shards, train the tiny model on them (2 CPU ranks)
#   make test   install Slurm and munge (apt, as root), then run the test suite; tests/slurm start
#               and stop their own munged, slurmctld and slurmd
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here, not in pyproject: 2.13.0 is the CPU build on this kind of machine; a range
# would pull a multi-GB CUDA build from PyPI. On a GPU machine install torch first, then `pip
# install -e .`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The demo's corpus, prepared into token shards once (a rerun verifies them and returns at once).
# The byte-level tokenizer adds EOS (id 256), hence the vocabulary of 257.
DEMO_DATA := runs/data/stdlib

demo: $(STAMP)
	$(BIN)/hpctrain data prepare --stdlib --out $(DEMO_DATA) --shard-mb 16 --no-progress
	$(BIN)/hpctrain train configs/demo.yaml data.source=shards data.path=$(DEMO_DATA) \
		model.vocab_size=257 --nproc 2

# Installs Slurm and munge first (scripts/install-slurm.sh: Debian packages with apt-get, as root;
# a no-op when installed). tests/slurm then start their own clusters, one node and two nodes on
# this machine (munged, slurmctld, slurmd, config under a temp dir), and stop them at the end.
# Where it cannot install (not root, offline) it says why and the Slurm tests skip; under CI=true
# (.ci/run sets it) it fails instead.
# scripts/install-browser.sh does the same for Debian's chromium and chromedriver, which the
# browser test of `hpctrain report` drives headless.
test: $(STAMP)
	bash scripts/install-slurm.sh
	bash scripts/install-browser.sh
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache

# Opt-in, not part of `make test` (it needs podman and a network that reaches docker.io and
# download.pytorch.org): build containers/Containerfile on a CPU base with podman (Debian:
# apt-get install podman), then run the preflight and a few training steps inside the image.
# The GPU image is the same file with its default BASE; see containers/Containerfile.
CONTAINER_TAG ?= hpctrain:cpu-test
.PHONY: container-test
container-test:
	podman build -f containers/Containerfile -t $(CONTAINER_TAG) \
		--build-arg BASE=docker.io/library/debian:12-slim --build-arg TORCH="$(TORCH)" \
		--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
	podman run --rm $(CONTAINER_TAG) python3 -m hpctrain doctor configs/demo.yaml \
		run.out_dir=/tmp/runs
	podman run --rm $(CONTAINER_TAG) python3 -m hpctrain train configs/demo.yaml \
		run.out_dir=/tmp/runs train.steps=5 data.max_bytes=200000 --nproc 2
