"""A horovod job whose rank 0 takes SECONDS to write its last checkpoint after the other ranks
have ended: ``python slow_last_checkpoint.py RUN_DIR SECONDS`` (tests/test_multinode.py).

Every rank joins one allreduce (the job is up on every host), then the other ranks exit while
rank 0 writes a file in pieces, as to slow shared storage, and says when it is done.
"""
import os
import socket
import sys
import time

import hvdtrain  # noqa: F401  (Keras 2 before TensorFlow)

import horovod.tensorflow as hvd
import tensorflow as tf

run_dir, seconds = sys.argv[1], float(sys.argv[2])
hvd.init()
hvd.allreduce(tf.constant(1.0), op=hvd.Sum)
if hvd.rank() == 0:
    print(f"rank 0 on {socket.gethostname()}: writing the last checkpoint ({seconds:g} s)",
          flush=True)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "last-checkpoint"), "wb") as checkpoint:
        for _ in range(int(seconds)):
            checkpoint.write(os.urandom(1 << 16))
            checkpoint.flush()
            time.sleep(1)
    print("rank 0: last checkpoint written", flush=True)
