"""The rank's run, by question: the job's recipe (``optimizers``: which optimizer, which
learning-rate schedule; ``stopping``: the job's own callbacks and a stop every rank agrees on).

``hvdtrain/train.py`` runs a job with them; the rest of the run (data, plan, run directory,
checkpoints) is still beside it at the package root.
"""
