# The two commands a newcomer types. Both create or refresh .venv and install what they need.
#   make demo   prepare the stdlib corpus into token shards, train the tiny model on them (2 CPU ranks)
#   make test   install Slurm and munge (apt, as root), then run the test suite; tests/slurm start
#               and stop their own munged, slurmctld and slurmd
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# When this make started: `make test` and `make demo` end by saying how long they took in all.
MAKE_START := $(shell date +%s)
# torch is pinned here, not in pyproject: 2.13.0 is the CPU build on this kind of machine; a range
# would pull a multi-GB CUDA build from PyPI. On a GPU machine install torch first, then `pip
# install -e .`.
TORCH ?= torch==2.13.0
# Two stamps in one .venv: what the demo needs (torch and hpctrain's own dependencies), then the
# extras only the tests need (transformers, mlflow, selenium, torchao, torchtitan, ...), so that
# `make demo` installs the first alone and a later `make test` adds the second.
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
# No byte-compiling at install: pip would compile all ~17k files of .venv (~30 CPU-s, serially);
# Python compiles, and caches, the modules it actually imports (a small part of transformers,
# torch, mlflow...) the first time. That caching is off where the environment sets
# PYTHONDONTWRITEBYTECODE (some CI images and sandboxes do): every one of the suite's few hundred
# Python processes then compiled torch and hpctrain from source again, 3.7 CPU-s each (6.8 s
# against 3.1 s for `import hpctrain.train.job`), which made `make test` 45% slower. The demo's
# and the tests' processes write their caches whatever the caller's environment says.
unexport PYTHONDONTWRITEBYTECODE
PIP := $(BIN)/python -m pip install -q --no-compile

.PHONY: demo test lint clean

$(BASE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) "$(TORCH)" -e .
	touch $(BASE_STAMP)

# torchtitan 0.2.2 goes into a folder of its own, without its dependencies: only its config
# package is loaded, by tests/bench/test_peer_flags.py to parse the peer's command lines (tyro,
# which it parses with, is in dev), so it stays out of the environment's packages.
$(STAMP): $(BASE_STAMP)
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps --upgrade --target $(VENV)/torchtitan-site "torchtitan==0.2.2"
	touch $(STAMP)

# The demo's corpus, prepared into token shards once (a rerun verifies them and returns at once).
# The byte-level tokenizer adds EOS (id 256), hence the vocabulary of 257.
DEMO_DATA := runs/data/stdlib

demo: $(BASE_STAMP)
	$(BIN)/hpctrain data prepare --stdlib --out $(DEMO_DATA) --shard-mb 16 --no-progress
	$(BIN)/hpctrain train configs/demo.yaml data.source=shards data.path=$(DEMO_DATA) \
		model.vocab_size=257 --nproc 2
	@echo "make demo: $$(($$(date +%s) - $(MAKE_START))) s in all"

# Installs Slurm and munge first (scripts/install-slurm.sh: Debian packages with apt-get, as root;
# a no-op when installed). tests/slurm then start their own clusters, one node and two nodes on
# this machine (munged, slurmctld, slurmd, config under a temp dir), and stop them at the end.
# Where it cannot install (not root, offline) it says why and the Slurm tests skip; under CI=true
# (.ci/run sets it) it fails instead.
# scripts/install-browser.sh does the same for Debian's chromium and chromedriver, which the
# browser test of `hpctrain report` drives headless.
# Two pytest-xdist workers: many tests wait on child processes (ranks, Slurm, signals) rather than
# compute, so two keep 2 cores busy; tests/conftest.py keeps each file (and all of tests/slurm) on
# one worker (`make test PYTEST_WORKERS=3` tries three: the Slurm tests mostly wait). At the end:
# the tests and files that cost the most CPU, when each worker ran its long files, the 25 slowest
# tests, then the time pytest took and that of the whole `make test` (installs included).
# The apt installs (downloads and dpkg, tens of seconds on a fresh machine) run in the
# background while pip fills .venv; their output is printed when both are done, and either
# failing fails `make test`. Interrupted (Ctrl-C, a CI kill), the recipe still waits for them:
# a background job ignores SIGINT, and a dpkg left running would hold the lock of the next run.
PYTEST_WORKERS ?= 2
test:
	@log=$$(mktemp); \
	{ bash scripts/install-slurm.sh && bash scripts/install-browser.sh; } > "$$log" 2>&1 & \
	system=$$!; \
	trap 'echo "make test: interrupted; waiting for the apt installs"; wait $$system; \
	      cat "$$log"; rm -f "$$log"; exit 130' INT TERM; \
	$(MAKE) --no-print-directory $(STAMP); venv=$$?; \
	wait $$system; apt=$$?; cat "$$log"; rm -f "$$log"; \
	[ $$venv -eq 0 ] && [ $$apt -eq 0 ]
	$(BIN)/ruff check src tests benchmarks
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25; rc=$$?; \
	end=$$(date +%s); \
	echo "make test: pytest took $$((end - start)) s; make test in all $$((end - $(MAKE_START))) s"; \
	exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache

# Opt-in, not part of `make test` (it needs podman: Debian's apt-get install podman, and root the
# first time on a machine without a registry): build containers/Containerfile as a CPU image,
# then run `hpctrain doctor` and 5 training steps on 2 ranks inside it; any failure fails the
# target (scripts/container-test.sh; log in runs/container-test.log). Where docker.io answers it
# builds on debian:12-slim with $(TORCH) from download.pytorch.org's CPU index; where it does not,
# on a Debian 12 base debootstrapped from this machine's mirror (scripts/make-base-image.sh) with
# a local torch wheel: TORCH_WHEEL=, else the newest cp311 one in /opt/wheels.
# The GPU image is the same file with its default BASE; see containers/Containerfile.
CONTAINER_TAG ?= hpctrain:cpu-test
TORCH_WHEEL ?=
.PHONY: container-test
container-test:
	CONTAINER_TAG="$(CONTAINER_TAG)" TORCH="$(TORCH)" TORCH_WHEEL="$(TORCH_WHEEL)" \
		bash scripts/container-test.sh
