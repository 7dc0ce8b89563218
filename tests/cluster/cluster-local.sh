#!/usr/bin/env bash
# A multi-host cluster on one machine: N "nodes" (network namespaces) for hvdtrain's multi-node
# integration tests, with ssh between them and a Slurm that sees N nodes.
#
#   tests/cluster/cluster-local.sh up [--nodes N] [--isolated-iface] [--pin-cpus]
#                          build and start everything (root only); idempotent, exit 0 when every
#                          node is idle in Slurm and reachable by ssh
#   tests/cluster/cluster-local.sh down    stop and remove everything `up` made
#   tests/cluster/cluster-local.sh status  exit 0 when usable, 3 when down or degraded
#   tests/cluster/cluster-local.sh exec NODE CMD...
#                          run CMD on NODE (its network and hostname), with SLURM_CONF set to
#                          this cluster's configuration
#   tests/cluster/cluster-local.sh env     print `export SLURM_CONF=...` for Slurm clients on the host
#
# What it shares with tests/cluster/slurm-local.sh (the state directory's checks and layout,
# munged, Slurm's configuration, start and wait) is in tests/cluster/lib.sh.
#
# What a node is (node1 ... nodeN, N default 2):
#   - a network namespace hvdt-nodeK with loopback and eth0 = 10.77.0.(10+K)/24, the other end of
#     a veth pair plugged into the bridge hvdt-br0 (10.77.0.1/24 on the host). No node has a
#     default route and the host does not forward, so a node reaches only loopback, the other
#     nodes and the host's bridge address;
#   - a UTS namespace (bound to $STATE_DIR/ns/nodeK.uts) whose hostname is nodeK: every process
#     of the node is started with `nsenter --net=... --uts=...`. Not `ip netns exec`: it remounts
#     /sys, which hides /sys/fs/cgroup, and slurmd then refuses to start;
#   - the machine's file system, shared (like an NFS home on a real cluster): run directories and
#     the repository are the same paths on every node;
#   - a block in /etc/hosts (between marker lines) so every node resolves nodeK;
#   - an sshd on 10.77.0.(10+K):22 with its own host key, accepting one root key, both generated
#     into $STATE_DIR/ssh. /etc/ssh/ssh_config.d/hvdtrain-cluster.conf (included by Debian's
#     ssh_config) tells plain `ssh nodeK` that key and the known host keys, so horovodrun and
#     mpirun's ssh agent reach every node with no prompt and no flags;
#   - a slurmd started as `slurmd -N nodeK`, registered with one slurmctld on the host, listening
#     on 10.77.0.1. Four fake GPUs per node (plain files, enough for gres gpu:4), CPUs=32 trusted
#     through SlurmdParameters=config_overrides (lib.sh's gen_slurm_conf says why).
#
# Coexisting with slurm-local.sh (the single-node Slurm, which uses /etc/slurm): this cluster's
# Slurm has its own configuration ($STATE_DIR/slurm/slurm.conf, clients need SLURM_CONF,
# `exec` and `env` provide it), its own ports (6917/6918), its own munged (own key and socket)
# and state; `down` stops only the daemons whose pids it recorded. One limit: slurm-local.sh `up`
# refuses to start while any slurmd/slurmctld it did not start runs, this cluster's included
# (the daemons cannot be renamed: Slurm reads its own program name and, as anything but
# `slurmd`, ignores the node's Gres=). Bring one down before the other comes up.
#
# --isolated-iface gives every node a second interface, eth1 (a veth whose host end goes nowhere),
# with an address in 10.78.0.0/24: one subnet on every node that connects nothing, like docker0 on the nodes of a
# real cluster. Tools that pick interfaces by subnet think the nodes can talk over it.
#
# --pin-cpus gives every node a CPU of its own, as separate hosts have: node K's sshd and slurmd,
# and so everything started on it (ssh sessions, job steps, `exec`), run on the K-th allowed CPU
# (wrapping around). Without it every node's processes share all the machine's cores, and a busy
# rank on one node takes CPU from the ranks of another. The last `up` decides (without the flag
# the daemons get every allowed CPU back).
#
# The state directory ($STATE_DIR, default /run/hvdtrain-cluster) holds root's ssh key pair, the
# authorized_keys every node's sshd accepts and the munge key, so nobody but root may make it or
# anything in it (a user who could would log into the nodes as root):
#   - it lives under /run: root's and not writable by anyone else (unlike /var/tmp or /tmp, where
#     any user can create the name first), the same path for every up/down/exec/status, and gone
#     after a reboot, as are the namespaces and daemons it describes. Every directory above it must
#     be root's and not group/world writable, which sshd's StrictModes also demands of the
#     directories above authorized_keys;
#   - `up` makes it fresh (mkdir, root, mode 0711) or accepts it only as `up` made it: a directory,
#     not a symlink, owned by root with mode 0711; anything else is refused in one line, before
#     anything is installed, created or started, and so are `down`, `exec` and `status`. 0711 and
#     not 0700: slurmctld (user slurm) and munged (user munge) must reach their subdirectories;
#     nobody else can list it or create anything in it;
#   - every subdirectory is made by root with an exact owner and mode (checked the same way when
#     it exists): ssh/ is root's 0700 and its key pair is generated there by `up`, never taken from
#     elsewhere. Only slurm/ctld (slurmctld's state) and munge/ belong to those users, and root
#     writes nothing into them (the munge key is written as user munge);
#   - nothing is written under a fixed name in /tmp: the lock is this script itself, the apt log
#     and the new /etc/hosts come from mktemp.
#
# Environment knobs:
#   HVDTRAIN_CLUSTER_DIR      state directory (default /run/hvdtrain-cluster; an absolute path whose
#                             parent exists and is root's); removed by down
#   HVDTRAIN_CLUSTER_TIMEOUT  seconds to wait for each daemon / the nodes (default 60)
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname -- "$(readlink -f "$0")")/lib.sh"
use_knobs HVDTRAIN_CLUSTER /run/hvdtrain-cluster
PACKAGES+=(openssh-server openssh-client iproute2)
PROGRAMS+=(ip nsenter unshare ssh ssh-keygen sshd)
HOSTS_BEGIN="# BEGIN hvdtrain tests/cluster/cluster-local.sh"
HOSTS_END="# END hvdtrain tests/cluster/cluster-local.sh"
SSH_CLIENT_CONF=/etc/ssh/ssh_config.d/hvdtrain-cluster.conf
BRIDGE=hvdt-br0
SUBNET=10.77.0
ISOLATED_SUBNET=10.78.0
HOST_ADDR=$SUBNET.1
DEFAULT_NODES=2

# Its Slurm: slurmctld on the host's bridge address, ports of its own, configuration in the state
# directory (clients need SLURM_CONF), a TmpFS per node.
CONF_DIR=$STATE_DIR/slurm
SLURM_CONF_FILE=$CONF_DIR/slurm.conf
CLUSTER_NAME=hvdtcluster
CTLD_ADDR=$HOST_ADDR
CTLD_PORT=6917
SLURMD_PORT=6918
# Each node's TmpFS, where Slurm's PMIx plugin keeps a job step's files for the node: under /tmp
# as on a real node (Slurm's default TmpFS), so that a container sharing the node's /tmp (ch-run)
# sees them; one directory per node, since the nodes here share one /tmp. up makes its parent
# with mktemp (a name nobody could have planted) and records it in tmpfs-root; down removes it.
TMPFS_RECORD=$STATE_DIR/tmpfs-root
TMPFS_PATTERN="/tmp/$(basename -- "$STATE_DIR")-tmpfs.XXXXXX"
# Its own subdirectories, beside lib.sh's: ns/ holds the nodes' UTS namespaces, ssh/ the keys.
OWN_SUBDIRS=("ns root 755" "ssh root 700")

# The TmpFS parent up made, if tmpfs-root names one: a directory of root's that matches the
# pattern (the record lives in the checked state directory; the check keeps a bad one harmless).
recorded_tmpfs_root() {
  local path
  path=$(cat "$TMPFS_RECORD" 2>/dev/null) || return 0
  [[ $path == "${TMPFS_PATTERN%XXXXXX}"?????? && -d $path && ! -L $path \
     && $(stat -c %u -- "$path") == 0 ]] && printf '%s\n' "$path"
  return 0
}

netns_of() { printf 'hvdt-%s\n' "$1"; }
veth_of() { printf 'hvdt-v%s\n' "${1#node}"; }
dead_end_of() { printf 'hvdt-x%s\n' "${1#node}"; }
addr_of() { printf '%s.%d\n' "$SUBNET" $((10 + ${1#node})); }
uts_of() { printf '%s/ns/%s.uts\n' "$STATE_DIR" "$1"; }

# The node count of the running cluster (0 when there is none).
recorded_nodes() { cat "$STATE_DIR/nodes" 2>/dev/null || echo 0; }
node_names() { # node_names N
  local k
  for ((k = 1; k <= $1; k++)); do printf 'node%d\n' "$k"; done
}

# in_node NODE CMD...: CMD in the node's network and UTS namespaces (same file system).
in_node() {
  local node=$1
  shift
  nsenter --net="/var/run/netns/$(netns_of "$node")" --uts="$(uts_of "$node")" "$@"
}
# node_prefix NODE: the same as words, for commands that must exec (setsid, exec).
node_prefix() { printf '%s\n' nsenter "--net=/var/run/netns/$(netns_of "$1")" "--uts=$(uts_of "$1")"; }

# --- CPUs (--pin-cpus) -----------------------------------------------------------------------------
# allowed_cpus: the CPUs this script may use, one per line (Cpus_allowed_list, e.g. 0-3,6).
allowed_cpus() {
  local part
  for part in $(awk '/^Cpus_allowed_list:/ {print $2}' /proc/self/status | tr ',' ' '); do
    if [[ $part == *-* ]]; then seq "${part%-*}" "${part#*-}"; else echo "$part"; fi
  done
}
# node_cpus NODE: the CPU list NODE's processes run on (all allowed ones unless pinned).
node_cpus() {
  local cpus
  mapfile -t cpus < <(allowed_cpus)
  if [[ $(cat "$STATE_DIR/pin-cpus" 2>/dev/null || echo 0) == 1 ]]; then
    echo "${cpus[$(((${1#node} - 1) % ${#cpus[@]}))]}"
  else
    (IFS=,; echo "${cpus[*]}")
  fi
}
# pin_node_daemons NODE: NODE's sshd and slurmd (all their threads) on the node's CPUs; what they
# start later inherits it.
pin_node_daemons() {
  local name pid
  for name in sshd slurmd; do
    if pid=$(our_pid "$name-$1" "$name"); then
      taskset -a -p -c "$(node_cpus "$1")" "$pid" >/dev/null
    fi
  done
}

# --- network -------------------------------------------------------------------------------------
check_subnet_free() {
  local used
  used=$(ip -o -4 addr show | awk -v s="$SUBNET." -v b="$BRIDGE" 'index($4, s) == 1 && $2 != b {print $2}')
  [[ -z $used ]] || die "$SUBNET.0/24 is already used on this machine (interface $used); not ours"
}

ensure_bridge() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip addr replace "$HOST_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
}

ensure_node_net() { # ensure_node_net NODE ISOLATED(0|1)
  local node=$1 isolated=$2 ns veth uts
  ns=$(netns_of "$node")
  veth=$(veth_of "$node")
  uts=$(uts_of "$node")
  [[ -e /var/run/netns/$ns ]] || ip netns add "$ns"
  ip -n "$ns" link set lo up
  if ! ip link show "$veth" >/dev/null 2>&1; then
    ip link add "$veth" type veth peer name eth0 netns "$ns"
  fi
  ip link set "$veth" master "$BRIDGE" up
  ip -n "$ns" addr replace "$(addr_of "$node")/24" dev eth0
  ip -n "$ns" link set eth0 up
  local dead_end
  dead_end=$(dead_end_of "$node")
  if ((isolated)); then
    # eth1's other end sits in the host with no address and no bridge: what a node sends there
    # (ARP included) reaches nobody, yet the subnet looks the same on every node.
    if ! ip link show "$dead_end" >/dev/null 2>&1; then
      ip link add "$dead_end" type veth peer name eth1 netns "$ns"
    fi
    ip link set "$dead_end" up
    ip -n "$ns" addr replace "$ISOLATED_SUBNET.$((10 + ${node#node}))/24" dev eth1
    ip -n "$ns" link set eth1 up
  elif ip link show "$dead_end" >/dev/null 2>&1; then
    ip link del "$dead_end"
  fi
  if ! mountpoint -q "$uts" 2>/dev/null && ! grep -qF " $uts " /proc/self/mountinfo; then
    : >"$uts"
    unshare --uts="$uts" hostname "$node"
  fi
  [[ $(in_node "$node" hostname) == "$node" ]] || in_node "$node" hostname "$node"
}

hosts_block() {
  local n=$1 node
  printf '%s\n' "$HOSTS_BEGIN"
  while read -r node; do printf '%s %s\n' "$(addr_of "$node")" "$node"; done < <(node_names "$n")
  printf '%s\n' "$HOSTS_END"
}

hosts_without_block() {
  awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1; next} $0 == e {skip = 0; next} !skip' /etc/hosts
}

# /etc/hosts may be a bind mount: rewrite it in place, never replace the file.
write_hosts() { # write_hosts N (0: remove the block)
  local tmp
  tmp=$(mktemp)
  hosts_without_block >"$tmp"
  ((${1} > 0)) && hosts_block "$1" >>"$tmp"
  cmp -s "$tmp" /etc/hosts || cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}

# --- ssh -----------------------------------------------------------------------------------------
gen_sshd_config() {
  cat <<EOF
$MARKER
# ListenAddress, HostKey and PidFile are given per node on the command line.
Port 22
AuthorizedKeysFile $STATE_DIR/ssh/authorized_keys
# authorized_keys and every directory above it are root's and not group/world writable (checked by
# up before anything starts), as StrictModes demands.
StrictModes yes
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
X11Forwarding no
PrintMotd no
PrintLastLog no
AcceptEnv LANG LC_*
MaxStartups 100:30:200
MaxSessions 100
EOF
}

gen_ssh_client_config() {
  cat <<EOF
$MARKER
# Plain \`ssh nodeK\` for the local test cluster; removed by \`tests/cluster/cluster-local.sh down\`.
Host $(node_names "$1" | tr '\n' ' ')
    User root
    IdentityFile $STATE_DIR/ssh/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE_DIR/ssh/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    LogLevel ERROR
EOF
}

# own_key PATH: PATH (a private key) and PATH.pub are plain files of root's in $STATE_DIR/ssh (root's,
# 0700, checked by prepare_state_dir: so made by an earlier up) and the two belong together; else
# both are removed, to be generated again.
own_key() {
  local key=$1
  if [[ -f $key && ! -L $key && -f $key.pub && ! -L $key.pub &&
    $(stat -c %u -- "$key") == 0 && $(stat -c %u -- "$key.pub") == 0 ]] &&
    [[ $(ssh-keygen -y -f "$key" 2>/dev/null | cut -d' ' -f1-2) == "$(cut -d' ' -f1-2 "$key.pub")" ]]; then
    chmod 0600 -- "$key"
    chmod 0600 -- "$key.pub"
    return 0
  fi
  rm -f -- "$key" "$key.pub"
  return 1
}

prepare_ssh() { # prepare_ssh N
  local n=$1 node key old_umask
  old_umask=$(umask)
  umask 077
  own_key "$STATE_DIR/ssh/id_ed25519" ||
    ssh-keygen -q -t ed25519 -N '' -C hvdtrain-cluster -f "$STATE_DIR/ssh/id_ed25519"
  # Exactly the one key just made or checked; written aside and renamed over, not appended to.
  install -m 0600 "$STATE_DIR/ssh/id_ed25519.pub" "$STATE_DIR/ssh/authorized_keys.new"
  mv -f -- "$STATE_DIR/ssh/authorized_keys.new" "$STATE_DIR/ssh/authorized_keys"
  : >"$STATE_DIR/ssh/known_hosts.new"
  while read -r node; do
    key=$STATE_DIR/ssh/host-${node}_ed25519_key
    own_key "$key" || ssh-keygen -q -t ed25519 -N '' -C "$node" -f "$key"
    printf '%s,%s %s\n' "$node" "$(addr_of "$node")" "$(cut -d' ' -f1-2 "$key.pub")" \
      >>"$STATE_DIR/ssh/known_hosts.new"
  done < <(node_names "$n")
  chmod 0644 "$STATE_DIR/ssh/known_hosts.new"
  mv -f "$STATE_DIR/ssh/known_hosts.new" "$STATE_DIR/ssh/known_hosts"
  if ! cmp -s "$STATE_DIR/ssh/sshd_config" <(gen_sshd_config); then
    gen_sshd_config >"$STATE_DIR/ssh/sshd_config"
    # sshds running with an older configuration start again with the new one.
    local pid
    for node in $(ls "$STATE_DIR/pids" | sed -n 's/^sshd-\(node[0-9]*\)\.pid$/\1/p'); do
      if pid=$(our_pid "sshd-$node" sshd); then stop_pid "$pid" sshd 5; fi
    done
  fi
  if [[ -e $SSH_CLIENT_CONF ]] && ! ours "$SSH_CLIENT_CONF"; then
    die "$SSH_CLIENT_CONF exists and was not written by this script"
  fi
  install -d -m 0755 "$(dirname "$SSH_CLIENT_CONF")"
  gen_ssh_client_config "$n" >"$SSH_CLIENT_CONF"
  chmod 0644 "$SSH_CLIENT_CONF"
  umask "$old_umask"
  # sshd's privilege separation directory (systemd would create it; nothing does here).
  if [[ ! -d /run/sshd ]]; then
    install -d -m 0755 /run/sshd
    touch "$STATE_DIR/made-run-sshd"
  fi
}

start_sshd() { # start_sshd NODE
  local node=$1
  our_pid "sshd-$node" sshd >/dev/null && return 0
  local prefix
  mapfile -t prefix < <(node_prefix "$node")
  launch "sshd-$node" sshd "${prefix[@]}" /usr/sbin/sshd -D -e -f "$STATE_DIR/ssh/sshd_config" \
    -o "ListenAddress=$(addr_of "$node")" -o "HostKey=$STATE_DIR/ssh/host-${node}_ed25519_key" \
    -o "PidFile=$STATE_DIR/slurm/run/sshd-$node.pid"
}

# ssh_ok FROM TO: FROM reaches TO with plain `ssh TO`.
ssh_ok() { timeout 20 "$SCRIPT" exec "$1" ssh -o ConnectTimeout=5 "$2" true >/dev/null 2>&1; }

# --- up / down / status --------------------------------------------------------------------------
cmd_up() {
  local n=$DEFAULT_NODES isolated=0 pin=0
  while (($#)); do
    case $1 in
      --nodes) n=${2:-}; shift 2 || die "--nodes needs a number" ;;
      --nodes=*) n=${1#--nodes=}; shift ;;
      --isolated-iface) isolated=1; shift ;;
      --pin-cpus) pin=1; shift ;;
      *) die "up: unknown option $1 (usage: up [--nodes N] [--isolated-iface] [--pin-cpus])" ;;
    esac
  done
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 200)) || die "--nodes must be 1..200, got '$n'"
  [[ $(id -u) -eq 0 ]] || die "up must run as root (it creates network namespaces and runs sshd/slurmd)"
  take_lock
  # Before anything is read from, installed, created or started: a state directory not made by up
  # (someone else's, writable by others, a symlink) is refused in one line.
  check_state_dir
  local old
  old=$(recorded_nodes)
  if ((old != 0 && old != n)); then
    say "resizing from $old to $n node(s): taking the old cluster down first"
    down_locked
  fi
  install_packages
  [[ -e /var/run/netns/$(netns_of node1) ]] || check_subnet_free
  prepare_state_dir "${OWN_SUBDIRS[@]}"
  echo "$n" >"$STATE_DIR/nodes"
  echo "$isolated" >"$STATE_DIR/isolated"

  ensure_bridge
  local node
  while read -r node; do ensure_node_net "$node" "$isolated"; done < <(node_names "$n")
  write_hosts "$n"

  prepare_ssh "$n"
  while read -r node; do start_sshd "$node"; done < <(node_names "$n")

  start_munge
  local nodes=() node_addrs=() prefix
  mapfile -t nodes < <(node_names "$n")
  for node in "${nodes[@]}"; do node_addrs+=("$node" "$(addr_of "$node")"); done
  local tmpfs_root
  tmpfs_root=$(recorded_tmpfs_root)
  if [[ -z $tmpfs_root ]]; then
    tmpfs_root=$(mktemp -d "$TMPFS_PATTERN")
    chmod 755 "$tmpfs_root"
    echo "$tmpfs_root" >"$TMPFS_RECORD"
  fi
  NODE_TMPFS=$tmpfs_root/%n
  configure_slurm "${node_addrs[@]}"
  start_slurmctld
  for node in "${nodes[@]}"; do
    ensure_dir "$tmpfs_root/$node" root 1777
    mapfile -t prefix < <(node_prefix "$node")
    start_slurmd "$node" "${prefix[@]}"
  done
  echo "$pin" >"$STATE_DIR/pin-cpus"
  for node in "${nodes[@]}"; do pin_node_daemons "$node"; done
  wait_nodes "${nodes[@]}"

  local end=$((SECONDS + TIMEOUT))
  while read -r node; do
    until ssh_ok node1 "$node"; do
      ((SECONDS < end)) || fail "ssh node1 -> $node does not work" "$STATE_DIR/log/sshd-$node.stdout"
      sleep 0.3
    done
  done < <(node_names "$n")
  say "up: $n node(s) ($(node_names "$n" | tr '\n' ' ')) on $BRIDGE $SUBNET.0/24$( ((isolated)) && echo ", eth1 in $ISOLATED_SUBNET.0/24 on each (connects nothing)")$( ((pin)) && echo ", one CPU each"); Slurm: SLURM_CONF=$SLURM_CONF_FILE"
}

# kill_node_processes NODE: everything still running in the node's network namespace.
kill_node_processes() {
  local ns pids
  ns=$(netns_of "$1")
  [[ -e /var/run/netns/$ns ]] || return 0
  pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
  [[ -n ${pids// /} ]] || return 0
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  local i
  for ((i = 0; i < 25; i++)); do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [[ -n ${pids// /} ]] || return 0
    sleep 0.2
  done
  warn "killing what is left on $1: $pids"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  sleep 0.3
}

# del_link LINK: LINK gone. Deleting a namespace takes its veth pairs with it, a moment later:
# the link can vanish between `show` and `del` (seen: "Cannot find device" failing down).
del_link() {
  ip link show "$1" >/dev/null 2>&1 || return 0
  ip link del "$1" 2>/dev/null && return 0
  ! ip link show "$1" >/dev/null 2>&1 || die "could not delete link $1"
}

down_locked() {
  local n node pid ns uts
  n=$(recorded_nodes)
  # Every node this script could have made, also when the node count was lost.
  local nodes
  nodes=$( (node_names "$n"; ip netns list 2>/dev/null | awk '{print $1}' | sed -n 's/^hvdt-\(node[0-9]\+\)$/\1/p') | sort -u)
  if [[ -e $STATE_DIR/$STATE_MARKER ]] && our_pid slurmctld >/dev/null; then cancel_jobs; fi
  for node in $nodes; do
    if pid=$(our_pid "slurmd-$node" slurmd); then stop_pid "$pid" slurmd 10; fi
    if pid=$(our_pid "sshd-$node" sshd); then stop_pid "$pid" sshd 5; fi
    kill_node_processes "$node"
  done
  if pid=$(our_pid slurmctld); then stop_pid "$pid" slurmctld 20; fi
  if pid=$(our_pid munged); then stop_pid "$pid" munged 10; fi
  for node in $nodes; do
    ns=$(netns_of "$node")
    uts=$(uts_of "$node")
    if grep -qF " $uts " /proc/self/mountinfo 2>/dev/null; then umount "$uts" 2>/dev/null || umount -l "$uts" || true; fi
    [[ -e /var/run/netns/$ns ]] && ip netns del "$ns"
    del_link "$(veth_of "$node")"
    del_link "$(dead_end_of "$node")"
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
  grep -qxF "$HOSTS_BEGIN" /etc/hosts && write_hosts 0
  if ours "$SSH_CLIENT_CONF"; then rm -f "$SSH_CLIENT_CONF"; fi
  if [[ -e $STATE_DIR/made-run-sshd ]]; then rmdir /run/sshd 2>/dev/null || true; fi
  local tmpfs_root
  tmpfs_root=$(recorded_tmpfs_root)
  [[ -n $tmpfs_root ]] && rm -rf --one-file-system -- "$tmpfs_root"
  remove_state_dir
}

cmd_down() {
  [[ $(id -u) -eq 0 ]] || die "down must run as root"
  take_lock
  # Its pid files name what down kills: only from a directory up made.
  check_state_dir
  down_locked
  say "down: no namespace, link, daemon, /etc entry or state of this script is left"
}

cmd_status() {
  local n node problems="" pid problem
  problem=$(state_dir_problem)
  if [[ -n $problem ]]; then
    warn "$problem"
    return 3
  fi
  n=$(recorded_nodes)
  if ((n == 0)); then
    say "down (no cluster; run: tests/cluster/cluster-local.sh up)"
    return 3
  fi
  ip link show "$BRIDGE" >/dev/null 2>&1 || problems+=" no bridge $BRIDGE;"
  our_pid munged >/dev/null || problems+=" munged not running;"
  our_pid slurmctld >/dev/null || problems+=" slurmctld not running;"
  while read -r node; do
    [[ -e /var/run/netns/$(netns_of "$node") ]] || { problems+=" $node: no namespace;"; continue; }
    our_pid "sshd-$node" sshd >/dev/null || problems+=" $node: sshd not running;"
    our_pid "slurmd-$node" slurmd >/dev/null || problems+=" $node: slurmd not running;"
  done < <(node_names "$n")
  if [[ -z $problems ]]; then
    slurm sinfo -N -o '%N %P %T %c %m %G' || true
    slurm squeue || true
    while read -r node; do
      node_usable "$node" || problems+=" $node is $(node_state "$node") in Slurm;"
      ssh_ok node1 "$node" || problems+=" ssh node1 -> $node fails;"
    done < <(node_names "$n")
  fi
  if [[ -n $problems ]]; then
    say "degraded:$problems (run: tests/cluster/cluster-local.sh up)"
    return 3
  fi
  say "up: $n node(s); SLURM_CONF=$SLURM_CONF_FILE"
}

cmd_exec() {
  local node=${1:-}
  [[ -n $node ]] || die "usage: exec NODE CMD..."
  shift
  (($#)) || die "usage: exec NODE CMD..."
  [[ $node =~ ^node[0-9]+$ && -e /var/run/netns/$(netns_of "$node") ]] ||
    die "no node '$node' (nodes: $(node_names "$(recorded_nodes)" | tr '\n' ' '); run: tests/cluster/cluster-local.sh up)"
  [[ $(id -u) -eq 0 ]] || die "exec must run as root (it enters the node's namespaces)"
  check_state_dir
  local prefix
  mapfile -t prefix < <(node_prefix "$node")
  exec "${prefix[@]}" taskset -c "$(node_cpus "$node")" env SLURM_CONF="$SLURM_CONF_FILE" "$@"
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) rc=0; cmd_status || rc=$?; exit "$rc" ;;
  exec) shift; cmd_exec "$@" ;;
  env) printf 'export SLURM_CONF=%s\n' "$SLURM_CONF_FILE" ;;
  -h | --help) print_help ;;
  *)
    printf 'usage: %s up [--nodes N] [--isolated-iface] [--pin-cpus] | down | status | exec NODE CMD... | env (--help: what each does)\n' "$0" >&2
    exit 2
    ;;
esac
