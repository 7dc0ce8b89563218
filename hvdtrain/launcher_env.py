"""Who started this process: the rank and size a launcher announced, before any runtime exists.

The one place that reads launcher variables (horovodrun, mpirun, srun). Asked for two decisions
that come before the runtime is up: which rank prints an early error (``errors.reported``) and
what ``--backend auto`` means (``runtime.select_backend``). Imports nothing from hvdtrain, so the
launcher and the error handling can use it without loading TensorFlow.
"""
from __future__ import annotations

import os
from typing import Mapping

# What launchers tell each process before it starts, as (rank, size) variables, in order of
# trust: horovodrun (Gloo), OpenMPI's mpirun, PMI-1/2 (srun --mpi=pmi2, MPICH), PMIx (srun
# --mpi=pmix, which names the rank but not the size). Read only to decide who prints an error
# that happens before the runtime starts, and which backend `auto` means; once horovod runs,
# the runtime asks horovod.
_LAUNCHER_VARIABLES = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK",
                                                         "OMPI_COMM_WORLD_SIZE"),
                       ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", None))


def launched_as(env: Mapping[str, str] | None = None) -> tuple[int, int | None] | None:
    """(rank, size) as a launcher announced them; size None if it didn't; None if no launcher."""
    env = os.environ if env is None else env
    for rank_name, size_name in _LAUNCHER_VARIABLES:
        rank = env.get(rank_name, "")
        if rank.isdigit():
            size = env.get(size_name or "", "")
            return int(rank), int(size) if size.isdigit() else None
    return None


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher announced it (0 when not launched by one)."""
    launched = launched_as(env)
    return launched[0] if launched else 0
