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
if ! command -v debootstrap >/dev/null 2>&1; then
  say "apt-get install debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
fi

# --- the Debian mirror and source files this machine uses -----------------------------------------
source_files=()
for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [[ -f $file ]] && source_files+=("$file")
done
# Prints "URI SUITE" for every enabled `deb` entry, one-line and deb822 formats alike.
deb_entries() {
  local file
  for file in "$@"; do
    if [[ $file == *.sources ]]; then
      awk 'BEGIN { RS = "" }
           { types = ""; uris = ""; suites = ""; enabled = "yes"
             n = split($0, lines, "\n")
             for (i = 1; i <= n; i++) {
               line = lines[i]
               if (line ~ /^Types:/) { sub(/^Types:[ \t]*/, "", line); types = line }
               else if (line ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", line); uris = line }
               else if (line ~ /^Suites:/) { sub(/^Suites:[ \t]*/, "", line); suites = line }
               else if (line ~ /^Enabled:/) { sub(/^Enabled:[ \t]*/, "", line); enabled = line }
             }
             if (enabled != "no" && (" " types " ") ~ / deb /) {
               nu = split(uris, u, /[ \t]+/); ns = split(suites, s, /[ \t]+/)
               for (a = 1; a <= nu; a++) for (b = 1; b <= ns; b++) print u[a], s[b]
             } }' "$file"
    else
      awk '$1 == "deb" { i = 2
                         if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                         print $i, $(i + 1) }' "$file"
    fi
  done
}
mirror=$(deb_entries "${source_files[@]}" | awk '$2 == "bookworm" { print $1; exit }')
[[ -n $mirror ]] || die "no 'deb ... bookworm' entry in this machine's apt sources (${source_files[*]:-none})"
debian_source_files=()
for file in "${source_files[@]}"; do
  if deb_entries "$file" | awk '$2 ~ /^bookworm(-updates|-security|-backports)?$/ { found = 1 } END { exit !found }'; then
    debian_source_files+=("$file")
  fi
done

# --- the root, and its teardown ------------------------------------------------------------------
workdir=$(mktemp -d "${TMPDIR:-/tmp}/hvdtrain-debian-check.XXXXXX")
root=$workdir/root
# Readable by every user (root's home is not), for the unprivileged run.
clone=/srv/hvdtrain
teardown() {
  local status=$? proc pids=() mounts
  # Processes still running inside the root (an interrupted build or job) hold its mounts.
  for proc in /proc/[0-9]*; do
    [[ $(readlink "$proc/root" 2>/dev/null) == "$root" ]] && pids+=("${proc#/proc/}")
  done
  if ((${#pids[@]})); then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    sleep 2
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  # Deepest first; a lazy unmount for what is still busy.
  mounts=$(findmnt -rn -o TARGET | grep -F "$root/" | sort -r || true)
  while read -r mount_point; do
    [[ -n $mount_point ]] || continue
    umount "$mount_point" 2>/dev/null || umount -l "$mount_point" || true
  done <<<"$mounts"
  if findmnt -rn -o TARGET | grep -qF "$root/"; then
    # Never delete through a mount: /dev of this machine is bound in there.
    printf 'debian-check: mounts remain under %s; not removing it:\n' "$root" >&2
    findmnt -rn -o TARGET | grep -F "$root/" >&2
  else
    rm -rf --one-file-system "$workdir"
  fi
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

now() { date +%s; }
started=$(now)
say "debootstrap bookworm (minbase + python3 git ca-certificates) from $mirror into $root"
step=$(now)
debootstrap --variant=minbase --include=python3,git,ca-certificates bookworm "$root" "$mirror" \
  >"$workdir/debootstrap.log" 2>&1 || { tail -n 30 "$workdir/debootstrap.log" >&2; die "debootstrap failed"; }
debootstrap_seconds=$(($(now) - step))
say "debootstrap: ${debootstrap_seconds} s"

# --- what reaching the archives needs, copied from this machine ------------------------------------
copy_into_root() {  # copy_into_root PATH...: each existing file or directory to the same place
  local path
  for path in "$@"; do
    [[ -e $path ]] || continue
    mkdir -p "$root$(dirname "$path")"
    cp -rL "$path" "$root$(dirname "$path")/"
  done
}
if ((${#debian_source_files[@]})); then
  rm -f "$root/etc/apt/sources.list"
  copy_into_root "${debian_source_files[@]}"
fi
# Acquire settings only (proxy, validity of snapshot mirrors); hooks that run this machine's
# programs (Invoke) would fail in a bare root.
for file in /etc/apt/apt.conf /etc/apt/apt.conf.d/*; do
  [[ -f $file ]] && grep -q 'Acquire::' "$file" && ! grep -q 'Invoke' "$file" && copy_into_root "$file"
done
copy_into_root /etc/resolv.conf /etc/hosts
# Local CAs first, then the bundle built from them (the root's own bundle lacks them).
copy_into_root /usr/local/share/ca-certificates /etc/ssl/certs/ca-certificates.crt
pip_env=()
for name in $(compgen -e); do
  case "$name" in
    PIP_*) pip_env+=("$name=${!name}") ;;
    SSL_CERT_FILE|REQUESTS_CA_BUNDLE) pip_env+=("$name=${!name}"); copy_into_root "${!name}" ;;
  esac
done
[[ -n ${PIP_CERT:-} ]] && copy_into_root "$PIP_CERT"
copy_into_root /etc/pip.conf /etc/xdg/pip
for path in "$HOME/.config/pip" "$HOME/.pip"; do
  if [[ -e $path ]]; then
    mkdir -p "$root/root/${path#"$HOME"/}"
    cp -rL "$path/." "$root/root/${path#"$HOME"/}/"
  fi
done

git clone -q "$repo" "$root$clone"
say "cloned $(git -C "$repo" rev-parse --short HEAD) (committed HEAD of $repo) to $clone"
if $reuse_wheels; then
  host_wheels=${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/wheels}
  mkdir -p "$root/root/.cache/hvdtrain/wheels"
  [[ -d $host_wheels ]] && cp -r "$host_wheels/." "$root/root/.cache/hvdtrain/wheels/"
  say "NOT A CLEAN RUN: compiled horovod wheels copied from $host_wheels"
fi

mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
# /dev with /dev/shm (OpenMPI's shared memory) and /dev/pts; rslave keeps unmounts from
# propagating back to this machine.
mount --rbind /dev "$root/dev"
mount --make-rslave "$root/dev"

in_root() {  # in_root SECONDS COMMAND: run COMMAND with bash in the root's clone, as root
  timeout --kill-after=30 "$1" chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${pip_env[@]}" \
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
