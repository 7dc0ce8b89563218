"""`python -m benchmarks.peakrss MODULE ARGS...`: run a module, then print this process's peak
resident memory (the benchmarks wrap each rank with it; the launcher prefixes the line)."""
import atexit
import resource
import runpy
import sys


def _report() -> None:
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    print(f"peak resident memory: {peak_kb // 1024} MB", flush=True)


if __name__ == "__main__":
    module, sys.argv = sys.argv[1], sys.argv[1:]
    atexit.register(_report)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
