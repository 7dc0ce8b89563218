# shellcheck shell=bash
# What the two local test clusters have in common, sourced by cluster-local.sh (N nodes in network
# namespaces) and slurm-local.sh (one node, this machine): messages, the root-owned state
# directory, daemon bookkeeping, packages, their own munged, and Slurm's configuration, start and wait.
# Not run on its own.
#
# The sourcing script names its knobs with use_knobs (STATE_DIR, STATE_DIR_KNOB, TIMEOUT), may add
# to PACKAGES and PROGRAMS, and sets what gen_slurm_conf writes: CONF_DIR (where slurm.conf,
# gres.conf and cgroup.conf go), CLUSTER_NAME, CTLD_ADDR and, when they are not Slurm's defaults,
# CTLD_PORT and SLURMD_PORT, and NODE_TMPFS when the nodes share /tmp. What it is called
# follows from its file name, tests/cluster/NAME.sh:
#   SCRIPT_NAME     NAME: its messages begin "[NAME] ..." (stdout) or "NAME: ..." (stderr)
#   SCRIPT          its own path, resolved: the lock, and "run: $SCRIPT down"
#   MARKER          the first line of every file it writes (a file without it is not its own)
#   STATE_MARKER    the file that marks a state directory as made by its `up`
#
# The state directory (see the scripts' headers for why) is root's with mode 0711, made fresh by
# `up` or accepted only as `up` made it; every subdirectory is made by root with an exact owner and
# mode. Its layout, for both scripts:
#   pids/         pid files of the daemons started here (launch, our_pid)
#   log/          their logs; NAME.stdout is what a daemon printed
#   fake-gpu/     nvidia0..3, plain files standing in for four GPUs per node (gres.conf)
#   slurm/        spool/NODE (slurmd's), run/ (Slurm's pid files), ctld/ (slurmctld's state, user
#                 slurm); the configuration too when it is the cluster's own (CONF_DIR)
#   munge/        munged's key, socket, pid, log and seed, all written as user munge; 0755 because
#                 slurmctld (user slurm) and every client must reach the socket

SCRIPT=$(readlink -f "$0")
SCRIPT_NAME=$(basename -- "$SCRIPT" .sh)
MARKER="# managed by hvdtrain tests/cluster/$SCRIPT_NAME.sh"
STATE_MARKER=.hvdtrain-$SCRIPT_NAME
STATE_DIR_MODE=711
# What install_packages installs, and the programs that prove it installed.
PACKAGES=(slurm-wlm munge)
PROGRAMS=(slurmctld slurmd sinfo srun sbatch scontrol munged munge unmunge)
PARTITION=debug
CTLD_PORT=6817
SLURMD_PORT=6818
NODE_TMPFS=""

say() { printf '[%s] %s\n' "$SCRIPT_NAME" "$*"; }
warn() { printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2; }
die() { warn "$*"; exit 1; }
fail() { # fail MESSAGE LOGFILE...: the message, then the last lines of each log
  local f
  warn "$1"
  shift
  for f in "$@"; do
    [[ -s $f ]] || continue
    printf -- '----- last lines of %s -----\n' "$f" >&2
    tail -n 40 "$f" >&2 || true
  done
  exit 1
}

# print_help: the script's header comment, its manual.
print_help() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; }

# ours FILE: FILE exists and its first line is $MARKER (this script wrote it).
ours() { [[ -e $1 ]] && head -n 1 -- "$1" | grep -qxF "$MARKER"; }

take_lock() {
  # The lock is the script itself: nothing is left behind, nothing is written in /tmp.
  exec 9<"$SCRIPT"
  flock -w 300 9 || die "another $SCRIPT_NAME.sh up/down is still running (lock: $SCRIPT)"
}

# use_knobs PREFIX DEFAULT_STATE_DIR: the environment knobs PREFIX_DIR, the state directory
# (STATE_DIR, default DEFAULT_STATE_DIR), and PREFIX_TIMEOUT, seconds to wait for each daemon / the
# nodes (TIMEOUT, default 60). STATE_DIR must be absolute; its parent is taken without symlinks
# (/var/run -> /run), so that the path state_dir_problem checks is the path that is used.
use_knobs() {
  local timeout_knob=$1_TIMEOUT parent
  STATE_DIR_KNOB=$1_DIR
  STATE_DIR=${!STATE_DIR_KNOB:-$2}
  TIMEOUT=${!timeout_knob:-60}
  [[ $STATE_DIR == /* ]] || die "$STATE_DIR_KNOB must be an absolute path, got '$STATE_DIR'"
  if parent=$(realpath -e -- "$(dirname -- "$STATE_DIR")" 2>/dev/null); then
    STATE_DIR=${parent%/}/$(basename -- "$STATE_DIR")
  fi
}

# --- state directory (root's, made fresh, refused in one line otherwise) -------------------------

# state_dir_problem: why $STATE_DIR must not be used, as one line; nothing when it may be (also
# when it does not exist yet and may be made).
state_dir_problem() {
  local dir name uid user mode kind
  name=$(basename -- "$STATE_DIR")
  if [[ $name == / || $name == . || $name == .. ]]; then
    echo "refusing state directory '$STATE_DIR': not a directory name; set $STATE_DIR_KNOB to a new path under /run"
    return
  fi
  dir=$(dirname -- "$STATE_DIR")
  if [[ ! -d $dir ]]; then
    echo "refusing state directory $STATE_DIR: its parent $dir does not exist; create it (root's, not group/world writable) or set $STATE_DIR_KNOB elsewhere"
    return
  fi
  while :; do
    # Owner and mode of the path itself (stat without -L does not follow a symlink).
    if ! read -r uid user mode < <(stat -c '%u %U %a' -- "$dir" 2>/dev/null); then
      echo "refusing state directory $STATE_DIR: cannot stat its parent $dir"
      return
    fi
    if [[ $uid != 0 ]] || ((8#$mode & 8#022)); then
      echo "refusing state directory $STATE_DIR: its parent $dir is owned by $user (uid $uid) with mode $mode, not by root without group/world write; set $STATE_DIR_KNOB to a path under a root-only directory such as /run"
      return
    fi
    [[ $dir == / ]] && break
    dir=$(dirname -- "$dir")
  done
  [[ -e $STATE_DIR || -L $STATE_DIR ]] || return 0
  read -r uid user mode kind < <(stat -c '%u %U %a %F' -- "$STATE_DIR")
  if [[ $kind != directory ]]; then
    echo "refusing state directory $STATE_DIR: it is a $kind owned by $user (uid $uid), not a directory made by this script; remove it (rm -- $STATE_DIR) and run up again"
  elif [[ $uid != 0 || $mode != "$STATE_DIR_MODE" ]]; then
    echo "refusing state directory $STATE_DIR: owned by $user (uid $uid) with mode $mode, not by root with mode $STATE_DIR_MODE, so not made by this script; remove it (rm -rf -- $STATE_DIR) and run up again"
  fi
}
check_state_dir() {
  local problem
  problem=$(state_dir_problem)
  [[ -z $problem ]] || die "$problem"
}

# check_dir PATH USER MODE: refuse (one line) PATH unless it is missing or a directory (not a
# symlink) of USER with exactly MODE.
check_dir() {
  local path=$1 user=$2 mode=$3 uid have
  uid=$(id -u "$user")
  if [[ -L $path || (-e $path && ! -d $path) ]]; then
    die "refusing $path: a $(stat -c %F -- "$path"), not a directory made by this script; run: $SCRIPT down, then up"
  elif [[ -d $path ]]; then
    have=$(stat -c '%u %a' -- "$path")
    [[ $have == "$uid $mode" ]] ||
      die "refusing $path: owner uid ${have% *} with mode ${have#* }, not $user ($uid) with mode $mode; run: $SCRIPT down, then up"
  fi
  return 0
}
# ensure_dir PATH USER MODE: PATH a directory of USER (and USER's group) with MODE: made when
# missing, refused in one line when it exists otherwise.
ensure_dir() {
  check_dir "$@"
  [[ -d $1 ]] && return 0
  mkdir -m 0700 -- "$1"
  chown -- "$2:$(id -g "$2")" "$1"
  chmod -- "$3" "$1"
}

# The subdirectories of the layout above: path, owner, mode (parents first).
SLURM_STATE_SUBDIRS=(
  "pids root 755" "log root 755" "fake-gpu root 755" "slurm root 755" "slurm/spool root 755"
  "slurm/run root 755" "slurm/ctld slurm 755" "munge munge 755"
)

# prepare_state_dir [ENTRY...]: $STATE_DIR with the layout above plus the script's own
# subdirectories, each ENTRY "PATH OWNER MODE".
prepare_state_dir() {
  local entries=("${SLURM_STATE_SUBDIRS[@]}" "$@") entry d user mode i
  # Everything checked before anything is made.
  check_state_dir
  for entry in "${entries[@]}"; do
    read -r d user mode <<<"$entry"
    check_dir "$STATE_DIR/$d" "$user" "$mode"
  done
  # Made fresh: mkdir fails if anything took the name since the check (only root could: the
  # parent is root's).
  [[ -d $STATE_DIR ]] || mkdir -m "$STATE_DIR_MODE" -- "$STATE_DIR"
  [[ -e $STATE_DIR/$STATE_MARKER ]] || : >"$STATE_DIR/$STATE_MARKER"
  for entry in "${entries[@]}"; do
    read -r d user mode <<<"$entry"
    ensure_dir "$STATE_DIR/$d" "$user" "$mode"
  done
  for i in 0 1 2 3; do
    [[ -e $STATE_DIR/fake-gpu/nvidia$i ]] || : >"$STATE_DIR/fake-gpu/nvidia$i"
  done
}

# remove_state_dir: $STATE_DIR gone, if `up` made it.
remove_state_dir() {
  [[ -e $STATE_DIR/$STATE_MARKER ]] || return 0
  case $STATE_DIR in
    / | /var | /var/tmp | /tmp | /etc | /usr | /root | /home | /run | /var/lib | /var/run) die "refusing to remove $STATE_DIR" ;;
  esac
  rm -rf --one-file-system -- "$STATE_DIR"
}

# --- process bookkeeping (pid files in $STATE_DIR/pids) ------------------------------------------
pid_file() { printf '%s/pids/%s.pid\n' "$STATE_DIR" "$1"; }

# our_pid NAME [COMM]: the recorded pid of NAME if that process is alive and runs COMM (default
# NAME).
our_pid() {
  local f pid comm=${2:-$1}
  f=$(pid_file "$1")
  [[ -r $f ]] || return 1
  pid=$(tr -dc '0-9' <"$f")
  [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null || true) == "$comm" ]] || return 1
  # A zombie (exited, not yet reaped) is not running.
  [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true) != Z ]] || return 1
  printf '%s\n' "$pid"
}

# stop_pid PID COMM GRACE: SIGTERM, wait up to GRACE seconds, then SIGKILL.
stop_pid() {
  local pid=$1 comm=$2 grace=$3 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < grace * 5; i++)); do
    [[ $(cat "/proc/$pid/comm" 2>/dev/null || true) == "$comm" ]] || return 0
    sleep 0.2
  done
  warn "$comm (pid $pid) did not exit after ${grace}s; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  sleep 0.5
}

# launch NAME COMM CMD...: start CMD (a daemon in the foreground, which becomes COMM once
# setsid/nsenter/env have exec'd it) in a session of its own, record its pid.
launch() {
  local name=$1 comm=$2 pid i
  shift 2
  # 9>&-: the daemon must not keep holding the script's lock.
  setsid "$@" </dev/null >>"$STATE_DIR/log/$name.stdout" 2>&1 9>&- &
  pid=$!
  # Until then the pid's name is not COMM, and our_pid would report it as gone (seen: "slurmd
  # exited" while slurmd was starting).
  for ((i = 0; i < 50; i++)); do
    [[ $(cat "/proc/$pid/comm" 2>/dev/null || true) == "$comm" ]] && break
    sleep 0.1
  done
  printf '%s\n' "$pid" >"$(pid_file "$name")"
  say "started $name (pid $pid)"
}

# --- packages ------------------------------------------------------------------------------------
have_programs() {
  local p
  for p in "${PROGRAMS[@]}"; do
    command -v "$p" >/dev/null 2>&1 || [[ -x /usr/sbin/$p ]] || return 1
  done
}

# install_packages: PACKAGES installed with apt-get when any of PROGRAMS is missing (as non-root:
# the command to run, exit 1); then users slurm and munge must exist.
install_packages() {
  local user
  have_programs || apt_install
  for user in slurm munge; do
    id "$user" >/dev/null 2>&1 || die "user $user does not exist (are ${PACKAGES[*]} installed?)"
  done
}

apt_install() {
  local cmd="apt-get install -y --no-install-recommends ${PACKAGES[*]}"
  [[ $(id -u) -eq 0 ]] || die "${PACKAGES[*]} are not all installed; run as root: $cmd"
  command -v apt-get >/dev/null 2>&1 || die "apt-get is missing; install: ${PACKAGES[*]}"
  # Keep the packages' maintainer scripts from starting daemons (with or without systemd): the
  # script runs them itself, with its own configuration.
  local policy=/usr/sbin/policy-rc.d own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\n%s\nexit 101\n' "$MARKER" >"$policy"
    chmod 0755 "$policy"
    own_policy=1
    # shellcheck disable=SC2064 # expand now: remove exactly this file, also when interrupted
    trap "head -n 2 '$policy' 2>/dev/null | grep -qxF '$MARKER' && rm -f '$policy'" EXIT
  fi
  local rc=0 log attempt
  log=$(mktemp -t "hvdtrain-$SCRIPT_NAME-apt.XXXXXX.log")
  say "installing ${PACKAGES[*]} with apt-get (log: $log)"
  for attempt in 1 2; do
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120 update -qq >>"$log" 2>&1 || rc=$?
    if ((rc == 0)); then
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120 install -y -qq \
        --no-install-recommends "${PACKAGES[@]}" >>"$log" 2>&1 || rc=$?
    fi
    ((rc == 0)) && break
    warn "apt-get failed (attempt $attempt, exit $rc)"
    sleep 5
  done
  if ((own_policy)) && head -n 2 "$policy" 2>/dev/null | grep -qxF "$MARKER"; then
    rm -f "$policy"
    trap - EXIT
  fi
  ((rc == 0)) || fail "could not install ${PACKAGES[*]} (apt-get exit $rc)" "$log"
  have_programs || fail "installed ${PACKAGES[*]} but programs are still missing" "$log"
  rm -f "$log"
}

# --- munge (own key and socket in $STATE_DIR/munge: no other munged is needed or touched) --------
munge_socket() { printf '%s/munge/munge.socket\n' "$STATE_DIR"; }
munge_works() {
  local socket
  socket=$(munge_socket)
  timeout 10 munge -S "$socket" -n 2>/dev/null | timeout 10 unmunge -S "$socket" >/dev/null 2>&1
}

start_munge() {
  munge_works && our_pid munged >/dev/null && return 0
  local key=$STATE_DIR/munge/munge.key socket end
  socket=$(munge_socket)
  # munge/ is munge's: what is written in it is written as munge, never by root.
  local as_munge=(setpriv --reuid=munge --regid=munge --init-groups)
  if ! "${as_munge[@]}" test -s "$key"; then
    # shellcheck disable=SC2016 # $1 is the inner shell's
    "${as_munge[@]}" sh -c 'umask 0277 && rm -f -- "$1" && dd if=/dev/urandom of="$1" bs=1024 count=1 status=none' \
      sh "$key"
  fi
  rm -f "$socket" "$socket.lock"
  # No --force: munged's own checks of its key and directories (and all above them) must pass.
  launch munged munged "${as_munge[@]}" /usr/sbin/munged -F --socket="$socket" \
    --key-file="$key" --pid-file="$STATE_DIR/munge/munged.pid" \
    --log-file="$STATE_DIR/munge/munged.log" --seed-file="$STATE_DIR/munge/munged.seed"
  end=$((SECONDS + TIMEOUT))
  until munge_works; do
    ((SECONDS < end)) || fail "munged did not come up within ${TIMEOUT}s" \
      "$STATE_DIR/log/munged.stdout" "$STATE_DIR/munge/munged.log"
    sleep 0.2
  done
}

# --- Slurm configuration -------------------------------------------------------------------------
# host_name: this machine's short host name (slurmctld's host).
host_name() {
  local n
  n=$(hostname -s 2>/dev/null || true)
  [[ -n $n ]] || n=$(hostname)
  printf '%s\n' "$n"
}

# gen_slurm_conf NODE ADDR [NODE ADDR]...: slurm.conf for these nodes, one slurmctld on this
# machine at $CTLD_ADDR. What it configures, and why:
#   - every node CPUs=32 although the machine has fewer cores, RealMemory=20000, Gres=gpu:4;
#     SlurmdParameters=config_overrides makes slurmd trust these numbers instead of draining the
#     node for having less hardware, so a 4-task, 4-"GPU" job with 8 CPUs per task (slurm/4gpu.sh)
#     fits on a 2-core box;
#   - select/cons_tres + CR_Core, proctrack/linuxproc + task/none (no cgroups needed), one default
#     partition with OverSubscribe=YES and MaxTime=INFINITE, MpiDefault=none (srun --mpi=pmix is
#     available);
#   - JobRequeue=1, KillWait=10, ReturnToService=2, MinJobAge=600: no accounting storage is
#     configured, so finished jobs stay visible in `scontrol show job` for 10 minutes;
#   - AuthInfo: the own munged's socket, and cred_expire=10: a requeued job (scontrol requeue,
#     preemption) gets BeginTime = requeue time + cred_expire + 1 s (slurmctld job_mgr.c), so with
#     Slurm's default of 120 s its second run started 2.3-2.6 minutes after the requeue.
#     cred_expire is also the lifetime of step credentials (minimum 5); 10 s is ample on one
#     machine. SchedulerParameters=sched_interval=5,bf_interval=5 (defaults 60 and 30) make the
#     scheduler pick the job up within seconds once BeginTime has passed: measured, the second run
#     starts ~14 s after the requeue. Do not start it sooner (`scontrol update jobid=N
#     StartTime=now`): slurmd refuses the job's credential until cred_expire after the requeue,
#     and slurmctld then ends the job for good ("Killing non-startable batch JobId=N: Job
#     credential revoked", state FAILED).
gen_slurm_conf() {
  local nodes=()
  echo "$MARKER"
  echo "# A test cluster of hvdtrain; regenerated by \`up\`, removed by \`down\`. Edits are overwritten."
  [[ $CONF_DIR == /etc/slurm ]] || echo "# Not Slurm's default path: clients need SLURM_CONF=$CONF_DIR/slurm.conf."
  cat <<EOF
ClusterName=$CLUSTER_NAME
SlurmctldHost=$(host_name)($CTLD_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
# Own munged; a requeued job waits cred_expire + 1 s before it starts again (default 120).
AuthInfo=socket=$(munge_socket),cred_expire=10
SlurmUser=slurm
SlurmdUser=root
StateSaveLocation=$STATE_DIR/slurm/ctld
SlurmdSpoolDir=$STATE_DIR/slurm/spool/%n
SlurmctldPidFile=$STATE_DIR/slurm/run/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurm/run/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
MailProg=/bin/true
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
MinJobAge=600
KillWait=10
ReturnToService=2
InactiveLimit=0
Waittime=0
SlurmctldTimeout=60
SlurmdTimeout=120
EOF
  if [[ -n $NODE_TMPFS ]]; then
    echo "# The nodes share /tmp, where srun --mpi=pmix would make the same directory on every node."
    echo "TmpFS=$NODE_TMPFS"
  fi
  while (($# >= 2)); do
    echo "NodeName=$1 NodeHostname=$1 NodeAddr=$2 CPUs=32 RealMemory=20000 Gres=gpu:4 State=UNKNOWN"
    nodes+=("$1")
    shift 2
  done
  echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP"
}

# gen_gres_conf: the fake GPUs of every node. File= entries and not `Count=4` alone, which leaves
# the node INVAL ("gres/gpu count reported lower than configured"). slurmd logs that they are not
# character devices and still registers gpu:4; jobs asking for --gres=gpu:N get
# SLURM_GPUS_ON_NODE=N but no CUDA_VISIBLE_DEVICES (that needs real device files).
gen_gres_conf() {
  local i
  printf '%s\n# Four fake GPUs per node: plain files, enough for slurmd to register gpu:4.\n' "$MARKER"
  for i in 0 1 2 3; do
    printf 'Name=gpu File=%s/fake-gpu/nvidia%d\n' "$STATE_DIR" "$i"
  done
}

gen_cgroup_conf() {
  printf '%s\n# No cgroup plugins are configured (proctrack/linuxproc, task/none).\n' "$MARKER"
  printf 'CgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n'
}

# slurm_config_current NODE ADDR...: 0 when $CONF_DIR holds exactly what configure_slurm writes.
slurm_config_current() {
  local f
  for f in slurm gres cgroup; do
    cmp -s "$CONF_DIR/$f.conf" <("gen_${f}_conf" "$@") || return 1
  done
}

# configure_slurm NODE ADDR [NODE ADDR]...: slurm.conf, gres.conf and cgroup.conf in $CONF_DIR for
# these nodes. When they change, the daemons running with the old ones are stopped, to be started
# again with the new ones.
configure_slurm() {
  slurm_config_current "$@" && return 0
  local f tmp pid
  install -d -m 0755 "$CONF_DIR"
  for f in slurm gres cgroup; do
    tmp=$(mktemp "$CONF_DIR/$f.conf.XXXXXX")
    "gen_${f}_conf" "$@" >"$tmp"
    chmod 0644 "$tmp"
    mv -f "$tmp" "$CONF_DIR/$f.conf"
  done
  say "wrote $CONF_DIR/slurm.conf, gres.conf, cgroup.conf"
  while (($# >= 2)); do
    if pid=$(our_pid "slurmd-$1" slurmd); then stop_pid "$pid" slurmd 15; fi
    shift 2
  done
  if pid=$(our_pid slurmctld); then stop_pid "$pid" slurmctld 20; fi
}

# --- Slurm daemons -------------------------------------------------------------------------------
slurm() { SLURM_CONF=$CONF_DIR/slurm.conf timeout 15 "$@"; }
ctld_up() { slurm scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_state() { slurm sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -n 1 || true; }
node_usable() { [[ $(node_state "$1") =~ ^(idle|mixed|allocated|completing)$ ]]; }

start_slurmctld() {
  local conf=$CONF_DIR/slurm.conf end=$((SECONDS + TIMEOUT))
  # -i: ignore unreadable state files rather than refusing to start.
  our_pid slurmctld >/dev/null ||
    launch slurmctld slurmctld env SLURM_CONF="$conf" /usr/sbin/slurmctld -D -i -f "$conf"
  until ctld_up; do
    our_pid slurmctld >/dev/null ||
      fail "slurmctld exited during startup" "$STATE_DIR/log/slurmctld.stdout" "$STATE_DIR/log/slurmctld.log"
    ((SECONDS < end)) ||
      fail "slurmctld did not answer within ${TIMEOUT}s" "$STATE_DIR/log/slurmctld.stdout" "$STATE_DIR/log/slurmctld.log"
    sleep 0.5
  done
}

declare -gA STARTED_SINCE=()
# start_slurmd NODE [PREFIX...]: NODE's slurmd (pid name slurmd-NODE), run through PREFIX (the
# command that enters the node) when given.
start_slurmd() {
  local node=$1 conf=$CONF_DIR/slurm.conf
  shift
  our_pid "slurmd-$node" slurmd >/dev/null && return 0
  ensure_dir "$STATE_DIR/slurm/spool/$node" root 755
  # The controller may still list the node as idle from before; wait_nodes waits for this start.
  STARTED_SINCE[$node]=$(date +%Y-%m-%dT%H:%M:%S)
  launch "slurmd-$node" slurmd "$@" env SLURM_CONF="$conf" /usr/sbin/slurmd -D -N "$node" -f "$conf"
}

# wait_nodes NODE...: until every NODE is usable in Slurm (and, when start_slurmd started its
# slurmd, has registered since), resuming a node that came up down or drained (3 times at most).
wait_nodes() {
  local node state started pending logs=("$STATE_DIR/log/slurmctld.log") end=$((SECONDS + TIMEOUT))
  local -A resumed=()
  for node in "$@"; do logs+=("$STATE_DIR/log/slurmd-$node.log"); done
  while :; do
    our_pid slurmctld >/dev/null ||
      fail "slurmctld exited" "$STATE_DIR/log/slurmctld.stdout" "$STATE_DIR/log/slurmctld.log"
    pending=""
    for node in "$@"; do
      our_pid "slurmd-$node" slurmd >/dev/null ||
        fail "slurmd on $node exited" "$STATE_DIR/log/slurmd-$node.stdout" "$STATE_DIR/log/slurmd-$node.log"
      if [[ -n ${STARTED_SINCE[$node]:-} ]]; then
        started=$(slurm scontrol show node "$node" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' || true)
        started=${started#SlurmdStartTime=}
        if [[ ! $started =~ ^[0-9]{4}- || $started < "${STARTED_SINCE[$node]}" ]]; then
          pending+=" $node(registering)"
          continue
        fi
      fi
      state=$(node_state "$node")
      case $state in
        idle | mixed | allocated | completing) continue ;;
        inval*) fail "$node is INVAL (configuration rejected by slurmd)" \
          "$STATE_DIR/log/slurmd-$node.log" "$STATE_DIR/log/slurmctld.log" ;;
        down* | drain* | fail* | *drain | *drained)
          if ((${resumed[$node]:-0} < 3)); then
            say "$node is $state; resuming it"
            slurm scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
            resumed[$node]=$((${resumed[$node]:-0} + 1))
          fi
          ;;
      esac
      pending+=" $node(${state:-unknown})"
    done
    [[ -z $pending ]] && return 0
    ((SECONDS < end)) || fail "nodes not idle after ${TIMEOUT}s:$pending" "${logs[@]}"
    sleep 0.5
  done
}

# cancel_jobs: every job of this Slurm cancelled, waiting (30 s at most) until none is listed.
cancel_jobs() {
  ctld_up || return 0
  local ids end=$((SECONDS + 30))
  ids=$(slurm squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)
  [[ -n ${ids// /} ]] || return 0
  say "cancelling jobs: $ids"
  # shellcheck disable=SC2086
  slurm scancel $ids 2>/dev/null || true
  while ((SECONDS < end)); do
    [[ -z $(slurm squeue -h -o '%A' 2>/dev/null || true) ]] && return 0
    sleep 1
  done
  warn "jobs still listed after 30s: $(slurm squeue -h -o '%A %T' 2>/dev/null | tr '\n' ' ' || true)"
}
