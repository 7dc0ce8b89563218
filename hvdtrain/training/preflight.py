"""What a job's flags and its launch refuse before TensorFlow loads.

TensorFlow's import costs every rank about 2 s of CPU, and horovod's start more: a mistake the
flags and the launcher's variables already show (several ranks for a one-process backend, a
global batch the ranks cannot share, a folder that is not there) is one line at once, not after
every rank has started. Each rule lives where the later, general check does; this module only
asks them early.
"""
from __future__ import annotations

from hvdtrain import KERAS
from hvdtrain.errors import UserError
from hvdtrain.launcher_env import launch_rank, launched_as
from hvdtrain.runtime import check_launch
from hvdtrain.training.config import ImageConfig, TrainConfig
from hvdtrain.training.plan import per_worker_batch


def check_backend(config: TrainConfig, backend: str) -> None:
    """The backends Keras 3 has never run a job's flags on (``backend`` resolved)."""
    if KERAS == "3" and backend == "tpu":
        raise UserError("Keras 3 (the default) runs on the horovod, single and mirrored "
                        "backends; on 'tpu' it has never run here: pass --keras 2")
    if KERAS == "3" and backend == "mirrored" and (config.steps_per_execution or 1) > 1:
        # Keras 3.15's multi-step function under MirroredStrategy fails at its first call
        # ("You must feed a value for placeholder tensor ..."); one step per call trains.
        raise UserError("--steps-per-execution above 1 with --backend mirrored fails inside "
                        "Keras 3: pass --keras 2, or --steps-per-execution 1")


def refuse_early(config: TrainConfig) -> None:
    """Raise ``UserError`` for what is wrong before any rank starts its compute."""
    if config.backend != "auto":  # `auto` is resolved by looking for a TPU, with TensorFlow
        check_launch(config.backend, config.backend)
        check_backend(config, config.backend)
    launched = launched_as()
    ranks = launched[1] if launched else None
    if ranks and config.backend in ("auto", "horovod"):
        # A launcher's ranks are horovod's workers, one each: the global batch is shared by them.
        try:
            per_worker_batch(config.batch_size, config.batch_policy, ranks)
        except ValueError as error:
            raise UserError(str(error)) from None
    if isinstance(config, ImageConfig) and config.data_dir and launch_rank() == 0:
        # Rank 0 lists the folder for everyone (data/folder.py), so it asks: a folder missing
        # on its node is one line from it, and the other ranks are ended with the job.
        from hvdtrain.data.folder import require_folder

        require_folder(config.data_dir)
