# A Debian 12 root built with debootstrap, for containers/build.sh (the image) and
# tests/cluster/debian-check.sh (the README's first commands on a bare Debian). Sourced, not run.
#
#   debian_mirror                  the URI of this machine's `deb ... bookworm` entry
#   bootstrap_root ROOT LOG [PKG,...]
#                                  debootstrap --variant=minbase bookworm into ROOT, adding PKGs
#   copy_host_access ROOT          what reaching the package archives needs, from this machine:
#                                  the bookworm apt sources, apt's Acquire settings and logins,
#                                  resolv.conf, hosts, CA certificates and pip's configuration;
#                                  fills PIP_ENV with the PIP_*/SSL variables to pass into the root
#   remove_host_credentials ROOT   after the install: removes what copy_host_access copied that
#                                  may hold this machine's secrets (apt's Acquire settings and
#                                  auth.conf: proxy passwords; pip's configuration: index tokens)
#                                  and user:password@ from the root's apt sources, so that an
#                                  image packed from ROOT carries none of them
#   mount_system ROOT              /proc, /sys and /dev (with /dev/shm and /dev/pts) in ROOT
#   release_root ROOT              end the processes running in ROOT, then unmount everything
#                                  under it (deepest first); status 1 if a mount is left
# Callers set `set -euo pipefail` and define die(). This machine's files are read under
# $HOST_ROOT (default /; a test points it at a made-up machine) and the user's under $HOME.
HOST_ROOT=${HOST_ROOT:-}

# Prints "URI SUITE" for every enabled `deb` entry, one-line and deb822 formats alike.
_deb_entries() {
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

_apt_source_files() {  # this machine's apt source files, as paths on it
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -f $HOST_ROOT$file ]] && printf '%s\n' "$file"
  done
}

debian_mirror() {
  local files=() file mirror
  while read -r file; do files+=("$HOST_ROOT$file"); done < <(_apt_source_files)
  mirror=$(_deb_entries "${files[@]}" | awk '$2 == "bookworm" { print $1; exit }')
  [[ -n $mirror ]] || die "no 'deb ... bookworm' entry in this machine's apt sources (${files[*]:-none})"
  printf '%s\n' "$mirror"
}

bootstrap_root() {
  local root=$1 log=$2 include=${3:-} mirror
  mirror=$(debian_mirror)
  if ! command -v debootstrap >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq debootstrap >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq debootstrap >/dev/null; }
  fi
  debootstrap --variant=minbase ${include:+--include="$include"} bookworm "$root" "$mirror" \
    >"$log" 2>&1 || { tail -n 30 "$log" >&2; die "debootstrap failed (log: $log)"; }
}

_copy_into() {  # _copy_into ROOT PATH...: each existing file or directory of this machine, the same place
  local root=$1 path
  shift
  for path in "$@"; do
    [[ -e $HOST_ROOT$path ]] || continue
    mkdir -p "$root$(dirname "$path")"
    cp -rL "$HOST_ROOT$path" "$root$(dirname "$path")/"
  done
}

# The paths in the root of what copy_host_access copied that may hold this machine's secrets.
HOST_CREDENTIALS=()
_copy_credentials_into() {  # _copy_credentials_into ROOT PATH...: as _copy_into, and noted
  local root=$1 path
  shift
  for path in "$@"; do
    [[ -e $HOST_ROOT$path ]] || continue
    _copy_into "$root" "$path"
    HOST_CREDENTIALS+=("$path")
  done
}

PIP_ENV=()
copy_host_access() {
  local root=$1 files=() bookworm=() file name path
  mapfile -t files < <(_apt_source_files)
  for file in "${files[@]}"; do
    if _deb_entries "$HOST_ROOT$file" | awk '$2 ~ /^bookworm(-updates|-security|-backports)?$/ { found = 1 } END { exit !found }'; then
      bookworm+=("$file")
    fi
  done
  if ((${#bookworm[@]})); then
    rm -f "$root/etc/apt/sources.list"
    _copy_into "$root" "${bookworm[@]}"
  fi
  HOST_CREDENTIALS=()
  # Acquire settings only (proxy, validity of snapshot mirrors); hooks that run this machine's
  # programs (Invoke) would fail in a bare root. With the logins of auth.conf, for the install
  # only (remove_host_credentials).
  for file in "$HOST_ROOT"/etc/apt/apt.conf "$HOST_ROOT"/etc/apt/apt.conf.d/*; do
    [[ -f $file ]] && grep -q 'Acquire::' "$file" && ! grep -q 'Invoke' "$file" \
      && _copy_credentials_into "$root" "${file#"$HOST_ROOT"}"
  done
  _copy_credentials_into "$root" /etc/apt/auth.conf /etc/apt/auth.conf.d
  _copy_into "$root" /etc/resolv.conf /etc/hosts
  # Local CAs first, then the bundle built from them (the root's own bundle lacks them).
  _copy_into "$root" /usr/local/share/ca-certificates /etc/ssl/certs/ca-certificates.crt
  PIP_ENV=()
  for name in $(compgen -e); do
    case "$name" in
      PIP_*) PIP_ENV+=("$name=${!name}") ;;
      SSL_CERT_FILE|REQUESTS_CA_BUNDLE) PIP_ENV+=("$name=${!name}"); _copy_into "$root" "${!name}" ;;
    esac
  done
  [[ -n ${PIP_CERT:-} ]] && _copy_into "$root" "$PIP_CERT"
  _copy_credentials_into "$root" /etc/pip.conf /etc/xdg/pip
  for path in "$HOME/.config/pip" "$HOME/.pip"; do
    if [[ -e $path ]]; then
      mkdir -p "$root/root/${path#"$HOME"/}"
      cp -rL "$path/." "$root/root/${path#"$HOME"/}/"
      HOST_CREDENTIALS+=("/root/${path#"$HOME"/}")
    fi
  done
  return 0
}

remove_host_credentials() {
  local root=$1 path
  for path in "${HOST_CREDENTIALS[@]}"; do
    rm -rf --one-file-system "${root:?}$path"
  done
  HOST_CREDENTIALS=()
  # A source's URI may carry a login (https://user:token@host/...): the image keeps the mirror,
  # not the login.
  for path in "$root"/etc/apt/sources.list "$root"/etc/apt/sources.list.d/*; do
    [[ -f $path && ! -L $path ]] && sed -i -E 's#([a-z+]+://)[^/@[:space:]]+@#\1#g' "$path"
  done
  return 0
}

mount_system() {
  local root=$1
  mount -t proc proc "$root/proc"
  mount -t sysfs sysfs "$root/sys"
  # /dev with /dev/shm (OpenMPI's shared memory) and /dev/pts; rslave keeps unmounts from
  # propagating back to this machine.
  mount --rbind /dev "$root/dev"
  mount --make-rslave "$root/dev"
}

release_root() {
  local root=$1 proc pids=() mounts mount_point
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
    printf 'mounts remain under %s:\n' "$root" >&2
    findmnt -rn -o TARGET | grep -F "$root/" >&2
    return 1
  fi
}
