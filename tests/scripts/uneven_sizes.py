"""Run the real training job on every data set size from 1 to 3 x world size + 1, in one job.

Usage: horovodrun -np N python tests/scripts/uneven_sizes.py RUN_ROOT
Rank 0 prints one JSON line: {size: "finished" | "refused: <message>"}. Every size must end one
way or the other on every rank; a hang would show as the test's timeout.
"""
import dataclasses
import json
import sys

import hvdtrain  # noqa: F401
from hvdtrain.training import train
from hvdtrain.cnn import CLASSIFIER
from hvdtrain.cnn import tiny
from hvdtrain.errors import UserError
from hvdtrain.runtime.horovod import HorovodRuntime


def main(run_root: str) -> None:
    runtime = HorovodRuntime()
    outcomes = {}
    for samples in range(1, 3 * runtime.world.size + 2):
        config = dataclasses.replace(
            tiny(), data="synthetic", synthetic_samples=samples, batch_size=1, epochs=2,
            validation_fraction=0.25, run_dir=f"{run_root}/size-{samples}", tensorboard=False)
        try:
            result = train.run("uneven", config, runtime, CLASSIFIER)
            outcomes[samples] = f"finished {len(result.rows)} epochs" if runtime.world.is_chief \
                else "finished"
        except UserError as error:
            outcomes[samples] = f"refused: {error}"
    everyone = runtime.allgather_object(outcomes)
    if runtime.world.is_chief:
        print("OUTCOMES " + json.dumps(everyone), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
