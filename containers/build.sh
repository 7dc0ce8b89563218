#!/usr/bin/env bash
# hvdtrain's container image, built without a registry: debootstrap Debian 12, run
# scripts/install.sh in it (OpenMPI, Python 3.11, the pinned TensorFlow + tf_keras, horovod
# compiled against them, hvdtrain), and write, under --out:
#   hvdtrain-cpu.sqfs     SquashFS of the root: Charliecloud (`ch-run hvdtrain-cpu.sqfs -- ...`)
#                         and Enroot/pyxis (`srun --container-image=./hvdtrain-cpu.sqfs ...`)
#   hvdtrain-cpu.oci.tar  OCI image archive (one layer): `podman load -i`, `skopeo copy
#                         oci-archive:...`, `apptainer build x.sif oci-archive://...`
# In the image: the repository's committed HEAD in /opt/hvdtrain, its venv in /opt/hvdtrain/.venv,
# `python` and the hvdtrain commands on the default PATH (/usr/local/bin), and that PATH in
# /ch/environment (ch-run --set-env) and /etc/environment (Enroot).
#
# GPU images start from NVIDIA's NGC TensorFlow image instead (containers/hvdtrain-ngc.def,
# untested): CUDA, NCCL and horovod come built together there.
#
# Usage, as root (debootstrap, chroot, mount):
#   containers/build.sh [--out DIR] [--formats squash,oci] [--reuse-caches] [--repo DIR]
#     --out DIR        where the images go (default: ./images)
#     --formats LIST   squash, oci or both (default squash,oci)
#     --squash-options "..."
#                      mksquashfs's compression (default "-comp zstd -Xcompression-level 3":
#                      a 2.2 GB venv packed in 8 s of CPU to 566 MB, where gzip took 177 s for
#                      555 MB; squashfuse, Enroot and Linux >= 4.14 read zstd; "-comp gzip" for
#                      older readers)
#     --reuse-caches   use this machine's pip cache and compiled horovod wheels
#                      (~/.cache/hvdtrain/wheels) instead of downloading and compiling again;
#                      the image is the same, the build minutes shorter
#     --repo DIR       the git repository whose committed HEAD goes in (default: this one)
#     --mount-point /DIR
#                      one more top directory for the image to have (repeatable): ch-run binds
#                      the job's directories only onto directories the image has, and a
#                      SquashFS image is read-only; the usual ones are there already (/work,
#                      /scratch, /project(s), /lustre, /gpfs, /data, /shared, /fsx, /home, /mnt,
#                      /srv, /tmp)
set -euo pipefail
# All of it in one compound command, read before any of it runs: an edit to this file during a
# build (minutes) cannot change what the running build does next.
{
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$PWD/images
formats=squash,oci
reuse_caches=false
mount_points=(work scratch project projects lustre gpfs data shared fsx home mnt srv)
squash_options="-comp zstd -Xcompression-level 3"
while (($#)); do
  case "$1" in
    --out) out=$(realpath -m "${2:?--out needs a directory}"); shift 2 ;;
    --formats) formats=${2:?--formats needs squash, oci or squash,oci}; shift 2 ;;
    --reuse-caches) reuse_caches=true; shift ;;
    --squash-options) squash_options=${2:?--squash-options needs mksquashfs options}; shift 2 ;;
    --repo) repo=$(cd "${2:?--repo needs a directory}" && pwd); shift 2 ;;
    --mount-point)
      [[ ${2:-} =~ ^/[A-Za-z0-9._-]+/?$ ]] \
        || { printf 'containers/build.sh: --mount-point takes a top directory like /check, got %s\n' "${2:-nothing}" >&2; exit 2; }
      mount_points+=("$(basename "$2")"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) printf 'containers/build.sh: unknown argument %s (see --help)\n' "$1" >&2; exit 2 ;;
  esac
done

say() { printf '[container] %s\n' "$*"; }
die() { printf 'containers/build.sh: %s\n' "$*" >&2; exit 1; }
# shellcheck source=../scripts/debian-root.sh
source "$repo/scripts/debian-root.sh"

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, chroot, mount)"
[[ ,$formats, =~ ^(,(squash|oci))+,$ ]] || die "--formats takes squash, oci or squash,oci, got '$formats'"
git -C "$repo" rev-parse --verify -q HEAD >/dev/null || die "$repo is not a git repository with a commit"
if [[ ,$formats, == *,squash,* ]] && ! command -v mksquashfs >/dev/null 2>&1; then
  say "apt-get install squashfs-tools"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq squashfs-tools >/dev/null \
    || die "could not install squashfs-tools (mksquashfs)"
fi
mkdir -p "$out"

workdir=$(mktemp -d "${TMPDIR:-/var/tmp}/hvdtrain-container.XXXXXX")
root=$workdir/root
finish() {
  local status=$?
  release_root "$root" && rm -rf --one-file-system "$workdir" \
    || printf 'containers/build.sh: left %s (mounts remain)\n' "$workdir" >&2
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

started=$(date +%s)
say "debootstrap bookworm into $root"
bootstrap_root "$root" "$workdir/debootstrap.log" python3,ca-certificates
copy_host_access "$root"
say "the committed HEAD of $repo ($(git -C "$repo" rev-parse --short HEAD)) into /opt/hvdtrain"
mkdir -p "$root/opt/hvdtrain"
git -C "$repo" archive HEAD | tar -x -C "$root/opt/hvdtrain"
mount_system "$root"
if $reuse_caches; then
  # Bound, not copied: nothing of them stays in the image.
  for cache in "${XDG_CACHE_HOME:-$HOME/.cache}/pip" \
               "${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/wheels}"; do
    mkdir -p "$cache" "$root/root/.cache/${cache##*/.cache/}"
    mount --bind "$cache" "$root/root/.cache/${cache##*/.cache/}"
  done
  say "reusing this machine's pip cache and compiled horovod wheels"
fi

say "scripts/install.sh in the root (log: $workdir/install.log)"
chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${PIP_ENV[@]}" \
  HVDTRAIN_VENV=/opt/hvdtrain/.venv /bin/bash -c 'cd /opt/hvdtrain && bash scripts/install.sh' \
  >"$workdir/install.log" 2>&1 || { tail -n 40 "$workdir/install.log" >&2; die "install.sh failed in the root"; }
grep '^\[install\] ok:' "$workdir/install.log" | sed 's/^\[install\] /[container] /'
release_root "$root" || die "could not unmount what the build mounted in $root"
# This machine's apt logins and proxy passwords and pip's index tokens were for the install.
((${#HOST_CREDENTIALS[@]})) && say "removed from the root what the install used of this machine's settings: ${HOST_CREDENTIALS[*]}"
remove_host_credentials "$root"

# --- what a runtime expects of the image ---------------------------------------------------------
venv_bin=/opt/hvdtrain/.venv/bin
for command in python horovodrun hvdtrain; do
  ln -sf "$venv_bin/$command" "$root/usr/local/bin/$command"
done
# Where clusters keep the job's files: ch-run binds only onto directories the image has, and
# the launcher binds the working directory's top directory at the same path.
for mount_point in "${mount_points[@]}"; do
  mkdir -p "$root/$mount_point"
done
image_path="$venv_bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
mkdir -p "$root/ch"
printf 'PATH=%s\n' "$image_path" >"$root/ch/environment"
printf 'PATH="%s"\n' "$image_path" >"$root/etc/environment"
# This machine's network settings were for the build; runtimes bind the node's own over these.
: >"$root/etc/resolv.conf"
printf '127.0.0.1\tlocalhost\n' >"$root/etc/hosts"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/root/.cache "$root"/tmp/* "$root"/var/tmp/*

name=hvdtrain-cpu
if [[ ,$formats, == *,squash,* ]]; then
  say "mksquashfs -> $out/$name.sqfs"
  # shellcheck disable=SC2086 # the options, split as words
  mksquashfs "$root" "$out/$name.sqfs.partial" -noappend -quiet -no-progress $squash_options \
    -processors "$(nproc)" >/dev/null
  mv "$out/$name.sqfs.partial" "$out/$name.sqfs"
fi
if [[ ,$formats, == *,oci,* ]]; then
  say "OCI archive -> $out/$name.oci.tar"
  python3 "$repo/containers/oci_archive.py" "$root" "$out/$name.oci.tar" \
    --env "PATH=$image_path" --tag "hvdtrain:cpu"
fi
say "done in $(($(date +%s) - started)) s: $(cd "$out" && ls -sh "$name".* | tr '\n' ' ')"
exit 0
}
