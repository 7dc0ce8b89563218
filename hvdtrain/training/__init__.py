"""The rank's run: what every process of a job does from its flags to its exit, by question.

* ``job``: a job's entry (flags -> runtime -> run -> exit status); ``hvdtrain.main`` and
  ``hvdtrain.run`` are its.
* ``config``: the flags, as typed dataclasses (TrainConfig, ImageConfig), presets and --config.
* ``train``: one run as a table of contents: inputs -> plan -> banner -> fit.
* ``inputs``: which batches each rank feeds; ``plan``: the data-parallel arithmetic.
* ``model``: the model compiled with the distributed optimizer, and what rank 0 exports;
  ``optimizers``: the recipe's optimizer and learning-rate schedule.
* ``start``: the run directory and where a run starts; ``checkpoint``: what a checkpoint holds,
  who writes it, how a run resumes.
* ``fit``: the callbacks, ``model.fit``, and how a run ends; ``callbacks``: hvdtrain's own;
  ``preemption``: a stop every rank agrees on; ``profile``: where the step's time goes.

The rest of the package is what a run uses: the data (``hvdtrain/data``), the backends
(``hvdtrain/runtime``, the one place horovod is imported), the run directory
(``hvdtrain/rundir.py``), trackers, the launcher (``hvdtrain/launch``).
"""
