#!/usr/bin/env bash
# Set up everything hvdtrain needs on a Debian machine that has only Python 3.11:
#   1. system parts (OpenMPI, cmake, g++, make, Python's venv module) via apt-get when root, else
#      one line naming the apt-get command;
#   2. the venv with the pinned stack (docs/install.md, scripts/constraints/tf-X.Y.txt);
#   3. horovod 0.28.1 from its PyPI sdist plus hvdtrain's patches (scripts/horovod-patches, which
#      make it build on TensorFlow >= 2.19), compiled against that exact TensorFlow and cached as
#      a wheel so that the next install (or a new venv on this machine) reuses it in seconds;
#   4. a check that horovod has TensorFlow, MPI and Gloo and that `import hvdtrain` works, then the
#      stamp file `make` compares against.
# Idempotent: run it as often as you like (`make install` does). It needs no `make`, so on a bare
# machine `bash scripts/install.sh` is the first command.
#
# Environment knobs:
#   HVDTRAIN_VENV         where the venv goes (default: .venv in the repository; `make` passes its
#                         VENV here)
#   HVDTRAIN_TF_VERSION   the TensorFlow to install and build horovod against: 2.21.0 (default),
#                         2.20.0, 2.19.1 or 2.18.1 (each has its constraints file)
#   HVDTRAIN_TF_FLAVOR    cpu or gpu; unset: gpu on a machine with an NVIDIA GPU (nvidia-smi
#                         answers, or /dev/nvidia0 exists), else cpu. gpu installs
#                         tensorflow[and-cuda] and builds horovod with NCCL: with the machine's
#                         CUDA 12 toolkit and NCCL when it has them, else with PyPI's CUDA wheels
#                         (scripts/gpu_toolchain.py)
#   HVDTRAIN_INSTALL_PLAN 1: print what would be installed (flavor and why, TensorFlow, the
#                         horovod wheel's cache key) and stop before changing anything
#   HVDTRAIN_WHEEL_CACHE  where compiled horovod wheels are kept (default ~/.cache/hvdtrain/wheels)
#   PYTHON                the interpreter to build the venv from (default: python3.11)
#   HVDTRAIN_STACK        pinned (default: all of the above) or existing: on a stack someone else
#                         built (an NGC TensorFlow image, a site's modules), install hvdtrain alone
#                         into PYTHON's environment (default: python3); when that stack has
#                         TensorFlow but no horovod, build the patched horovod against it (or say
#                         in one line which build tool is missing); then check the stack with
#                         `python -m hvdtrain.stack`. No venv, no apt-get
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVDTRAIN_VENV:-$repo_root/.venv}
wheel_cache=${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/wheels}
python=${PYTHON:-python3.11}
# Written last, so it exists only after a complete install; the Makefile's VENV/.hvdtrain-installed.
stamp=$venv/.hvdtrain-installed

TF_VERSION=${HVDTRAIN_TF_VERSION:-2.21.0}
HOROVOD_VERSION=0.28.1
patches_dir=$repo_root/scripts/horovod-patches

say() { printf '[install] %s\n' "$*"; }
# Temporary directories (horovod's build, the CUDA assembled from wheels), removed however we exit.
cleanup=()
trap 'rm -rf "${cleanup[@]}"' EXIT
die() { printf 'install: %s\n' "$*" >&2; exit 1; }

# setuptools announces every editable install with an 11-line "BuildBackendWarning: Editable
# installation." block (folders named like the package may shadow it: not a problem of this
# checkout); it would be most of what the README's first command prints.
quiet_editable="ignore:Editable installation"

stack=${HVDTRAIN_STACK:-pinned}
[[ $stack == pinned || $stack == existing ]] \
  || die "HVDTRAIN_STACK must be pinned or existing, got '$stack'"

# horovod's sdist plus our patches, compiled against PYTHON's TensorFlow into WHEEL_DIR (the cache),
# unless a wheel is there already: build_horovod PYTHON FLAVOR WHEEL_DIR DESCRIPTION [VAR=VALUE...]
build_horovod() {
  local build_python=$1 build_flavor=$2 wheel_dir=$3 against=$4
  shift 4
  if compgen -G "$wheel_dir/horovod-*.whl" >/dev/null; then
    say "reusing cached horovod wheel from $wheel_dir"
    return
  fi
  say "compiling horovod $HOROVOD_VERSION (+${#patches[@]} patches) against $against (takes ~4 minutes on 2 cores)"
  build_dir=$(mktemp -d)
  cleanup+=("$build_dir")
  # horovod's own sdist, then our patches in order (each says what and why in its header).
  "$build_python" -m pip --disable-pip-version-check --quiet download --no-deps --no-binary :all: \
      -d "$build_dir" "horovod==$HOROVOD_VERSION" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2) \
    || die "could not download horovod $HOROVOD_VERSION's source from PyPI"
  tar -xzf "$build_dir/horovod-$HOROVOD_VERSION.tar.gz" -C "$build_dir"
  local source_dir=$build_dir/horovod-$HOROVOD_VERSION patch_file
  for patch_file in "${patches[@]}"; do
    patch -d "$source_dir" -p1 --batch --forward --quiet <"$patch_file" \
      || die "horovod $HOROVOD_VERSION's source does not take ${patch_file#"$repo_root"/}"
  done
  # Build isolation off: horovod must compile against this TensorFlow, not a fresh one.
  # PyTorch/MXNet off: we only need the TensorFlow ops; MPI + Gloo controllers both on.
  local build_env=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
                   HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)")
  if [[ $build_flavor == gpu ]]; then
    build_env+=(HOROVOD_GPU_OPERATIONS=NCCL "$@")
  fi
  env "${build_env[@]}" "$build_python" -m pip --disable-pip-version-check wheel \
      --no-build-isolation --no-deps --no-cache-dir -w "$build_dir" "$source_dir" \
      >"$build_dir/build.log" 2>&1 \
    || { kept_log=$(mktemp "${TMPDIR:-/tmp}/hvdtrain-horovod-build.XXXXXX")
         cp "$build_dir/build.log" "$kept_log"
         grep -E -m 20 "CMake Error|error:" "$build_dir/build.log" >&2 || tail -n 40 "$build_dir/build.log" >&2
         die "horovod build failed (above: its first errors; the whole log: $kept_log)"; }
  # What the GPU build needs of a node (its CUDA release, its compute capabilities), kept with
  # the wheel and installed beside horovod's extension: the launcher's preflight reads it.
  if [[ $build_flavor == gpu ]]; then
    "$build_python" "$repo_root/scripts/gpu_toolchain.py" --record "$build_dir/gpu-build.json" "$@" \
      || die "could not record what horovod's GPU build needs"
  fi
  # Publish atomically: a crash mid-build never leaves a half-written wheel in the cache.
  mkdir -p "$wheel_cache"
  local staging
  staging=$(mktemp -d "$wheel_cache/.staging.XXXXXX")
  cp "$build_dir"/horovod-*.whl "$staging/"
  [[ -f $build_dir/gpu-build.json ]] && cp "$build_dir/gpu-build.json" "$staging/"
  rm -rf "$wheel_dir"
  mv "$staging" "$wheel_dir"
}

# What a GPU build needs of a node (build_horovod's gpu-build.json), beside the installed horovod's
# TensorFlow extension, or nothing for a CPU build: not one of the wheel's files, so pip leaves an
# earlier flavor's behind; replaced here. install_gpu_record PYTHON WHEEL_DIR
install_gpu_record() {
  local tf_dir
  tf_dir=$("$1" -c 'import importlib.util, os
print(os.path.join(importlib.util.find_spec("horovod").submodule_search_locations[0], "tensorflow"))') \
    || die "cannot find the horovod $1 installed"
  rm -f "$tf_dir/hvdtrain-gpu-build.json"
  if [[ -f $2/gpu-build.json ]]; then
    cp "$2/gpu-build.json" "$tf_dir/hvdtrain-gpu-build.json"
  fi
}

# horovod's wheel is only valid for the exact TensorFlow build it was compiled against and the
# patches it was compiled with: both are in its cache key.
patches=("$patches_dir"/*.patch)
patches_hash=$(cat "${patches[@]}" | sha256sum | cut -c1-12)
horovod_key() {  # horovod_key PYTHON TF_DISTRIBUTION TF_VERSION FLAVOR
  local tag
  tag=$("$1" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null || echo py)
  echo "horovod-${HOROVOD_VERSION}-patches-${patches_hash}_$2-$3_${tag}_$4_$(uname -m)"
}

# The GPU flavor where this machine has an NVIDIA GPU: gpu_here, and why in gpu_reason.
gpu_here() {
  if [[ -e /dev/nvidia0 ]]; then
    gpu_reason="/dev/nvidia0 exists"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu_reason="nvidia-smi lists a GPU"
  else
    gpu_reason="no NVIDIA GPU here"
    return 1
  fi
}

if [[ $stack == existing ]]; then
  # hvdtrain without its dependencies (they would have pip replace pieces of the stack); horovod,
  # when the stack has none, patched and compiled against the stack's own TensorFlow. The check
  # then names what is still missing, one line each (exit 2).
  python=${PYTHON:-python3}
  command -v "$python" >/dev/null 2>&1 || die "$python not found (set PYTHON=... to the stack's Python)"
  say "installing hvdtrain alone into $("$python" -c 'import sys; print(sys.prefix)') (HVDTRAIN_STACK=existing)"
  PYTHONWARNINGS=$quiet_editable "$python" -m pip --disable-pip-version-check --quiet install \
      --no-deps -e "$repo_root" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2) \
    || die "pip could not install hvdtrain into $python's environment"
  # Which TensorFlow distribution and version, from its metadata: importing it takes seconds.
  read -r stack_tf stack_tf_version < <("$python" - <<'PY'
import importlib.metadata as m, importlib.util as u
if u.find_spec("horovod") is None:
    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu"):
        try:
            print(name, m.version(name)); break
        except m.PackageNotFoundError:
            pass
PY
  ) || true
  if [[ -n ${stack_tf:-} ]]; then
    # The stack's wheel decides the flavor: tensorflow-cpu has no CUDA; plain tensorflow gets
    # NCCL where this machine has a GPU.
    stack_flavor=cpu
    [[ $stack_tf != tensorflow-cpu ]] && gpu_here && stack_flavor=gpu
    missing=()
    for tool in mpicc cmake g++ make patch; do
      command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) || die "this stack has $stack_tf $stack_tf_version and no horovod; building it here needs ${missing[*]} (MPI's compiler wrapper and headers, cmake, a C++ compiler, make, patch: load the site's modules or ask its admins)"
    stack_env=()
    if [[ $stack_flavor == gpu ]]; then
      gpu_variables=$("$python" "$repo_root/scripts/gpu_toolchain.py") || exit 1
      mapfile -t stack_env <<<"$gpu_variables"
    fi
    "$python" -m pip --disable-pip-version-check --quiet install packaging cloudpickle psutil \
        pyyaml cffi setuptools wheel 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2) \
      || die "pip could not install horovod's build requirements into $python's environment"
    stack_wheels=$wheel_cache/$(horovod_key "$python" "$stack_tf" "$stack_tf_version" "$stack_flavor")
    build_horovod "$python" "$stack_flavor" "$stack_wheels" "the stack's $stack_tf $stack_tf_version" \
      "${stack_env[@]}"
    "$python" -m pip --disable-pip-version-check --quiet install --no-deps "$stack_wheels"/horovod-*.whl \
        2> >(grep -v "^WARNING: Location '.*' is ignored" >&2) \
      || die "pip could not install the horovod it built into $python's environment"
    install_gpu_record "$python" "$stack_wheels"
  fi
  # One build check as horovodrun makes it: a horovod built here (patch 0004) records its answers,
  # which spares every later horovodrun start a TensorFlow import; any other horovod just answers.
  "$python" -c 'from horovod.common.util import mpi_built; mpi_built()' >/dev/null 2>&1 || true
  exec "$python" -m hvdtrain.stack
fi

# tf_keras (Keras 2, for --keras 2 and horovod.tensorflow.keras) follows TensorFlow's minor; each
# minor has the constraints file its stack was verified with (docs/stack.md).
tf_minor=$(cut -d. -f1,2 <<<"$TF_VERSION")
case "$tf_minor" in
  2.18) TF_KERAS_VERSION=2.18.0 ;;
  2.19) TF_KERAS_VERSION=2.19.0 ;;
  2.20) TF_KERAS_VERSION=2.20.1 ;;
  2.21) TF_KERAS_VERSION=2.21.0 ;;
  *) die "HVDTRAIN_TF_VERSION must be a 2.18-2.21 release (horovod is built and tested on those), got '$TF_VERSION'" ;;
esac
constraints_file=$repo_root/scripts/constraints/tf-$tf_minor.txt
[[ -f $constraints_file ]] || die "no verified package set for TensorFlow $tf_minor ($constraints_file)"
grep -Eiq "^tensorflow[_-]cpu==$TF_VERSION\b" "$constraints_file" \
  || die "$constraints_file was verified with another TensorFlow $tf_minor release; use $(grep -Eio '^tensorflow[_-]cpu==[0-9.]+' "$constraints_file" | cut -d= -f3)"

# A GPU machine never gets the CPU wheel by default: its ranks would train on the CPU.
flavor=${HVDTRAIN_TF_FLAVOR:-}
flavor_reason="HVDTRAIN_TF_FLAVOR=$flavor"
if [[ -z $flavor ]]; then
  if gpu_here; then
    flavor=gpu; flavor_reason="$gpu_reason (HVDTRAIN_TF_FLAVOR=cpu installs CPU TensorFlow)"
  else
    flavor=cpu; flavor_reason=$gpu_reason
    # A login node without a GPU, in a cluster with GPU nodes: the shared venv would get the CPU
    # wheel and the first GPU job would stop (in one line) one round trip later. Say so now.
    cluster_gpus=$(command -v sinfo >/dev/null 2>&1 && timeout 20 sinfo -h -o %G 2>/dev/null |
                   grep -o 'gpu[^ ,(]*' | sort -u | paste -sd, -) || true
    if [[ -n $cluster_gpus ]]; then
      flavor_reason+="; but this Slurm cluster has GPU nodes (sinfo: $cluster_gpus): for their jobs install with HVDTRAIN_TF_FLAVOR=gpu make install (here or on a GPU node)"
    fi
  fi
fi

# The CPU wheel carries no CUDA plugins, so CPU ranks start without TensorFlow's CUDA warnings.
# Both wheels install the same `tensorflow` package files, so exactly one of them may be present.
case "$flavor" in
  cpu) tf_distribution=tensorflow-cpu; other_tf_distribution=tensorflow
       tf_requirement="tensorflow-cpu==$TF_VERSION" ;;
  gpu) tf_distribution=tensorflow; other_tf_distribution=tensorflow-cpu
       tf_requirement="tensorflow[and-cuda]==$TF_VERSION" ;;
  *) die "HVDTRAIN_TF_FLAVOR must be cpu or gpu, got '$flavor'" ;;
esac

key=$(horovod_key "$python" "$tf_distribution" "$TF_VERSION" "$flavor")

# The GPU build compiles horovod's CUDA code and links NCCL: the machine's toolkit when it has one,
# else PyPI's CUDA wheels, assembled after TensorFlow's are installed (scripts/gpu_toolchain.py).
gpu_build_env=()
cuda_source=none
if [[ $flavor == gpu ]]; then
  gpu_variables=$("$python" "$repo_root/scripts/gpu_toolchain.py") || exit 1
  mapfile -t gpu_build_env <<<"$gpu_variables"
  cuda_source="the machine's (${gpu_build_env[0]:-})"
  [[ ${gpu_build_env[0]:-} == HVDTRAIN_CUDA_FROM_WHEELS=1 ]] && cuda_source="PyPI wheels"
fi

if [[ ${HVDTRAIN_INSTALL_PLAN:-0} == 1 ]]; then
  printf 'flavor=%s (%s)\ntensorflow=%s\ntf_keras=%s\nconstraints=%s\nhorovod=%s\ncuda=%s\n' \
    "$flavor" "$flavor_reason" "$tf_requirement" "$TF_KERAS_VERSION" \
    "${constraints_file#"$repo_root"/}" "$wheel_cache/$key" "$cuda_source"
  exit 0
fi
say "TensorFlow $TF_VERSION, $flavor flavor: $flavor_reason"

# --- 1. system packages ------------------------------------------------------------------------
# Python itself is the one thing this script does not install: the stack is verified on 3.11
# (Debian 12's python3) and horovod is compiled for it.
command -v "$python" >/dev/null 2>&1 || die "$python not found; hvdtrain needs Python 3.11 (set PYTHON=...)"
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$python is $("$python" -V 2>&1); the pinned stack needs Python 3.11"
missing=()
# Debian ships `python3 -m venv` without ensurepip, so venv creation fails until this is installed.
if [[ ! -x $venv/bin/python ]] && ! "$python" -c 'import ensurepip' >/dev/null 2>&1; then
  missing+=(python3.11-venv)
fi
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
# libopenmpi-dev ships the mpicc wrapper and headers that horovod and mpi4py compile against.
command -v mpicc >/dev/null 2>&1 || missing+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v patch >/dev/null 2>&1 || missing+=(patch)
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    die "missing system packages; run: sudo apt-get install -y ${missing[*]}"
  fi
  say "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. the virtual environment ----------------------------------------------------------------
if [[ ! -x $venv/bin/python ]]; then
  say "creating $venv"
  "$python" -m venv "$venv"
fi
# A reinstall invalidates the stamp first: an interrupted one must not look complete to `make`.
rm -f "$stamp"
pip() {
  # Some machines configure extra package indexes that do not exist; pip then warns once per
  # package. Those lines say nothing about this install, so they are dropped; the rest is shown.
  "$venv/bin/python" -m pip --disable-pip-version-check --quiet "$@" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
installed_version() {
  "$venv/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" \
    2>/dev/null || true
}
pip install --upgrade pip "setuptools<81" wheel
if [[ -n $(installed_version "$other_tf_distribution") ]]; then
  # Switching flavor: removing the other wheel deletes files both share, so ours is reinstalled
  # from scratch, and horovod, compiled against the other wheel, is replaced from its own cache key.
  say "replacing $other_tf_distribution with $tf_distribution in $venv"
  replaced=("$other_tf_distribution")
  for distribution in "$tf_distribution" horovod; do
    [[ -n $(installed_version "$distribution") ]] && replaced+=("$distribution")
  done
  pip uninstall -y "${replaced[@]}"
fi
# The constraints file pins every transitive version that was verified together.
constraints=("-c" "$constraints_file")
say "installing $tf_requirement, tf_keras, mpi4py and the rest of the pinned stack"
# mlflow-skinny: MLflow's client, for --track mlflow (the server its tests start has a venv of its
# own, below). pyarrow: `hvdtrain predict --output X.parquet` (TensorFlow and Keras do not import
# it; pandas, which Keras 3 would, stays out). mkdocs: `make docs` and tests/test_docs.py. The
# constraints pin pymdown-extensions at 12.3: 13.x needs Python >= 3.11.5, and the image's Debian
# Python (containers/build.sh) is 3.11.2.
pip install "${constraints[@]}" "$tf_requirement" \
  mpi4py scikit-learn matplotlib pytest pytest-timeout \
  packaging cloudpickle psutil pyyaml cffi mlflow-skinny tensorboard pyarrow \
  'mkdocs>=1.6,<2' 'pymdown-extensions>=10,<14'
# The `mlflow server` of tests/test_tracking.py, in a venv of its own: full mlflow brings pandas
# and pyarrow, and Keras 3 imports pandas wherever it is importable, 0.2 s of CPU at the start of
# every rank (2.23-2.32 s against 2.04-2.08 s for a rank's imports, measured 2026-11-29).
mlflow_server_venv=$venv/mlflow-server
[[ -x $mlflow_server_venv/bin/python ]] || "$python" -m venv "$mlflow_server_venv"
"$mlflow_server_venv/bin/python" -m pip --disable-pip-version-check --quiet install \
  "${constraints[@]}" mlflow 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
# tf_keras requires `tensorflow` by that name and nothing else; with the CPU wheel installed under
# its own name, resolving that requirement would put the CUDA build over the same files.
pip install "${constraints[@]}" --no-deps "tf_keras==$TF_KERAS_VERSION"

# --- 3. horovod, compiled once per (horovod, patches, TF wheel, Python, flavor, machine) ---------
cached_wheel_dir=$wheel_cache/$key
# Which wheel the venv's horovod came from: a new TensorFlow or new patches need a new build even
# though the version number stays 0.28.1.
horovod_key_file=$venv/.hvdtrain-horovod
if [[ $(installed_version horovod) != "$HOROVOD_VERSION" || $(cat "$horovod_key_file" 2>/dev/null) != "$key" ]]; then
  if [[ ${gpu_build_env[0]:-} == HVDTRAIN_CUDA_FROM_WHEELS=1 ]] \
      && ! compgen -G "$cached_wheel_dir/horovod-*.whl" >/dev/null; then
    cuda_dir=$(mktemp -d)
    cleanup+=("$cuda_dir")
    gpu_variables=$("$venv/bin/python" "$repo_root/scripts/gpu_toolchain.py" --from-wheels \
                    "$cuda_dir") || exit 1
    mapfile -t gpu_build_env <<<"$gpu_variables"
  fi
  build_horovod "$venv/bin/python" "$flavor" "$cached_wheel_dir" "$tf_distribution $TF_VERSION" \
    "${gpu_build_env[@]}"
  pip install "${constraints[@]}" --force-reinstall --no-deps "$cached_wheel_dir"/horovod-*.whl
  install_gpu_record "$venv/bin/python" "$cached_wheel_dir"
  printf '%s\n' "$key" >"$horovod_key_file"
fi

# --- 4. hvdtrain itself, then verify -----------------------------------------------------------
PYTHONWARNINGS=$quiet_editable pip install --no-deps --no-build-isolation -e "$repo_root"

[[ -z $(installed_version "$other_tf_distribution") ]] \
  || die "$other_tf_distribution is installed beside $tf_distribution in $venv; remove the venv and run again"
# The first check also writes horovod's build record beside its TensorFlow extension (patch 0004):
# every later horovodrun start, and the launcher's probe, read it instead of importing TensorFlow.
check_build=$("$venv/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $check_build"
features=(TensorFlow MPI Gloo)
if [[ $flavor == gpu ]]; then
  features+=(NCCL)  # a build that fell back to CPU operations is no GPU install
fi
for feature in "${features[@]}"; do
  grep -Eq "\[X\] $feature\b" <<<"$check_build" \
    || die "horovod was built without $feature (horovodrun --check-build):"$'\n'"$check_build"
done
"$venv/bin/python" -c 'import sys; from horovod.common.util import recorded_build_checks
sys.exit(recorded_build_checks("tensorflow") is None)' \
  || die "horovodrun --check-build wrote no build record beside horovod's TensorFlow extension (is $venv writable?)"
"$venv/bin/python" -c 'import hvdtrain' || die "import hvdtrain failed in $venv"
"$mlflow_server_venv/bin/mlflow" --version >/dev/null \
  || die "the tests' MLflow server does not start in $mlflow_server_venv"
# What was installed, for `make` (the file's age) and for tests (its contents).
printf 'flavor=%s\ntensorflow=%s==%s\nhorovod=%s\n' \
  "$flavor" "$tf_distribution" "$TF_VERSION" "$key" >"$stamp"
say "ok: $("$venv/bin/python" -c 'import tensorflow as tf, horovod, tf_keras; print(f"TensorFlow {tf.__version__}, tf_keras {tf_keras.__version__}, horovod {horovod.__version__}")' 2>/dev/null) ($tf_distribution) with $(IFS=+; echo "${features[*]:1}" | sed 's/+/ + /g') in $venv"
