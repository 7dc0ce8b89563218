"""hvdtrain.cnn's job, plus what every rank saw: for the multi-node tests (tests/test_multinode.py).

Runs exactly what ``python -m hvdtrain.cnn ARGS`` runs (same presets, flags, model, data, run
directory), through hvdtrain's public API, with one change: each rank builds its initial weights
from its own seed (1000 + rank), so "identical weights afterwards" proves the broadcast and the
allreduce worked rather than that every rank started the same. After training, all ranks
allgather their facts and rank 0 prints one line, ``MULTINODE_PROBE {json}``: per rank its rank,
size, local_rank, local_size, cross_rank, cross_size, hostname, digests of its initial and
final weights, and the value of HVDTRAIN_PROBE_VARIABLE in its environment. The script exits with the job's status.

Launch it like a training script: ``horovodrun -np 4 -H node1:2,node2:2 python
tests/scripts/multinode_probe.py --preset tiny --run-dir DIR``, ``HVDTRAIN_MODULE=<this file>
sbatch slurm/multinode.sh --run-dir DIR``, ``python -m hvdtrain.launch <this file> ...``.
"""
import dataclasses
import hashlib
import json
import os
import socket
import sys

import hvdtrain  # Keras 2 before TensorFlow

import horovod.tensorflow as hvd
import tf_keras as keras

from hvdtrain import cnn

PROBE_PREFIX = "MULTINODE_PROBE "


def digest(model: keras.Model) -> str:
    return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]


def main() -> int:
    built: dict[str, object] = {}

    def build_rank_seeded_model(data):
        keras.utils.set_random_seed(1000 + hvd.rank())
        model = cnn.CLASSIFIER.build_model(data)
        built.update(model=model, initial=digest(model))
        return model

    task = dataclasses.replace(cnn.CLASSIFIER, build_model=build_rank_seeded_model)
    status = hvdtrain.run(task, sys.argv[1:], name=cnn.PROGRAM, presets=cnn.PRESETS)
    facts = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
             "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
             "cross_size": hvd.cross_size(), "hostname": socket.gethostname(),
             "initial": built.get("initial"),
             "final": digest(built["model"]) if "model" in built else None, "status": status,
             # A variable of the launching shell, if the test set one: did it reach this rank?
             "user_variable": os.environ.get("HVDTRAIN_PROBE_VARIABLE")}
    ranks = hvd.allgather_object(facts)
    if hvd.rank() == 0:
        print(PROBE_PREFIX + json.dumps({"ranks": ranks}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
