"""A job that notes each run and ends with the exit status it is given, for the restart and
requeue tests (run as a script by hvdtrain.launch or by the sbatch templates).

    python exit_status.py RECORD STATUS [--only-task N] [--after SECONDS] [--leave-behind]

Every rank appends "task=<array task> run=<Slurm restart count> rank=<rank> status=<status>" to
RECORD when it starts, so a test counts the runs from the rank=0 lines. With --only-task, array
tasks other than N exit 0. --after waits that long before exiting (a job to send signals to).
--leave-behind: rank 0 starts a process in a session of its own, which mpirun does not stop when
the job ends ("leftover PID"), and each run first notes how many earlier leftovers still run
("leftovers-running N").
"""
import argparse
import os
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("record")
parser.add_argument("status", type=int)
parser.add_argument("--only-task")
parser.add_argument("--after", type=float, default=0.0)
parser.add_argument("--leave-behind", action="store_true")
args = parser.parse_args()
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0"))
task = os.environ.get("SLURM_ARRAY_TASK_ID", "-")
status = args.status if args.only_task in (None, task) else 0


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if args.leave_behind and rank == "0":
    earlier = [int(line.split()[1]) for line in open(args.record)
               if line.startswith("leftover ")] if os.path.exists(args.record) else []
    with open(args.record, "a") as record:
        record.write(f"leftovers-running {sum(map(running, earlier))}\n")
with open(args.record, "a") as record:
    record.write(f"task={task} run={os.environ.get('SLURM_RESTART_COUNT', '0')} rank={rank} "
                 f"status={status}\n")
if args.leave_behind and rank == "0":
    leftover = subprocess.Popen(["sleep", "600"], start_new_session=True)
    with open(args.record, "a") as record:
        record.write(f"leftover {leftover.pid}\n")
# Exit no sooner than every rank has noted its run: mpirun ends the others once one fails.
time.sleep(max(args.after, 0.5 if status else 0.0))
sys.exit(status)
