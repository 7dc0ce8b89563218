"""Run a module as on a GPU node, as far as Keras' XLA choice goes: ``python gpu_node_answer.py -m
MODULE ARGS...`` (under mpirun, as a rank).

Keras 3's ``compile(jit_compile="auto")`` compiles the training step with XLA wherever
``tf.config.list_physical_devices()`` lists a device that is not a CPU
(keras/src/trainers/trainer.py, ``_resolve_auto_jit_compile``). This machine has no GPU, so that
one answer of TensorFlow's is given here: the full device list gains a GPU. Everything else is
this machine's own: ``list_physical_devices("GPU")``, which hvdtrain asks to pin a rank, still
lists none, so the ranks compute on the CPU (XLA's CPU compiler), with the step Keras would
compile on a GPU node. Nothing of hvdtrain is replaced.
"""
import runpy
import sys

import hvdtrain  # noqa: F401  (chooses the Keras before TensorFlow loads, as the module would)
import tensorflow as tf

_list_physical_devices = tf.config.list_physical_devices


def gpu_node_devices(device_type=None):
    devices = _list_physical_devices(device_type)
    if device_type is None:
        devices = [*devices, tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
    return devices


tf.config.list_physical_devices = gpu_node_devices

if __name__ == "__main__":
    if sys.argv[1:2] != ["-m"] or len(sys.argv) < 3:
        sys.exit("usage: gpu_node_answer.py -m MODULE [ARGS...]")
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
