# hvdtrain: `make train` and `make test` install everything on first use (see README.md).
SHELL := /bin/bash
# One venv for make and scripts/install.sh: `make VENV=...`, else HVDTRAIN_VENV (the script's knob)
# from the environment, else .venv; the install recipes hand it to the script.
VENV ?= $(or $(HVDTRAIN_VENV),.venv)
PYTHON := $(VENV)/bin/python
# install.sh writes the stamp last; it is newer than every file that defines the environment, or
# `make` reinstalls.
STAMP := $(VENV)/.hvdtrain-installed
NP ?= 2
ARGS ?=
PYTEST_ARGS ?=
# OpenMPI refuses to start as root without these; harmless for other users.
MPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The collective tests run once as 2 ranks. Oversubscribe: CI machines may have fewer cores.
# (Its ranks yield when idle as every hvdtrain rank does: HorovodRuntime sets Open MPI's
# mpi_yield_when_idle before MPI starts, unless the environment sets it.)
MPIRUN := $(MPI_ENV) mpirun -np 2 --oversubscribe --bind-to none

.PHONY: install train test test-fast test-clusters test-local test-unit test-mpi test-stack bench docs slurm-up slurm-down cluster-up cluster-down clean distclean

$(STAMP): setup.cfg scripts/install.sh $(wildcard scripts/constraints/*.txt scripts/horovod-patches/*.patch)
	HVDTRAIN_VENV=$(VENV) bash scripts/install.sh

install:
	HVDTRAIN_VENV=$(VENV) bash scripts/install.sh

# horovodrun itself loads TensorFlow, whose start-up INFO lines say nothing about the job; the
# ranks get the same default from hvdtrain. A level set in the environment wins.
train: $(STAMP)
	$(MPI_ENV) TF_CPP_MIN_LOG_LEVEL=$${TF_CPP_MIN_LOG_LEVEL:-2} \
	  $(VENV)/bin/horovodrun -np $(NP) $(PYTHON) -m hvdtrain.cnn $(ARGS)

# `make test` is `make test-unit test-mpi` in two lanes at once, because neither pass alone keeps
# 2 cores busy: the tests against the local clusters mostly wait (daemons, timeouts, requeues)
# while the rest mostly compute. The cluster files share one cluster (and take it down), so they
# stay in one lane, in order, with the fault tests (test_faults.py), the Keras 3 tests
# (test_keras3.py), the network check's tests and the mpirun pass to even the lanes out; the other
# lane runs the rest (2026-11-26, a machine half as fast as earlier ones: 51:34 against 57:47
# before test_keras3.py moved over; 2026-11-28: 44:21 and 45:40 before issue 46's tests, which
# went mostly to the other lane; 2026-11-29, issue 57's faster starts, a fresh clone's .ci/run on
# an Intel Xeon: [local] 32:06, [clusters] 30:34 + 1:14; later that day, issues 58-60's tests
# in: [local] 29:52, [clusters] 27:29 + 1:38, before test_health.py, ~20 s, moved over;
# 2026-11-30: [local] 31:32, [clusters] 28:59 + 2:07). Three lanes (the local files split in
# two) were no faster that day: [clusters] 30:19 + 1:37, [local1] 26:11, [local2] 21:50, and
# after moving test_faults.py to a local lane that lane ran it in 14 min, not 5: the cores were
# 93% busy already, and more lanes only made each test slower. Later (a faster day, 2026-11-30
# again): [local] 24:06, [clusters] 24:23 + 0:52; once test_multinode.py lost two waits (~50 s),
# test_netcheck.py and test_health.py (~30 s) went back to the local lane. Each lane prints
# whole lines under its name, and its slowest tests.
CLUSTER_LANE := tests/test_multinode.py tests/test_slurm.py tests/test_cluster_safety.py \
  tests/test_faults.py tests/test_keras3.py
# -u: pytest's lines reach the lane's prefixer as they are written, not in 8 KiB blocks.
PYTEST := $(PYTHON) -u -m pytest
PYTEST_MPI := $(MPIRUN) $(PYTHON) -u -m pytest tests/ -p no:cacheprovider --color=no $(PYTEST_ARGS)
LANE_PREFIX = 2>&1 | sed -u "s/^/[$(@:test-%=%)] /"

test: $(STAMP)
	@$(MAKE) --no-print-directory -j2 test-clusters test-local

test-clusters: $(STAMP)
	set -o pipefail; { $(PYTEST) $(CLUSTER_LANE) -p no:cacheprovider --durations=30 \
	  $(PYTEST_ARGS) && $(PYTEST_MPI); } $(LANE_PREFIX)

test-local: $(STAMP)
	set -o pipefail; $(PYTEST) tests/ $(addprefix --ignore=,$(CLUSTER_LANE)) --durations=40 \
	  $(PYTEST_ARGS) $(LANE_PREFIX)

# The pure tier for the inner loop: every test not marked `integration` (tests/conftest.py says
# which are), in one process, no cluster or root needed; it must stay under 3 minutes (2026-11-29:
# 654 tests in 2:00-2:08 on this machine's 2 cores). `make test` runs these too. The collective
# tests about ranks together (conftest.multi_rank) run only in `make test`'s 2-rank pass.
test-fast: $(STAMP)
	$(PYTEST) tests/ -m "not integration" --durations=15 $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PYTEST) tests/ --durations=25 $(PYTEST_ARGS)

test-mpi: $(STAMP)
	$(PYTEST_MPI)

# Another TensorFlow without growing CI (CI keeps the default stack): `make test-stack TF=2.19.1`
# builds its own venv with horovod patched and compiled against that TensorFlow, then runs the
# distributed subset: a Keras 3 job that resumes, a Keras 3 export, a plain horovod.tensorflow.keras
# script on Keras 2, the GPU-given check, and the mpirun pass under each Keras. The pytest summary
# lines land in docs/stack/tf-$(TF).txt (docs/stack.md reads them).
TF ?=
STACK_VENV = .venv-tf$(TF)
STACK_TESTS := tests/test_keras3.py tests/test_gpus.py tests/test_stack.py \
  tests/test_api.py::test_a_plain_horovod_keras_script_runs_unchanged_through_the_launcher
test-stack:
	@[[ -n "$(TF)" ]] || { echo "usage: make test-stack TF=2.19.1 (a TensorFlow release)" >&2; exit 2; }
	HVDTRAIN_VENV=$(STACK_VENV) HVDTRAIN_TF_VERSION=$(TF) bash scripts/install.sh
	mkdir -p docs/stack
	@# Each pass, and each rank of the mpirun passes, into a log of its own: two ranks writing one
	@# stream interleaved their summary lines.
	set -o pipefail; logs=$$(mktemp -d); failed=0; \
	$(STACK_VENV)/bin/python -u -m pytest $(STACK_TESTS) -p no:cacheprovider --color=no 2>&1 \
	  | tee $$logs/subset || failed=1; \
	for keras in 3 2; do HVDTRAIN_KERAS=$$keras $(MPIRUN) bash -c 'set -o pipefail; "$$0" -u -m \
	  pytest tests/ -p no:cacheprovider --color=no 2>&1 | tee "$$1/mpirun-keras$$2-rank$$OMPI_COMM_WORLD_RANK"' \
	  $(STACK_VENV)/bin/python $$logs $$keras || failed=1; done; \
	{ echo "# make test-stack TF=$(TF) on $$(date -u +%F), $$(uname -m), $$(nproc) cores"; \
	  cat $(STACK_VENV)/.hvdtrain-installed; \
	  for pass in subset mpirun-keras3-rank0 mpirun-keras3-rank1 mpirun-keras2-rank0 \
	      mpirun-keras2-rank1; do echo "## $$pass"; \
	    grep -E '^(=+ .*(passed|failed|error).* =+$$|FAILED |ERROR )' $$logs/$$pass; done; \
	} >docs/stack/tf-$(TF).txt; \
	rm -rf $$logs; cat docs/stack/tf-$(TF).txt; exit $$failed

bench: $(STAMP)
	$(MPI_ENV) $(PYTHON) -m benchmarks all $(ARGS)

# The docs as a website in site/ (mkdocs.yml); --strict stops at the first warning, as the test does.
docs: $(STAMP)
	$(PYTHON) -m mkdocs build --strict

slurm-up:
	bash tests/cluster/slurm-local.sh up

slurm-down:
	bash tests/cluster/slurm-local.sh down

# A multi-host cluster on this machine (root): NODES network-namespace nodes with ssh and Slurm.
NODES ?= 2
cluster-up:
	bash tests/cluster/cluster-local.sh up --nodes $(NODES)

cluster-down:
	bash tests/cluster/cluster-local.sh down

clean:
	rm -rf runs .pytest_cache build site hvdtrain.egg-info
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
