"""A process that takes (or tries to take) a run directory's lock, for tests/test_rundir.py.

Usage: python tests/scripts/rundir_lock.py MODE RUN_DIR [JOB]
  hold   take the lock through RunDir.lock(JOB), print 'locked' (or 'refused: ...'), then sleep
         until killed
  try    take the lock, print 'locked' or 'refused: <the one-line problem>', exit
  bare   flock RUN_DIR/.lock without writing a name into it (a holder caught between taking the
         lock and writing its name), print 'locked', then sleep until killed
"""
import fcntl
import os
import sys
import time

import hvdtrain  # noqa: F401
from hvdtrain.rundir import LOCK_FILE, RunDir


def main(mode: str, run_dir: str, job: str | None = None) -> None:
    if mode == "bare":
        descriptor = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        problem = None
    else:
        problem = RunDir(run_dir, is_chief=True).lock(job)
    print(f"refused: {problem}" if problem else "locked", flush=True)
    if mode in ("hold", "bare") and not problem:
        while True:
            time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:])
