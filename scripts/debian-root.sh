# A Debian 12 root built with debootstrap, for containers/build.sh (the image) and
# tests/cluster/debian-check.sh (the README's first commands on a bare Debian). Sourced, not run.
#
#   debian_mirror                  the URI of this machine's `deb ... bookworm` entry
#   bootstrap_root ROOT LOG [PKG,...]
#                                  debootstrap --variant=minbase bookworm into ROOT, adding PKGs
#   copy_host_access ROOT          what reaching the package archives needs, from this machine:
#                                  the bookworm apt sources, apt's Acquire settings, resolv.conf,
#                                  hosts, CA certificates and pip's configuration; fills PIP_ENV
#                                  with the PIP_*/SSL variables to pass into the root
#   mount_system ROOT              /proc, /sys and /dev (with /dev/shm and /dev/pts) in ROOT
#   release_root ROOT              end the processes running in ROOT, then unmount everything
#                                  under it (deepest first); status 1 if a mount is left
# Callers set `set -euo pipefail` and define die().

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

_apt_source_files() {
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -f $file ]] && printf '%s\n' "$file"
  done
}

debian_mirror() {
  local files mirror
  mapfile -t files < <(_apt_source_files)
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

_copy_into() {  # _copy_into ROOT PATH...: each existing file or directory to the same place
  local root=$1 path
  shift
  for path in "$@"; do
    [[ -e $path ]] || continue
    mkdir -p "$root$(dirname "$path")"
    cp -rL "$path" "$root$(dirname "$path")/"
  done
}

PIP_ENV=()
copy_host_access() {
  local root=$1 files=() bookworm=() file name path
  mapfile -t files < <(_apt_source_files)
  for file in "${files[@]}"; do
    if _deb_entries "$file" | awk '$2 ~ /^bookworm(-updates|-security|-backports)?$/ { found = 1 } END { exit !found }'; then
      bookworm+=("$file")
    fi
  done
  if ((${#bookworm[@]})); then
    rm -f "$root/etc/apt/sources.list"
    _copy_into "$root" "${bookworm[@]}"
  fi
  # Acquire settings only (proxy, validity of snapshot mirrors); hooks that run this machine's
  # programs (Invoke) would fail in a bare root.
  for file in /etc/apt/apt.conf /etc/apt/apt.conf.d/*; do
    [[ -f $file ]] && grep -q 'Acquire::' "$file" && ! grep -q 'Invoke' "$file" && _copy_into "$root" "$file"
  done
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
  _copy_into "$root" /etc/pip.conf /etc/xdg/pip
  for path in "$HOME/.config/pip" "$HOME/.pip"; do
    if [[ -e $path ]]; then
      mkdir -p "$root/root/${path#"$HOME"/}"
      cp -rL "$path/." "$root/root/${path#"$HOME"/}/"
    fi
  done
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
