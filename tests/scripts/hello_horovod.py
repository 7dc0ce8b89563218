"""A user's own horovod script, as `python -m hvdtrain.launch --np 2 hello_horovod.py` runs it.

It imports neither hvdtrain nor Keras (so no Keras 2 hook: horovod.tensorflow works under Keras 3).
Every rank allreduces its rank number and prints "rank R of N: sum S args [...]"; when the ranks
really found each other, S = 0 + 1 + ... + N-1 on every rank.
"""
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
total = hvd.allreduce(tf.constant(hvd.rank(), tf.int64), op=hvd.Sum)
print(f"rank {hvd.rank()} of {hvd.size()}: sum {int(total)} args {sys.argv[1:]}", flush=True)
