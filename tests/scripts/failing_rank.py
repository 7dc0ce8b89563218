"""A job that fails the way MODE says, without TensorFlow, for the tests of a failed job's
console (run as a script by hvdtrain.launch):

    python failing_rank.py user-error-on-rank-0 | user-error | crash

Every rank prints "failing_rank: rank R starts". ``user-error-on-rank-0``: rank 0 alone raises a
RankError (one line, exit 2); ``user-error``: every rank raises the same UserError (rank 0's line,
exit 2); ``crash``: rank 1 ends with os._exit(3), without a word. The ranks that do not fail wait
for the launch command to end them.
"""
import os
import sys
import time

from hvdtrain.errors import RankError, UserError, reported
from hvdtrain.launcher_env import launch_rank

mode = sys.argv[1]
rank = launch_rank()
print(f"failing_rank: rank {rank} starts", flush=True)
with reported("failing_rank"):
    if mode == "user-error":
        raise UserError("--answer must be 42, got 41")
    if mode == "user-error-on-rank-0" and rank == 0:
        raise RankError("no GPU 0 on this node")
    if mode == "crash" and rank == 1:
        os._exit(3)
    time.sleep(120)
