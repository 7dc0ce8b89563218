"""Start a training job on the right ranks: `python -m hvdtrain.launch [options] -- PROGRAM [args]`.

PROGRAM is a module (``hvdtrain.cnn``: every rank runs ``python -m hvdtrain.cnn args``) or a script
path (``train.py``: ``python train.py args``), so a horovod script of your own gets the same start.
Outside Slurm it runs ``horovodrun -np N`` on this machine (N: the GPU count, or 1 on CPU). Inside a
Slurm allocation it reads the hosts, tasks and GPUs per node from the allocation and passes them on
(``-np``/``-H`` to horovodrun, or lets ``mpirun``/``srun --mpi=pmix`` read the allocation; pick
with ``--via``). Before launching it checks that the program exists for the ranks' Python, then
horovod's build, the GPUs per node and the rank count; each problem is one line and exit status 2.
``--dry-run`` prints the command and environment.

Signals: SIGUSR1, SIGTERM and SIGINT are forwarded to the ranks (SIGUSR1 is Slurm's warning before
the time limit; the ranks write a checkpoint and exit 75). The exit status is the job's. Before
anything is launched (the preflight probe) SIGTERM and SIGINT stop the launcher at once; during the
health check the signals stop the check's ranks; either way the exit status is the signal's (143,
130, or 75 after SIGUSR1).

Failures: the job's output passes through the launcher, which ends a failed job with one line
naming the rank(s) and host at fault and the log to read (``job exited 137: rank 3 on node2 ended
on SIGKILL ...; its log: RUN_DIR/logs/rank-3.log``), or the kind of failure (``job exited 2 (a
user error ...)``, after the rank's own line). That line is the failed job's last: mpirun's and
horovodrun's own pages about it ("Primary job terminated normally, but 1 process returned ...",
"Process 1 exit with status code 3.", horovodrun's traceback) are left out, as the line gives
their facts; every line a rank prints, and any other message of mpirun's, is shown.

Restarts: with ``--max-restarts N`` a job that failed (a rank died or crashed) is started again in
the same allocation, up to N times; an hvdtrain job resumes from its last checkpoint. A user error
(exit 2), a preemption stop (75) and a stop signal end the job without a restart. With
``--min-nodes N`` (and ``--hosts``) a host that stopped answering is dropped before the restart,
and the job resumes on the hosts left, at the smaller world size, while at least N are left.

Health: ``--health-check`` runs hvdtrain.health on every rank first (each node's GPUs or CPU
share, the links between nodes, the same numbers on every rank): a failure is its lines and exit
2; ``--health-check-only`` runs the check alone.

Containers: with ``--container IMAGE`` (and ``--via srun``) every rank runs in the image, through
Slurm's pyxis plugin (``srun --container-image``) or Charliecloud (``ch-run IMAGE -- python ...``).

In an sbatch script (``--sbatch``, as the templates in slurm/ run it): the HVDTRAIN_* variables
given at submission override the script's flags, the run directory defaults to
runs/<job name>-<job id>, and after Slurm's time-limit warning (SIGUSR1) the ranks checkpoint and
the launcher requeues the job (``scontrol requeue``, at most --max-requeues times).
"""
# The package, one module per concern; __main__ runs them in order:
#   options    the flags (one dataclass), their checks, what every rank runs (script or module)
#   preflight  what would make the launch fail, asked of the ranks' Python (probe)
#   network    across hosts, the interfaces that connect them all
#   netcheck   the network check itself: the probe on every host, and its rendezvous
#   paths      the command of each launch path: horovodrun, mpirun, srun
#   container  --container: the ranks in an image, with pyxis or Charliecloud
#   supervise  signals forwarded, the exit verdict, restarts, leftovers of an attempt
#   survivors  --min-nodes: the hosts that still answer, after a failure
#   remote     how the launcher reaches another host: ssh, or an srun step inside Slurm
#   health_check  --health-check: hvdtrain.health on every rank, before the job
#   failures   the job's output relayed, and read for why it failed (the one end line)
#   slurm      Slurm: the allocation read from SLURM_*, sbatch scripts written, requeue
#   sbatch     as the body of an sbatch script: the job's variables, requeue after USR1
#   watcher    ends the job if the launcher itself dies
