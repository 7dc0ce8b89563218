"""The article's device benchmark: time `w @ x + b` with batched shapes on the selected device.

Shapes (batch, 512, 16) x (batch, 16, 512) + (batch, 512, 512); batch 1024 in the article (about
8.6 GFLOP and 1 GiB per result). Timed properly: the compiled function runs `warmup` times first
(tracing, memory allocation), and every timed call waits for its result (fetching one element
forces the device to finish) before the clock stops.
"""
from __future__ import annotations

import statistics
import time


def run_matmul(runtime, *, batch: int = 1024, repeats: int = 10, warmup: int = 2) -> dict:
    import tensorflow as tf

    kind = runtime.devices.kind
    device = {"cpu": "/CPU:0", "gpu": "/GPU:0", "tpu": "/TPU:0"}[kind]
    with tf.device(device):
        w = tf.random.normal((batch, 512, 16), seed=1)
        x = tf.random.normal((batch, 16, 512), seed=2)
        b = tf.random.normal((batch, 512, 512), seed=3)

        @tf.function
        def affine():
            return tf.matmul(w, x) + b

        def timed_call() -> float:
            start = time.perf_counter()
            result = affine()
            result[0, 0, 0].numpy()  # wait for the device to finish
            return time.perf_counter() - start

        for _ in range(warmup):
            timed_call()
        seconds = [timed_call() for _ in range(repeats)]
    flops = 2 * batch * 512 * 512 * 16 + batch * 512 * 512  # multiply-adds, then the bias
    median = statistics.median(seconds)
    return {"benchmark": "matmul", "device": runtime.devices.description,
            "device_kind": kind, "backend": runtime.world.backend, "batch": batch,
            "repeats": repeats, "warmup": warmup, "seconds": seconds,
            "median_seconds": median, "min_seconds": min(seconds), "max_seconds": max(seconds),
            "gflops_per_second": flops / median / 1e9}


def describe(result: dict) -> str:
    return (f"matmul ({result['batch']},512,16) x ({result['batch']},16,512) + bias on "
            f"{result['device']}: median {result['median_seconds'] * 1e3:.1f} ms over "
            f"{result['repeats']} runs (min {result['min_seconds'] * 1e3:.1f}, max "
            f"{result['max_seconds'] * 1e3:.1f}), {result['gflops_per_second']:.1f} GFLOP/s")
