"""Run a user's script as one rank of a job: ``python -m hvdtrain.script train.py [args]``.

``hvdtrain.launch`` starts every rank of a script that runs on Keras 2 only this way (``import
tf_keras``, an optimizer's ``variables()`` called, ``experimental_run_tf_function``; or
``--keras 2``), so it runs unchanged on a TensorFlow that ships Keras 3: importing this module
imports ``hvdtrain`` first,
which points ``import keras`` and ``tf.keras`` at tf_keras before the script imports TensorFlow.
The script then runs as ``__main__`` with the ``sys.argv`` and ``sys.path[0]`` that
``python train.py args`` would give it.
"""
import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m hvdtrain.script SCRIPT.py [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
