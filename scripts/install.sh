#!/usr/bin/env bash
# Set up everything hvdtrain needs on a Debian machine that has only Python 3.11:
#   1. system parts (OpenMPI, cmake, g++, make, Python's venv module) via apt-get when root, else
#      one line naming the apt-get command;
#   2. the venv with the pinned stack (README "Version matrix", scripts/constraints.txt);
#   3. horovod 0.28.1 compiled against that exact TensorFlow, cached as a wheel so that the next
#      install (or a new venv on this machine) reuses it in seconds;
#   4. a check that horovod has TensorFlow, MPI and Gloo and that `import hvdtrain` works, then the
#      stamp file `make` compares against.
# Idempotent: run it as often as you like (`make install` does). It needs no `make`, so on a bare
# machine `bash scripts/install.sh` is the first command.
#
# Environment knobs:
#   HVDTRAIN_VENV         where the venv goes (default: .venv in the repository; `make` passes its
#                         VENV here)
#   HVDTRAIN_TF_FLAVOR    cpu (default) or gpu: gpu installs tensorflow[and-cuda] and builds
#                         horovod with NCCL, which needs a CUDA 12 toolkit and NCCL on the machine:
#                         scripts/gpu_toolchain.py checks them before anything is downloaded
#   HVDTRAIN_WHEEL_CACHE  where compiled horovod wheels are kept (default ~/.cache/hvdtrain/wheels)
#   PYTHON                the interpreter to build the venv from (default: python3.11)
#   HVDTRAIN_STACK        pinned (default: all of the above) or existing: on a stack someone else
#                         built (an NGC TensorFlow image, a site's modules), install hvdtrain alone
#                         into PYTHON's environment (default: python3) and check that stack with
#                         `python -m hvdtrain.stack`; no venv, no apt-get, no build
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVDTRAIN_VENV:-$repo_root/.venv}
flavor=${HVDTRAIN_TF_FLAVOR:-cpu}
wheel_cache=${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/wheels}
python=${PYTHON:-python3.11}
# Written last, so it exists only after a complete install; the Makefile's VENV/.hvdtrain-installed.
stamp=$venv/.hvdtrain-installed

TF_VERSION=2.18.1
TF_KERAS_VERSION=2.18.0
HOROVOD_VERSION=0.28.1

say() { printf '[install] %s\n' "$*"; }
die() { printf 'install: %s\n' "$*" >&2; exit 1; }

# setuptools announces every editable install with an 11-line "BuildBackendWarning: Editable
# installation." block (folders named like the package may shadow it: not a problem of this
# checkout); it would be most of what the README's first command prints.
quiet_editable="ignore:Editable installation"

case "${HVDTRAIN_STACK:-pinned}" in
  pinned) ;;
  existing)
    # Without its dependencies: tf_keras' pin would make pip replace the stack's TensorFlow.
    # The check names what is missing instead, one line each (exit 2).
    python=${PYTHON:-python3}
    command -v "$python" >/dev/null 2>&1 || die "$python not found (set PYTHON=... to the stack's Python)"
    say "installing hvdtrain alone into $("$python" -c 'import sys; print(sys.prefix)') (HVDTRAIN_STACK=existing)"
    PYTHONWARNINGS=$quiet_editable "$python" -m pip --disable-pip-version-check --quiet install \
        --no-deps -e "$repo_root" || die "pip could not install hvdtrain into $python's environment"
    exec "$python" -m hvdtrain.stack ;;
  *) die "HVDTRAIN_STACK must be pinned or existing, got '$HVDTRAIN_STACK'" ;;
esac

# The CPU wheel carries no CUDA plugins, so CPU ranks start without TensorFlow's CUDA warnings.
# Both wheels install the same `tensorflow` package files, so exactly one of them may be present.
case "$flavor" in
  cpu) tf_distribution=tensorflow-cpu; other_tf_distribution=tensorflow
       tf_requirement="tensorflow-cpu==$TF_VERSION" ;;
  gpu) tf_distribution=tensorflow; other_tf_distribution=tensorflow-cpu
       tf_requirement="tensorflow[and-cuda]==$TF_VERSION" ;;
  *) die "HVDTRAIN_TF_FLAVOR must be cpu or gpu, got '$flavor'" ;;
esac

# --- 1. system packages ------------------------------------------------------------------------
# Python itself is the one thing this script does not install: the stack is verified on 3.11
# (Debian 12's python3) and horovod is compiled for it.
command -v "$python" >/dev/null 2>&1 || die "$python not found; hvdtrain needs Python 3.11 (set PYTHON=...)"
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$python is $("$python" -V 2>&1); the pinned stack needs Python 3.11"
# The GPU build compiles horovod's CUDA code and links NCCL from the machine (the CUDA wheels do
# not carry what it needs): find both, or stop in one line per missing piece, before any download.
gpu_build_env=()
if [[ $flavor == gpu ]]; then
  gpu_variables=$("$python" "$repo_root/scripts/gpu_toolchain.py") || exit 1
  mapfile -t gpu_build_env <<<"$gpu_variables"
fi
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
constraints=("-c" "$repo_root/scripts/constraints.txt")
say "installing $tf_requirement, tf_keras, mpi4py and the rest of the pinned stack"
# mlflow: for --track mlflow, and the tracking server its tests start (a user's own environment
# needs only the client: pip install 'hvdtrain[mlflow]').
pip install "${constraints[@]}" "$tf_requirement" \
  mpi4py scikit-learn matplotlib pytest pytest-timeout \
  packaging cloudpickle psutil pyyaml cffi mlflow
# tf_keras requires `tensorflow` by that name and nothing else; with the CPU wheel installed under
# its own name, resolving that requirement would put the CUDA build over the same files.
pip install "${constraints[@]}" --no-deps "tf_keras==$TF_KERAS_VERSION"

# --- 3. horovod, compiled once per (horovod, TF wheel, Python, flavor, machine) ------------------
py_tag=$("$venv/bin/python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
# The TF distribution is part of the key: a wheel built against one TF build is never reused for
# the other.
key="horovod-${HOROVOD_VERSION}_${tf_distribution}-${TF_VERSION}_${py_tag}_${flavor}_$(uname -m)"
cached_wheel_dir=$wheel_cache/$key
if [[ $(installed_version horovod) != "$HOROVOD_VERSION" ]]; then
  if ! compgen -G "$cached_wheel_dir/horovod-*.whl" >/dev/null; then
    say "compiling horovod $HOROVOD_VERSION against $tf_distribution $TF_VERSION (takes ~3 minutes on 2 cores)"
    build_dir=$(mktemp -d)
    trap 'rm -rf "$build_dir"' EXIT
    # Build isolation off: horovod must compile against the TensorFlow in this venv, not a fresh one.
    # PyTorch/MXNet off: we only need the TensorFlow ops; MPI + Gloo controllers both on.
    build_env=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
               HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
               MAKEFLAGS="-j$(nproc)")
    if [[ $flavor == gpu ]]; then
      build_env+=(HOROVOD_GPU_OPERATIONS=NCCL "${gpu_build_env[@]}")
    fi
    env "${build_env[@]}" "$venv/bin/python" -m pip --disable-pip-version-check wheel \
        --no-build-isolation --no-deps --no-cache-dir -w "$build_dir" "horovod==$HOROVOD_VERSION" \
        >"$build_dir/build.log" 2>&1 \
      || { tail -n 40 "$build_dir/build.log" >&2; die "horovod build failed (log above)"; }
    # Publish atomically: a crash mid-build never leaves a half-written wheel in the cache.
    mkdir -p "$wheel_cache"
    staging=$(mktemp -d "$wheel_cache/.staging.XXXXXX")
    cp "$build_dir"/horovod-*.whl "$staging/"
    rm -rf "$cached_wheel_dir"
    mv "$staging" "$cached_wheel_dir"
  else
    say "reusing cached horovod wheel from $cached_wheel_dir"
  fi
  pip install "${constraints[@]}" "$cached_wheel_dir"/horovod-*.whl
fi

# --- 4. hvdtrain itself, then verify -----------------------------------------------------------
PYTHONWARNINGS=$quiet_editable pip install --no-deps --no-build-isolation -e "$repo_root"

[[ -z $(installed_version "$other_tf_distribution") ]] \
  || die "$other_tf_distribution is installed beside $tf_distribution in $venv; remove the venv and run again"
check_build=$("$venv/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $check_build"
features=(TensorFlow MPI Gloo)
if [[ $flavor == gpu ]]; then
  features+=(NCCL)  # a build that fell back to CPU operations is no GPU install
fi
for feature in "${features[@]}"; do
  grep -Eq "\[X\] $feature\b" <<<"$check_build" \
    || die "horovod was built without $feature (horovodrun --check-build):"$'\n'"$check_build"
done
"$venv/bin/python" -c 'import hvdtrain' || die "import hvdtrain failed in $venv"
# What was installed, for `make` (the file's age) and for tests (its contents).
printf 'flavor=%s\ntensorflow=%s==%s\nhorovod=%s\n' \
  "$flavor" "$tf_distribution" "$TF_VERSION" "$HOROVOD_VERSION" >"$stamp"
say "ok: $("$venv/bin/python" -c 'import tensorflow as tf, horovod, tf_keras; print(f"TensorFlow {tf.__version__}, tf_keras {tf_keras.__version__}, horovod {horovod.__version__}")' 2>/dev/null) ($tf_distribution) with $(IFS=+; echo "${features[*]:1}" | sed 's/+/ + /g') in $venv"
