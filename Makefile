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
MPIRUN := $(MPI_ENV) mpirun -np 2 --oversubscribe --bind-to none

.PHONY: install train test test-unit test-mpi bench slurm-up slurm-down cluster-up cluster-down clean distclean

$(STAMP): setup.cfg scripts/install.sh scripts/constraints.txt
	HVDTRAIN_VENV=$(VENV) bash scripts/install.sh

install:
	HVDTRAIN_VENV=$(VENV) bash scripts/install.sh

# horovodrun itself loads TensorFlow, whose start-up INFO lines say nothing about the job; the
# ranks get the same default from hvdtrain. A level set in the environment wins.
train: $(STAMP)
	$(MPI_ENV) TF_CPP_MIN_LOG_LEVEL=$${TF_CPP_MIN_LOG_LEVEL:-2} \
	  $(VENV)/bin/horovodrun -np $(NP) $(PYTHON) -m hvdtrain.cnn $(ARGS)

test: test-unit test-mpi

test-unit: $(STAMP)
	$(PYTHON) -m pytest tests/ --durations=25 $(PYTEST_ARGS)

test-mpi: $(STAMP)
	$(MPIRUN) $(PYTHON) -m pytest tests/ -p no:cacheprovider --color=no $(PYTEST_ARGS)

bench: $(STAMP)
	$(MPI_ENV) $(PYTHON) -m benchmarks all $(ARGS)

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
	rm -rf runs .pytest_cache build hvdtrain.egg-info
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
