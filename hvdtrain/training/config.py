"""Training configuration: typed dataclasses, named presets, command-line overrides.

``TrainConfig`` holds what every job shares, ``ImageConfig`` adds the image data hvdtrain reads, a
job's own subclass adds its own fields (``hvdtrain.cnn``'s ``--model``). The path is always the
same: a preset function (kept beside its job) builds the config, flags given on the command
line replace its fields, and ``__post_init__`` validates the result (``ValueError`` with a message a
user understands; the CLI turns it into a one-line error). The help text of every flag is the
docstring under its field (``hvdtrain.flags``), so the documentation cannot drift from the code.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import os
import posixpath
import re
import stat
import typing
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence

from hvdtrain.credentials import without_userinfo
from hvdtrain.data.source import DataSource
from hvdtrain.errors import UserError
from hvdtrain.flags import (OneLineParser, add_flag, base_type, field_docs, flag_name,
                            literal_choices, resolved_hints)
from hvdtrain.tracking import check_track

Backend = Literal["auto", "horovod", "tpu", "mirrored", "single"]
BatchPolicy = Literal["per-worker", "global"]
LrScaling = Literal["linear", "sqrt", "none"]
LrDecay = Literal["cosine", "constant", "step"]
OptimizerName = Literal["adam", "adamw", "sgd", "rmsprop"]
Precision = Literal["auto", "fp32", "mixed_float16", "mixed_bfloat16"]
JitCompile = Literal["auto", "on", "off"]
BadImagePolicy = Literal["skip", "fail"]
TfrecordSharding = Literal["file", "example"]
EmbeddedData = Literal["digits", "synthetic"]
KerasVersion = Literal["2", "3"]
CacheMode = Literal["auto", "memory", "disk", "off"]


@dataclass(frozen=True)
class CacheSetting:
    """--cache as the job uses it (hvdtrain.data.cache): the mode and, for 'disk:DIR', the
    directory. Read from the flag's text once, when the config is built; recorded and printed
    as that text (``str``)."""

    mode: CacheMode
    directory: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in typing.get_args(CacheMode) or (
                self.directory is not None and (self.mode != "disk" or not self.directory)):
            raise ValueError("--cache must be memory, disk, disk:DIR, off or auto, "
                             f"got {str(self)!r}")

    @classmethod
    def parse(cls, text: str) -> CacheSetting:
        """'memory'|'disk'|'disk:DIR'|'off'|'auto' -> the setting; ValueError otherwise."""
        mode, colon, directory = text.partition(":")
        return cls(mode, directory if colon else None)

    def __str__(self) -> str:
        return self.mode if self.directory is None else f"{self.mode}:{self.directory}"


def selected_keras() -> str:
    """The Keras hvdtrain selected when it was imported (``hvdtrain.KERAS``)."""
    from hvdtrain import KERAS

    return KERAS


@dataclass(kw_only=True)
class TrainConfig:
    """What every job shares: batch and learning-rate scaling, training, outputs.

    Each field is a command-line flag (its docstring is the help). Jobs with more to configure
    subclass it (``ImageConfig`` for the image data hvdtrain reads; your own fields in a
    kw_only dataclass subclass become flags too).
    """

    # --- batch and learning-rate scaling --------------------------------------------------------
    batch_size: int = 32
    """Samples per batch: per worker with --batch-policy per-worker, for the whole job with
    --batch-policy global. The learning rate below is the one tuned for this batch size."""
    batch_policy: BatchPolicy = "per-worker"
    """'per-worker': every worker takes --batch-size samples, so the global batch grows with the
    number of workers (weak scaling). 'global': the global batch stays --batch-size and is split
    across workers (must divide evenly)."""
    learning_rate: float = 1e-3
    """Base learning rate, tuned for one worker at --batch-size."""
    lr_scaling: LrScaling = "linear"
    """How the learning rate follows the samples per optimizer update, relative to --batch-size:
    'linear' (Goyal et al. 2017), 'sqrt' (Krizhevsky 2014; gentler for adaptive optimizers) or
    'none'."""
    warmup_epochs: float = 1.0
    """Epochs over which the learning rate ramps linearly from the base to the scaled value
    (Goyal et al.: large scaled rates diverge without it). 0 disables warm-up."""
    lr_decay: LrDecay = "cosine"
    """After warm-up: 'cosine' decays to zero by the last epoch, 'constant' keeps the scaled rate,
    'step' multiplies it by --lr-gamma at each of --lr-milestones."""
    lr_milestones: str | None = None
    """With --lr-decay step: the epochs at which the rate is multiplied by --lr-gamma, comma
    separated and increasing (30,60,80: the ResNet recipe's). In epochs, so a resume on another
    world size keeps them where they were."""
    lr_gamma: float = 0.1
    """With --lr-decay step: the factor the rate is multiplied by at each milestone."""
    grad_accum_steps: int = 1
    """Backward passes accumulated per optimizer update (horovod backward_passes_per_step): the
    update sees batch x workers x this many samples while memory holds one batch."""

    # --- optimizer ------------------------------------------------------------------------------
    optimizer: OptimizerName = "adam"
    """The optimizer horovod wraps (each rank's gradients are averaged before it sees them):
    'adam', 'adamw' (Adam with decoupled weight decay), 'sgd' or 'rmsprop', Keras' own."""
    momentum: float | None = None
    """Momentum of 'sgd' (default 0.9) and 'rmsprop' (default 0); Adam's is its beta_1."""
    nesterov: bool = False
    """Nesterov momentum, for 'sgd'."""
    weight_decay: float | None = None
    """Decoupled weight decay (Keras': each step every decayed weight shrinks by learning rate x
    this), for 'adamw' (default 0.004, Keras'), 'sgd' and 'rmsprop' (default 0). Biases and
    normalization weights (every weight of fewer than 2 dimensions) are left undecayed, as
    published recipes do; --decay-all-weights decays them too. Adam with decay is 'adamw'."""
    decay_all_weights: bool = False
    """Decay biases and normalization weights too (see --weight-decay)."""
    clipnorm: float | None = None
    """Clip each weight's gradient to this L2 norm, after the ranks' average (so every rank
    clips alike)."""
    global_clipnorm: float | None = None
    """Clip the gradients of all weights together to this L2 norm (a transformer fine-tune's
    1.0), after the ranks' average (so every rank clips alike)."""
    # --- training -------------------------------------------------------------------------------
    epochs: int = 12
    """Total number of epochs (a resumed run continues up to this number)."""
    steps_per_epoch: int | None = None
    """Batches per worker per epoch. Default: the training set divided by the global batch, the
    same on every rank so that uneven shards never leave a rank waiting."""
    early_stopping: int | None = None
    """Stop when the validation loss (the training loss without validation) has not improved for
    this many epochs (Keras' EarlyStopping, on the metrics averaged over the ranks, so every rank
    stops at the same epoch); the run ends with its checkpoint and model and says why."""
    seed: int = 42
    """Seed for the train/validation split, the file order shared by all ranks, and model init."""
    precision: Precision = "auto"
    """Keras mixed-precision policy: 'auto' is mixed_bfloat16 on TPU and fp32 elsewhere.
    mixed_float16 (GPUs with tensor cores) adds dynamic loss scaling."""
    fp16_allreduce: bool = False
    """Compress gradients to float16 for the allreduce (horovod Compression.fp16): half the
    network traffic, slightly less precise averages."""
    steps_per_execution: int | None = None
    """Batches run per call into the compiled train function (Keras steps_per_execution). Default:
    32 on TPU, 1 elsewhere."""
    jit_compile: JitCompile = "auto"
    """Compile the training step with XLA. 'auto' is Keras' own choice: on where TensorFlow lists
    a GPU (Keras 3; tf_keras compiles the optimizer's update only), off on CPU. Under horovod the
    forward and backward pass and the update are compiled and the gradients' average runs
    between them, outside XLA (its ops have no XLA kernel). 'on' on Keras 3 only."""
    keras: KerasVersion = dataclasses.field(default_factory=selected_keras)
    """The Keras the job runs on: '2' (tf_keras, with horovod's Keras API) or '3' (TensorFlow's
    Keras 3, with hvdtrain's own integration on horovod's collectives). Chosen when hvdtrain is
    imported, from this flag or HVDTRAIN_KERAS, else what `import keras` gives (3; 2 under
    TF_USE_LEGACY_KERAS=1); Keras 3 runs on the horovod and single backends."""
    backend: Backend = "auto"
    """'auto' picks a TPU when one is reachable, horovod when launched by horovodrun/mpirun/srun,
    else 'single'. 'mirrored' is tf.distribute.MirroredStrategy over this host's GPUs."""
    threads_per_worker: int | None = None
    """TensorFlow intra-op threads per rank on CPU. Default: this node's cores divided by the
    ranks on it (at least 1), so N ranks never oversubscribe the CPU."""
    bn_recompute_batches: int = 20
    """With several ranks: training batches per rank over which batch-norm statistics are
    recomputed from the current weights at the end of every epoch, before validation and the
    checkpoint (data parallelism divides the steps per epoch, so Keras' moving averages lag the
    weights). 0 keeps Keras' moving averages. Costs that many forward passes per epoch."""
    signal_check_every_steps: int = 10
    """How often (in batches) the ranks agree whether a preemption signal arrived. Each check is
    one tiny allreduce; a signal is acted on within this many batches."""
    progress_seconds: float = 30.0
    """Rank 0 prints a progress line (step, samples/s, loss, time left in the epoch) this often
    within an epoch, so a long epoch shows it is alive in a Slurm log. 0 turns it off."""

    # --- outputs --------------------------------------------------------------------------------
    run_dir: str = "runs/train"
    """Where rank 0 writes checkpoints, metrics, plots and the final model. A run directory that
    already holds a checkpoint is resumed. It belongs to one experiment: its config.json records
    the data (its classes and sample count; not where it sits, so a copy staged elsewhere
    resumes, nor whether a folder or the TFRecords converted from it), the split (seed and
    validation fraction), which file has which label, the image shape and the model, and a run
    with other ones is refused (epochs, batch size, learning rate and the number of workers may
    change; --accept-experiment-change goes on anyway). Default: the preset's, followed for
    --data-dir or --tfrecords by the data's name and a hash of its full path
    (runs/cnn-tiny-pets-1a2b3c), for --data synthetic by -synthetic."""
    accept_experiment_change: bool = False
    """Resume a run directory's checkpoint although what it trains changed (the data, the split,
    the labels, the model): the resume line names what changed, and the run directory records
    the new experiment."""
    rank_logs: bool = True
    """Every rank also copies its output into <run_dir>/logs/rank-K.log (from the moment the run
    directory is checked and locked), so a failure on another node can be read afterwards."""
    keep_checkpoints: int = 3
    """Number of most recent checkpoints kept (those written within epochs count too)."""
    checkpoint_every_steps: int | None = None
    """Rank 0 also writes a checkpoint every this many steps within an epoch (an epoch of
    ImageNet is an hour: a crash then costs at most these steps, not the epoch). A run resumed
    from one continues at the next step of that epoch, with the data where it stopped (hvdtrain's
    image data; a job's own datasets restart the epoch)."""
    checkpoint_every_minutes: float | None = None
    """Rank 0 also writes a checkpoint within an epoch when this many minutes passed since the
    last one (rank 0's clock: only rank 0 writes, the others wait for it at the next step)."""
    tensorboard: bool = True
    """Write TensorBoard logs (rank 0 only) under <run_dir>/tensorboard."""
    profile_steps: str | None = None
    """FIRST:LAST: rank 0 writes a TensorFlow profile of these steps of the run (counted from 1
    in each run, a resumed one too) into <run_dir>/tensorboard (the TensorBoard profiler: open
    its Profile tab; needs tensorboard-plugin-profile to view, not to write). Every epoch's row
    in metrics.json says how long the steps waited for their batches either way."""
    export: bool = True
    """Save the trained model (without optimizer state) as <run_dir>/model.keras at the end."""
    track: str = "off"
    """Mirror the run into an experiment tracker from rank 0: off, mlflow or jsonl:PATH.
    'mlflow': the config and the plan (world size, global batch, scaled learning rate) as
    parameters, every epoch's metrics with the epoch as step, the outputs (config, metrics,
    curves, model) as artifacts; one MLflow run per run directory across resume and requeue (its
    id in <run_dir>/tracking.json). Needs MLflow's client: `pip install mlflow-skinny` (`make
    install`'s venv has it). 'jsonl:PATH': one JSON object per line appended to the local file
    PATH (your own plain file, created when missing; never a symbolic link): the run's start with
    its parameters, each checkpointed epoch's metrics, its end with its status."""
    tracking_uri: str | None = None
    """The MLflow tracking server (http://host:5000, databricks, ...). Default:
    MLFLOW_TRACKING_URI, else MLflow's own default. Give a user and password in
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD: a user:password@ in the URI is moved
    there and never printed or recorded, but a command line is visible to every user of the
    node."""
    experiment: str | None = None
    """The MLflow experiment the run goes into (created when missing). Default:
    MLFLOW_EXPERIMENT_NAME, else the job's name."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            allowed = literal_choices(type(self), field)
            value = getattr(self, field.name)
            if allowed and value not in allowed:
                raise ValueError(f"{flag_name(field.name)} must be one of {', '.join(allowed)}, "
                                 f"got {value!r}")
        positive = ["batch_size", "epochs", "grad_accum_steps", "keep_checkpoints",
                    "signal_check_every_steps"]
        optional_positive = ["steps_per_epoch", "steps_per_execution", "threads_per_worker",
                             "checkpoint_every_steps"]
        _check_at_least_one(self, positive, optional_positive)
        if self.bn_recompute_batches < 0:
            raise ValueError(f"--bn-recompute-batches must be >= 0, got "
                             f"{self.bn_recompute_batches}")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.progress_seconds < 0:
            raise ValueError(f"--progress-seconds must be >= 0, got {self.progress_seconds}")
        if self.warmup_epochs < 0:
            raise ValueError(f"--warmup-epochs must be >= 0, got {self.warmup_epochs}")
        self.milestone_epochs()  # --lr-milestones' own checks
        self.profile_step_range()
        if self.checkpoint_every_minutes is not None and self.checkpoint_every_minutes <= 0:
            raise ValueError(f"--checkpoint-every-minutes must be positive, got "
                             f"{self.checkpoint_every_minutes}")
        if self.grad_accum_steps > 1 and (self.checkpoint_every_steps
                                          or self.checkpoint_every_minutes):
            raise ValueError("--checkpoint-every-steps/--checkpoint-every-minutes with "
                             "--grad-accum-steps above 1: a checkpoint inside an accumulation "
                             "would lose its partial gradient sums; checkpoint at epochs")
        if self.lr_gamma <= 0:
            raise ValueError(f"--lr-gamma must be positive, got {self.lr_gamma}")
        _check_optimizer(self)
        if not self.run_dir:
            raise ValueError("--run-dir must not be empty")
        check_track(self.track)
        if self.seed < 0:  # numpy's and TensorFlow's seeds are unsigned
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        # After the checks that say more (--epochs -3000000000: "at least 1").
        for field in dataclasses.fields(self):
            if not (isinstance(field.default, float) and not math.isfinite(field.default)):
                _check_number(field.name, getattr(self, field.name))  # (inf by default: inf ok)

    def profile_step_range(self) -> tuple[int, int] | None:
        """--profile-steps as (first, last), or None; ValueError (one line) when malformed."""
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition(":")
        try:
            steps = (int(first), int(last or first))
        except ValueError:
            raise ValueError(f"--profile-steps must be FIRST:LAST steps of the run (10:20), "
                             f"got {self.profile_steps!r}") from None
        if not 1 <= steps[0] <= steps[1]:
            raise ValueError(f"--profile-steps must be FIRST:LAST with 1 <= FIRST <= LAST, got "
                             f"{self.profile_steps!r}")
        return steps

    def milestone_epochs(self) -> tuple[float, ...]:
        """--lr-milestones as epochs (ValueError, one line, when they do not go with
        --lr-decay)."""
        if self.lr_decay != "step":
            if self.lr_milestones:
                raise ValueError(f"--lr-milestones are for --lr-decay step, not "
                                 f"{self.lr_decay}")
            return ()
        if not self.lr_milestones:
            raise ValueError("--lr-decay step needs --lr-milestones, the epochs at which the "
                             "rate drops (e.g. 30,60,80)")
        try:
            epochs = tuple(float(part) for part in self.lr_milestones.split(","))
        except ValueError:
            raise ValueError(f"--lr-milestones must be epochs separated by commas (30,60,80), "
                             f"got {self.lr_milestones!r}") from None
        if any(not math.isfinite(epoch) or epoch <= 0 for epoch in epochs) \
                or list(epochs) != sorted(set(epochs)):
            raise ValueError(f"--lr-milestones must be positive epochs in increasing order, "
                             f"got {self.lr_milestones!r}")
        return epochs

    def default_run_dir(self) -> str:
        """The run directory when --run-dir is not given (see its help)."""
        return self.run_dir

    def to_dict(self) -> dict:
        """The config as recorded (config.json, the tracker's parameters), each value as its
        flag is written (--cache's setting as its text): a URL's user-info, such as a tracking
        server's password, is left out (hvdtrain.credentials)."""
        recorded = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            value = str(value) if dataclasses.is_dataclass(value) else value
            recorded[field.name] = without_userinfo(value) if isinstance(value, str) else value
        return recorded


@dataclass(kw_only=True)
class ImageConfig(TrainConfig):
    """A job on the image data hvdtrain reads itself: embedded digits, an image folder, TFRecords."""

    data: EmbeddedData = "digits"
    """Embedded data used when neither --data-dir nor --tfrecords is given: 'digits' (scikit-learn's
    1797 8x8 handwritten digits, shipped with scikit-learn, no download) or 'synthetic' (random
    images and labels, for measuring speed without an input pipeline)."""
    data_dir: str | None = None
    """Image folder with one sub-folder per class (PNG, JPEG, GIF or BMP files of any size)."""
    tfrecords: str | None = None
    """Directory of TFRecord shards written by `python -m hvdtrain.tfrecords` (train-*.tfrecord,
    validation-*.tfrecord, dataset.json) or a glob of shards holding `image` (encoded PNG/JPEG
    bytes) and `label` (int64)."""
    tfrecord_sharding: TfrecordSharding = "file"
    """How TFRecords are split across ranks: 'file' (each rank reads whole shards; needs at least
    as many shards as ranks) or 'example' (every rank reads every shard, keeps every N-th record)."""
    image_size: int | None = None
    """Side length in pixels images are resized to. Default: native size for embedded data, 64 for
    image files."""
    channels: int | None = None
    """Colour channels images from files are decoded to: 1 (grayscale) or 3 (RGB). Default: 3
    for image folders, what dataset.json says for TFRecords."""
    synthetic_samples: int = 1797
    """Number of samples in the synthetic data set (same as digits by default)."""
    validation_fraction: float = 0.2
    """Fraction of the samples held out for validation: from an image folder, embedded data, or
    TFRecords without validation-* shards (whole shards when there are enough, else records).
    0 keeps none."""
    on_bad_image: BadImagePolicy = "skip"
    """What to do with files in an image folder that are not images: 'skip' (and report how many)
    or 'fail'."""
    check_images: bool = False
    """Open every file of an image folder while listing to check its header (in parallel). Off by
    default: files with an image extension are trusted and a bad one is found, skipped and counted
    when decoded; on a shared file system each open costs a metadata round trip."""
    augment: bool = False
    """Train on random-resized crops (8-100% of the area, aspect 3/4 to 4/3) flipped at random,
    new for every sample on every rank in every epoch, and validate on center crops; images are
    then stored at image-size / 0.875 to crop from. For photos (image folders, TFRecords). Off by
    default: flips and crops change what a class looks like for digits, text or anything with a
    left and a right, so they are a choice about your data, as in Keras."""
    cache: CacheSetting = CacheSetting("auto")
    """Where decoded images are kept after the first epoch: 'memory', 'disk' (node-local
    $TMPDIR), 'disk:DIR', 'off', or 'auto': memory when every local rank's decoded share fits
    --cache-budget-gb, else local disk when it has room, else off."""
    cache_budget_gb: float | None = None
    """Memory (GB) per node that in-memory caching may use, shared by the node's ranks. Default:
    half of the job's memory on the node at start: the least of Slurm's --mem (or --mem-per-cpu
    x CPUs, --mem-per-gpu x GPUs), the memory cgroup and the node's available memory."""


    def __post_init__(self) -> None:
        super().__post_init__()
        source = self.source  # its own checks: one source
        _check_at_least_one(self, ["synthetic_samples"], ["image_size"])
        if self.channels not in (None, 1, 3):
            raise ValueError(f"--channels must be 1 or 3, got {self.channels}")
        if isinstance(self.cache, str):  # a flag's or a --config file's text
            self.cache = CacheSetting.parse(self.cache)
        if self.augment and not source.from_files:
            raise ValueError("--augment is for images read from files (--data-dir or "
                             "--tfrecords), not the embedded data")
        if self.cache_budget_gb is not None and self.cache_budget_gb < 0:
            raise ValueError(f"--cache-budget-gb must be >= 0, got {self.cache_budget_gb}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError("--validation-fraction must be in [0, 1), "
                             f"got {self.validation_fraction}")

    @property
    def source(self) -> DataSource:
        """The data the flags name, as one typed value (hvdtrain/data/source.py)."""
        return DataSource.from_flags(self.data_dir, self.tfrecords, self.data)

    def default_run_dir(self) -> str:
        source = self.source
        if source.from_files:
            described = source.described()
            # The data's own name to read, a hash of its full path to tell two of that name apart.
            name = re.sub(r"[^\w.-]+", "_", posixpath.basename(described.rstrip("/"))).strip("._")
            digest = hashlib.sha256(described.encode()).hexdigest()[:6]
            return f"{self.run_dir}-{name or 'data'}-{digest}"
        return f"{self.run_dir}-synthetic" if self.data == "synthetic" else self.run_dir


def _check_optimizer(config: TrainConfig) -> None:
    """The optimizer flags that mean nothing for the chosen optimizer are refused, not ignored."""
    name = config.optimizer
    if config.momentum is not None and name not in ("sgd", "rmsprop"):
        raise ValueError(f"--momentum is for --optimizer sgd or rmsprop; {name}'s momentum is "
                         "its beta_1")
    if config.momentum is not None and not 0 <= config.momentum < 1:
        raise ValueError(f"--momentum must be in [0, 1), got {config.momentum}")
    if config.nesterov and name != "sgd":
        raise ValueError(f"--nesterov is for --optimizer sgd, not {name}")
    if config.weight_decay is not None:
        if name == "adam" and config.weight_decay:
            raise ValueError("Adam with decoupled weight decay is AdamW: pass --optimizer adamw")
        if config.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {config.weight_decay}")
    if config.clipnorm is not None and config.global_clipnorm is not None:
        raise ValueError("give --clipnorm (each weight's gradient) or --global-clipnorm (all "
                         "of them together), not both")
    for flag, value in (("--clipnorm", config.clipnorm),
                        ("--global-clipnorm", config.global_clipnorm)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if config.early_stopping is not None and config.early_stopping < 1:
        raise ValueError(f"--early-stopping must be at least 1 epoch, got "
                         f"{config.early_stopping}")


LARGEST_INT = 2**31 - 1
"""No count, size or seed a job takes is larger; TensorFlow's int32 arguments are not."""


def _check_number(name: str, value) -> None:
    """A float flag must be finite (nan and inf pass every comparison check: a learning rate
    of nan trained to a loss of nan and exited 0); an int one must fit TensorFlow's int32."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{flag_name(name)} must be a finite number, got {value}")
    if isinstance(value, int) and not isinstance(value, bool):
        if value > LARGEST_INT:
            raise ValueError(f"{flag_name(name)} must be at most {LARGEST_INT}, got {value}")
        if value < -LARGEST_INT:
            raise ValueError(f"{flag_name(name)} must be at least {-LARGEST_INT}, got {value}")


def _check_at_least_one(config: TrainConfig, always: list[str], when_set: list[str]) -> None:
    for name in always + [n for n in when_set if getattr(config, n) is not None]:
        if getattr(config, name) < 1:
            raise ValueError(f"{flag_name(name)} must be at least 1, got {getattr(config, name)}")


# --- command line ---------------------------------------------------------------------------------
def parse_config(argv: Sequence[str] | None, presets: Mapping[str, Callable[[], TrainConfig]],
                 *, prog: str, description: str) -> TrainConfig:
    """Preset named by --preset (default 'default'), then every flag given, validated.

    The flags are the fields of the presets' config class (a TrainConfig or a subclass)."""
    preset_parser = OneLineParser(add_help=False)
    preset_parser.add_argument("--preset", default="default", choices=sorted(presets))
    preset_parser.add_argument("--config")
    preset_parser.add_argument("--run-dir")  # given or not: the default depends on the data
    known, _ = preset_parser.parse_known_args(argv)
    base = presets[known.preset]()
    config_class = type(base)
    from_file = {}
    if known.config:
        try:
            from_file = read_config_file(known.config, config_class)
            base = dataclasses.replace(base, **from_file)
        except ValueError as error:
            raise UserError(f"--config {known.config}: {error}") from None

    parser = OneLineParser(prog=prog, description=description,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="default", choices=sorted(presets),
                        help="Named starting configuration; the flags below override it. "
                             + " ".join(describe_preset(name, make, presets["default"])
                                        for name, make in presets.items()))
    parser.add_argument("--config", metavar="FILE",
                        help="Start from this JSON file, over the preset: a run directory's "
                             "config.json (replays that run; give --run-dir for a new one) or "
                             "what --print-config prints. The flags given win over it.")
    parser.add_argument("--print-config", action="store_true",
                        help="Print the resolved configuration as JSON (what --config reads) "
                             "and exit without training.")
    docs = {name: doc for klass in reversed(config_class.__mro__)
            if dataclasses.is_dataclass(klass) for name, doc in field_docs(klass).items()}
    for field in dataclasses.fields(config_class):
        add_flag(parser, config_class, field, getattr(base, field.name),
                 docs.get(field.name, ""))
    args = vars(parser.parse_args(argv))
    del args["preset"], args["config"]
    print_config = args.pop("print_config")
    try:
        config = dataclasses.replace(base, **args)
    except ValueError as error:
        raise UserError(str(error)) from None
    if known.run_dir is None and "run_dir" not in from_file:
        config = dataclasses.replace(config, run_dir=config.default_run_dir())
    if print_config:  # like --help: an answer, not a job
        print(json.dumps(config.to_dict(), indent=2))
        raise SystemExit(0)
    return config


#: The largest --config file read: a run directory's config.json is a few KB.
CONFIG_FILE_LIMIT = 2**20


def read_config_file(path: str, config_class: type) -> dict:
    """The fields a --config file sets, checked against ``config_class``'s flags (ValueError,
    one line): an object of field names (or flag names) to values, or a run directory's
    config.json, whose "config" is that object."""
    try:
        # Not blocking: a FIFO there would wait for a writer forever; a device would never end.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(descriptor, "rb") as file:
            found = os.fstat(file.fileno())
            if not stat.S_ISREG(found.st_mode):
                raise ValueError("is not a regular file (a directory, a device or a pipe): "
                                 "name a JSON file")
            if found.st_size > CONFIG_FILE_LIMIT:
                raise ValueError(f"is {found.st_size} bytes; a config is a few KB (at most "
                                 f"{CONFIG_FILE_LIMIT // 2**20} MiB): is it the right file?")
            recorded = json.loads(file.read(CONFIG_FILE_LIMIT + 1))
    except OSError as error:
        raise ValueError(error.strerror or str(error)) from None
    except UnicodeDecodeError:
        raise ValueError("is not text (not UTF-8): name a JSON file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at line {error.lineno} column {error.colno})") \
            from None
    if isinstance(recorded, dict) and isinstance(recorded.get("config"), dict):
        recorded = recorded["config"]  # config.json: {"program": ..., "config": {...}, ...}
    if not isinstance(recorded, dict):
        raise ValueError(f"holds a JSON {type(recorded).__name__}, not an object of flags")
    fields = {field.name: field for field in dataclasses.fields(config_class)}
    values = {}
    for key, value in recorded.items():
        name = key.lstrip("-").replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            raise ValueError(f"no flag {flag_name(name)}"
                             + (f"; did you mean {flag_name(close[0])}?" if close else ""))
        values[name] = _config_value(config_class, fields[name], value)
    return values


def _config_value(config_class: type, field: dataclasses.Field, value):
    """A --config file's value for ``field``, as its flag would give it, or ValueError."""
    hint = resolved_hints(config_class)[field.name]
    kind, choices = base_type(config_class, field), literal_choices(config_class, field)
    if value is None and (type(None) in typing.get_args(hint) or field.default is None):
        return None
    if choices and str(value) in choices and not isinstance(value, bool):
        return str(value)
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind not in (int, float, bool) and isinstance(value, str) and not choices:
        return value  # also a type of the config's own (--cache's): the config parses the text
    wanted = (f"one of {', '.join(choices)}" if choices else
              {int: "an integer", float: "a number", bool: "true or false"}.get(kind, "a string"))
    raise ValueError(f"{flag_name(field.name)} must be {wanted}, got {json.dumps(value)}")


def describe_preset(name: str, make: Callable[[], TrainConfig],
                    default: Callable[[], TrainConfig]) -> str:
    """'tiny: its docstring's first sentence (--epochs 3, ...)': what --help says a preset is
    and sets (the flags where it differs from the default preset; the default's own values are
    each flag's shown default)."""
    config, base = make(), default()
    differs = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value != getattr(base, field.name):
            flag = flag_name(field.name)
            differs.append((flag if value else f"--no-{flag[2:]}") if isinstance(value, bool)
                           else f"{flag} {value}")
    summary = (make.__doc__ or "").strip().split(". ")[0].rstrip(".")
    described = (f"{name}" + (f": {summary}" if summary else "")
                 + (f" ({', '.join(differs)})" if differs else "") + ".")
    return described.replace("%", "%%")  # argparse formats help strings with %
