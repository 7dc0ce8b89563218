#!/usr/bin/env bash
# Prove the README's first commands on a stock Debian 12: build a bare bookworm root with
# `debootstrap --variant=minbase`, add only what a user's bare machine has (python3, git,
# ca-certificates: no make, no python3-venv), clone this repository's committed HEAD into it, and
# run there, as root in a chroot, what the README tells such a user:
#   bash scripts/install.sh     # installs make, python3.11-venv, OpenMPI, the compilers, the venv
#   make train
# Before that it runs install.sh as an unprivileged user, which must stop with one line naming the
# apt-get command. It prints the wall time of each step and the job's final line, and always tears
# everything down (processes left in the root, then the mounts, then the directory).
#
# From this machine it copies only what reaching the package archives needs, as a user's machine
# has its own: the Debian mirror and its `bookworm*` source files, apt's Acquire settings (proxy,
# validity checks), pip's configuration (files and PIP_* variables) and the CA certificates.
#
# Usage, as root (measured on a busy 2-core machine: 15 minutes clean, 5 with --wheel-cache):
#   tests/cluster/debian-check.sh [--wheel-cache] [--repo DIR]
#     --wheel-cache  copy this machine's compiled horovod wheels (~/.cache/hvdtrain/wheels or
#                    HVDTRAIN_WHEEL_CACHE) into the root to skip the horovod build. NOT a clean
#                    run; the output says so. Without it nothing is reused.
#     --repo DIR     the git repository whose committed HEAD is cloned (default: this one)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
reuse_wheels=false
while (($#)); do
  case "$1" in
    --wheel-cache) reuse_wheels=true; shift ;;
    --repo) repo=${2:?--repo needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) printf 'debian-check: unknown argument %s (see --help)\n' "$1" >&2; exit 2 ;;
  esac
done

say() { printf '[debian-check] %s\n' "$*"; }
die() { printf 'debian-check: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, mount, chroot)"
git -C "$repo" rev-parse --verify -q HEAD >/dev/null || die "$repo is not a git repository with a commit"

# shellcheck source=../../scripts/debian-root.sh
source "$repo/scripts/debian-root.sh"

# --- the root, and its teardown ------------------------------------------------------------------
workdir=$(mktemp -d "${TMPDIR:-/tmp}/hvdtrain-debian-check.XXXXXX")
root=$workdir/root
# Readable by every user (root's home is not), for the unprivileged run.
clone=/srv/hvdtrain
teardown() {
  local status=$?
  # Never delete through a mount: /dev of this machine is bound in there.
  if release_root "$root"; then
    rm -rf --one-file-system "$workdir"
  else
    printf 'debian-check: mounts remain under %s; not removing it\n' "$root" >&2
  fi
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

now() { date +%s; }
started=$(now)
say "debootstrap bookworm (minbase + python3 git ca-certificates) into $root"
step=$(now)
bootstrap_root "$root" "$workdir/debootstrap.log" python3,git,ca-certificates
debootstrap_seconds=$(($(now) - step))
say "debootstrap: ${debootstrap_seconds} s"
# What reaching the archives needs, copied from this machine (scripts/debian-root.sh).
copy_host_access "$root"

git clone -q "$repo" "$root$clone"
say "cloned $(git -C "$repo" rev-parse --short HEAD) (committed HEAD of $repo) to $clone"
if $reuse_wheels; then
  host_wheels=${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/wheels}
  mkdir -p "$root/root/.cache/hvdtrain/wheels"
  [[ -d $host_wheels ]] && cp -r "$host_wheels/." "$root/root/.cache/hvdtrain/wheels/"
  say "NOT A CLEAN RUN: compiled horovod wheels copied from $host_wheels"
fi

mount_system "$root"

in_root() {  # in_root SECONDS COMMAND: run COMMAND with bash in the root's clone, as root
  timeout --kill-after=30 "$1" chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${PIP_ENV[@]}" \
    /bin/bash -c "cd $clone && $2"
}
in_root 60 'command -v make >/dev/null && echo "make is already there"; python3 -c "import ensurepip" 2>/dev/null && echo "python3-venv is already there"; python3 -V'

say "bash scripts/install.sh as user nobody"
if in_root 120 'setpriv --reuid=65534 --regid=65534 --clear-groups env HOME=/tmp HVDTRAIN_VENV=/tmp/venv bash scripts/install.sh' \
    >"$workdir/unprivileged.log" 2>&1; then
  die "install.sh succeeded for an unprivileged user on a bare Debian; it should have named apt-get"
fi
unprivileged=$(<"$workdir/unprivileged.log")
[[ $unprivileged != *$'\n'* && $unprivileged == *"apt-get install"* ]] \
  || die "install.sh as nobody should print one line naming apt-get, printed:"$'\n'"$unprivileged"
say "nobody sees: $unprivileged"

step=$(now)
say "bash scripts/install.sh"
in_root 3600 'bash scripts/install.sh' 2>&1 | tee "$workdir/install.log"
install_seconds=$(($(now) - step))
say "install: ${install_seconds} s"

step=$(now)
say "make train"
in_root 1800 'make train' 2>&1 | tee "$workdir/train.log"
train_seconds=$(($(now) - step))

done_line=$(grep -o 'done: .*' "$workdir/train.log" | tail -n 1 || true)
[[ -n $done_line ]] || die "make train did not finish (no 'done:' line)"
say "debootstrap ${debootstrap_seconds} s, install ${install_seconds} s, make train ${train_seconds} s, total $(($(now) - started)) s$($reuse_wheels && echo ' (horovod wheels reused: not a clean run)')"
say "$done_line"
