"""hvdtrain: one Keras training job, data-parallel on 1, 4 or 64 GPUs (or CPU ranks, or a TPU).

Importing this package chooses the Keras every hvdtrain module (and your model file) gets from
``import keras``. This is the only place that does it, and it must happen before TensorFlow is
imported, hence at package import time: every entry point is ``python -m hvdtrain.<module>``,
which runs this file first.

* **Keras 3** (the default, as ``import keras`` gives on TensorFlow >= 2.16): TensorFlow's own
  Keras, untouched; hvdtrain distributes it with its own integration on horovod's TensorFlow
  collectives (``runtime/keras3.py``): stock ``horovod.tensorflow.keras`` (0.28.1) cannot run on
  it (horovod#4290; hvdtrain's build can, with patches 0005-0006, for users' scripts).
* **Keras 2** (``--keras 2``, ``HVDTRAIN_KERAS=2``, or ``TF_USE_LEGACY_KERAS=1`` in the
  environment, which asks the same of TensorFlow): tf_keras, distributed by
  ``horovod.tensorflow.keras``.
  ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` resolve to ``tf_keras``, and an import hook makes
  ``import keras`` (which horovod does) give ``tf_keras`` too. The hook rather than importing
  ``tf_keras`` here, so that tools which never touch Keras (the launcher, the Slurm renderer)
  start in milliseconds instead of loading TensorFlow.

``KERAS`` holds the choice ("2" or "3").

Every rank imports this first, so it also makes the rank's stdout and stderr write whole lines
(``_write_whole_lines``), which keeps horovodrun/mpirun's per-rank tags at the start of lines.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import re
import sys
import tempfile
import time
import types

STARTED = time.monotonic()
"""When this process imported hvdtrain (before TensorFlow): a job's first milestone
(``timeline.py``), after the interpreter's own start-up."""

__version__ = "0.1.0"

# The public API for your own training job (docs/your-job.md); everything else in
# hvdtrain is internal. Resolved on first use, so that `import hvdtrain` stays instant.
__all__ = ["Datasets", "Shard", "Task", "TrainConfig", "main", "run"]


def __getattr__(name: str):
    if name == "TrainConfig":
        from hvdtrain.training import config

        return config.TrainConfig
    if name in ("main", "run"):
        from hvdtrain.training import job

        return getattr(job, name)
    if name in __all__:
        from hvdtrain import task

        return getattr(task, name)
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")


class _KerasIsTfKeras(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import keras`` / ``import keras.x`` -> the already-imported ``tf_keras`` / ``tf_keras.x``."""

    def __init__(self):
        self._real_specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "keras" or fullname.startswith("keras."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module("tf_keras" + spec.name[len("keras"):])
        self._real_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias spec on the tf_keras module; put its own back so
        # importlib (and TensorFlow's lazy loader) keep finding tf_keras where it really is.
        module.__spec__ = self._real_specs[module.__name__]


def default_keras(env) -> str:
    """The Keras a process gets without ``--keras``: HVDTRAIN_KERAS when it says 2 or 3, else the
    one ``import keras`` and ``tf.keras`` give there: 2 under ``TF_USE_LEGACY_KERAS=1``, else 3."""
    if env.get("HVDTRAIN_KERAS") in ("2", "3"):
        return env["HVDTRAIN_KERAS"]
    return "2" if env.get("TF_USE_LEGACY_KERAS") == "1" else "3"


def _requested_keras(argv: list[str], env) -> str:
    """The Keras asked for: a ``--keras N`` / ``--keras=N`` argument, else ``default_keras``.

    Read from the command line here because the choice must be made before the job's module
    imports TensorFlow, long before it parses its flags (its ``--keras`` flag then only checks and
    records it). Any other value selects the default; the job's flag parser rejects it.
    """
    requested = default_keras(env)
    for index, argument in enumerate(argv):
        if argument == "--keras" and index + 1 < len(argv):
            requested = argv[index + 1]
        elif argument.startswith("--keras="):
            requested = argument.split("=", 1)[1]
    return requested if requested in ("2", "3") else default_keras(env)


def _select_keras(version: str) -> None:
    # TensorFlow's C++ INFO banners, repeated by every rank, bury the lines users care about.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if version == "3":
        if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
            if "tensorflow" in sys.modules:
                raise ImportError("Keras 3 was asked for (--keras 3 / HVDTRAIN_KERAS=3), but "
                                  "TensorFlow was imported with TF_USE_LEGACY_KERAS=1 (Keras 2); "
                                  "import hvdtrain first, or unset it")
            # Inherited from a Keras 2 process that started this one (hvdtrain sets it there).
            del os.environ["TF_USE_LEGACY_KERAS"]
        if any(isinstance(finder, _KerasIsTfKeras) for finder in sys.meta_path):
            raise ImportError("this process already selected Keras 2 for hvdtrain; Keras 3 must "
                              "be chosen before hvdtrain is first imported (HVDTRAIN_KERAS=3)")
        # Ranks started by this process (tests, the benchmark) inherit the choice.
        os.environ["HVDTRAIN_KERAS"] = "3"
        return
    if os.environ.get("TF_USE_LEGACY_KERAS") != "1" and "tensorflow" in sys.modules:
        # Too late to switch tf.keras to Keras 2 in this process: say so instead of failing later.
        raise ImportError("hvdtrain must be imported before tensorflow (it selects Keras 2 for "
                          "horovod); import hvdtrain first or set TF_USE_LEGACY_KERAS=1")
    keras = sys.modules.get("keras")
    if keras is not None and keras is not sys.modules.get("tf_keras"):
        raise ImportError("Keras 3 was imported before hvdtrain; horovod needs Keras 2 (tf_keras). "
                          "Import hvdtrain first, or ask for Keras 3 with HVDTRAIN_KERAS=3.")
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    if not any(isinstance(finder, _KerasIsTfKeras) for finder in sys.meta_path):
        sys.meta_path.insert(0, _KerasIsTfKeras())


KERAS = _requested_keras(sys.argv, os.environ)
_select_keras(KERAS)

#: What TensorFlow >= 2.19 writes to stderr at import whatever TF_CPP_MIN_LOG_LEVEL says
#: (tensorflow#100442): absl's notice that logging is not initialised, and oneDNN's INFO line,
#: once per shared library, from every rank.
_IMPORT_NOISE = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called "
                           r"are written to STDERR|I\d{4} [\d:. ]+\d+ port\.cc:\d+\] oneDNN custom "
                           r"operations are on")


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The first ``import tensorflow`` with TensorFlow's import-time INFO lines left out of
    stderr, when TF_CPP_MIN_LOG_LEVEL asks for no INFO (hvdtrain's default, 2). Everything else
    written to stderr meanwhile is written after the import, in order."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow":
            return None
        sys.meta_path.remove(self)  # once: the package's own imports find it as usual
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") in ("0", ""):
            self.loader.exec_module(module)
            return
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                self.loader.exec_module(module)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                kept = [line for line in captured.read().splitlines(keepends=True)
                        if not _IMPORT_NOISE.match(line.decode(errors="replace"))]
                if kept:
                    os.write(2, b"".join(kept))


if "tensorflow" not in sys.modules and not any(
        isinstance(finder, _QuietTensorFlowImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _QuietTensorFlowImport())

#: Keras 3 modules that ``import tensorflow`` loads (it imports all of ``keras``) and that no
#: hvdtrain job uses, each importing a heavy package when it is installed: the scikit-learn
#: wrappers import scikit-learn and scipy.stats (0.66 s of TensorFlow's 3.7 s import here), the
#: image-gallery plots matplotlib.pyplot (0.45 s). Every rank paid both before its first step.
_DEFERRED = frozenset({"keras.wrappers", "keras.visualization", "keras.src.visualization"})
#: What the import system and scans of ``sys.modules`` read of a module; reading it does not run
#: a deferred module. TensorFlow's autograph reads every loaded module's ``__file__`` each time it
#: converts a function, so ``importlib.util.LazyLoader``, which runs a module at any attribute
#: access, ran these at a job's first ``tf.function``.
_MODULE_METADATA = frozenset({"__name__", "__file__", "__cached__", "__spec__", "__loader__",
                              "__path__", "__package__", "__class__"})


class _DeferredModule(types.ModuleType):
    """A module whose code runs at its first use: any attribute but ``_MODULE_METADATA``."""

    def __getattribute__(self, name):
        if name in _MODULE_METADATA:
            return super().__getattribute__(name)
        self.__class__ = types.ModuleType  # once: from here on a plain module
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


class _DeferredImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import`` of a module in ``_DEFERRED`` gives a ``_DeferredModule``:
    ``keras.wrappers.SKLearnClassifier`` still works, and imports scikit-learn then. Keras only
    imports these modules by name (``from keras import wrappers``), which uses nothing inside."""

    def __init__(self):
        self.loaders = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _DEFERRED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            self.loaders[fullname], spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return None  # the default module, as the real (source) loader makes it

    def exec_module(self, module):
        # The real loader runs the module's code at its first use.
        module.__spec__.loader = module.__loader__ = self.loaders[module.__name__]
        module.__class__ = _DeferredModule


# Keras 2's ``keras`` is tf_keras under another name (``_KerasIsTfKeras``), which imports neither.
if KERAS == "3" and "keras" not in sys.modules and not any(
        isinstance(finder, _DeferredImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _DeferredImport())


class _WholeLines(io.TextIOWrapper):
    """A text stream that hands text to the OS when a write ends a line, and not before.

    Python's own line buffering is not enough: it flushes after any write that *contains* a
    newline, so ``print("a\\nb")`` (two writes: the text, then the newline) still reaches the
    OS as ``a\\nb`` and ``\\n``, and a launcher's tag can land between them.
    """

    def write(self, text: str) -> int:
        written = super().write(text)
        if text.endswith("\n"):
            self.flush()
        return written

    def close(self) -> None:
        """Flush only: the file is the interpreter's own stream's (``sys.__stdout__``)."""
        if not self.buffer.closed:
            self.flush()


def _whole_line_stream(stream: io.TextIOWrapper) -> io.TextIOWrapper:
    """``stream``'s file with writes gathered into whole lines (the stream itself stays usable)."""
    stream.flush()
    whole_lines = _WholeLines(stream.buffer, encoding=stream.encoding, errors=stream.errors,
                              newline="\n")
    whole_lines.replaced = stream  # kept alive: a collected stream closes the file it shares
    return whole_lines


def _write_whole_lines() -> None:
    """One write per line on stdout and stderr, so a launcher's tags start lines.

    horovodrun starts every rank with PYTHONUNBUFFERED=1, so a print reached mpirun as two
    writes, the text and then the newline, and mpirun's --tag-output prefixes each write: the
    next tag landed before the newline (``run dir: runs/cnn[1,0]<stdout>:``). Only the
    interpreter's own unbuffered streams are replaced: a stream someone else installed (pytest's
    capture) is theirs, and ``sys.__stdout__`` keeps the original.
    """
    if sys.stdout is sys.__stdout__ and getattr(sys.stdout, "write_through", False):
        sys.stdout = _whole_line_stream(sys.stdout)
    if sys.stderr is sys.__stderr__ and getattr(sys.stderr, "write_through", False):
        sys.stderr = _whole_line_stream(sys.stderr)


_write_whole_lines()
