#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for hvdtrain's integration tests and CI.
#
#   scripts/slurm-local.sh up       install (root only) + configure + start; idempotent, exit 0 when
#                                   the node is idle and jobs can run
#   scripts/slurm-local.sh down     cancel jobs, stop what `up` started, remove its state and config
#   scripts/slurm-local.sh status   print sinfo/squeue; exit 0 when usable, 3 when down or degraded
#
# What `up` does (Debian 12, as root, without systemd; verified on this project's CI machine kind):
#   1. Installs Debian's slurm-wlm (22.05: slurmctld, slurmd, slurm-client) and munge with apt-get
#      when any of their programs is missing. Service starts by the packages are suppressed with a
#      temporary policy-rc.d so that this script stays the only thing running the daemons. As
#      non-root it only names the packages to install and exits 1.
#   2. Starts munged as user munge (/run/munge owned by munge), unless a working munged is already
#      there (then it is used and left alone by `down`).
#   3. Writes /etc/slurm/{slurm,gres,cgroup}.conf (the default paths, so sbatch/srun/sinfo need no
#      SLURM_CONF). Each starts with the marker line below; a file without it belongs to someone
#      else and the script refuses to touch it. What they configure, and why:
#        - one node named `hostname -s` at 127.0.0.1 (no DNS needed), CPUs=32 although the machine
#          has fewer cores, RealMemory=20000, Gres=gpu:4; SlurmdParameters=config_overrides makes
#          slurmd trust these numbers instead of draining the node for having less hardware, so a
#          4-task, 4-"GPU" job with 8 CPUs per task (slurm/4gpu.sh) fits on a 2-core box;
#        - gres.conf: four File= entries pointing at plain files under the state directory
#          (`Count=4` alone leaves the node INVAL: "gres/gpu count reported lower than
#          configured"). slurmd logs that they are not character devices and still registers
#          gpu:4; jobs asking for --gres=gpu:N get SLURM_GPUS_ON_NODE=N but no
#          CUDA_VISIBLE_DEVICES (that needs real device files);
#        - select/cons_tres + CR_Core, proctrack/linuxproc + task/none (no cgroups needed), one
#          default partition with OverSubscribe=YES and MaxTime=INFINITE, MpiDefault=none
#          (srun --mpi=pmix is available);
#        - JobRequeue=1, KillWait=10, ReturnToService=2, MinJobAge=600: no accounting storage is
#          configured, so finished jobs stay visible in `scontrol show job` for 10 minutes;
#        - AuthInfo=cred_expire=10: a requeued job (scontrol requeue, preemption) gets
#          BeginTime = requeue time + cred_expire + 1 s (slurmctld job_mgr.c), so with Slurm's
#          default of 120 s its second run started 2.3-2.6 minutes after the requeue. cred_expire
#          is also the lifetime of step credentials (minimum 5); 10 s is ample on one machine.
#          SchedulerParameters=sched_interval=5,bf_interval=5 (defaults 60 and 30) make the
#          scheduler pick the job up within seconds once BeginTime has passed: measured, the
#          second run starts ~14 s after the requeue. `scontrol update jobid=N StartTime=now`
#          right after the requeue starts it within ~1 s.
#   4. Starts slurmctld and slurmd in the background (-D under setsid, logs and pid files in the
#      state directory), waits (bounded) until the node is idle, resuming it if it came up
#      drained/down, and exits 0. A healthy cluster is detected and left as it is.
#
# The state directory (default /run/hvdtrain-slurm) is root's, as is everything that root's slurmd
# and this script read from it, so nobody but root may make it or anything in it:
#   - it lives under /run: root's and not writable by anyone else (unlike /var/tmp or /tmp, where
#     any user can create the name first), the same path for every up/down/status, and gone after a
#     reboot, as are the daemons it describes. Every directory above it must be root's and not
#     group/world writable;
#   - `up` makes it fresh (mkdir, root, mode 0711) or accepts it only as `up` made it: a directory,
#     not a symlink, owned by root with mode 0711; anything else is refused in one line before
#     anything is installed, written or started, and so are `down` and `status`. 0711 and not
#     0700: slurmctld (user slurm) must reach ctld/ (its state) and the files it writes;
#   - every subdirectory is made by root with an exact owner and mode (checked the same way when
#     it exists); only ctld/ is slurm's;
#   - nothing is written under a fixed name in /tmp: the lock is this script itself and the apt
#     log comes from mktemp.
#
# Environment knobs:
#   HVDTRAIN_SLURM_DIR      state directory: logs, pid files, StateSaveLocation, slurmd spool,
#                           fake GPU files (default /run/hvdtrain-slurm; an absolute path whose
#                           parent exists and is root's); removed by `down`
#   HVDTRAIN_SLURM_TIMEOUT  seconds to wait for each daemon / the node (default 60)
#
# On failure the tail of the relevant daemon log is printed and the exit status is non-zero.
set -euo pipefail

MARKER="# managed by hvdtrain scripts/slurm-local.sh"
STATE_DIR=${HVDTRAIN_SLURM_DIR:-/run/hvdtrain-slurm}
STATE_DIR_MODE=711
TIMEOUT=${HVDTRAIN_SLURM_TIMEOUT:-60}
CONF_DIR=/etc/slurm
SLURM_CONF_FILE=$CONF_DIR/slurm.conf
GRES_CONF_FILE=$CONF_DIR/gres.conf
CGROUP_CONF_FILE=$CONF_DIR/cgroup.conf
STATE_MARKER=.hvdtrain-slurm-local
PARTITION=debug
PACKAGES=(slurm-wlm munge)
SCRIPT=$(readlink -f "$0")

say() { printf '[slurm-local] %s\n' "$*"; }
warn() { printf 'slurm-local: %s\n' "$*" >&2; }
die() { printf 'slurm-local: %s\n' "$*" >&2; exit 1; }

[[ $STATE_DIR == /* ]] || die "HVDTRAIN_SLURM_DIR must be an absolute path, got '$STATE_DIR'"
# The parent without symlinks (/var/run -> /run): the path that state_dir_problem checks is the
# path that is used.
if _parent=$(realpath -e -- "$(dirname -- "$STATE_DIR")" 2>/dev/null); then
  STATE_DIR=${_parent%/}/$(basename -- "$STATE_DIR")
fi
unset _parent

node_name() {
  local n
  n=$(hostname -s 2>/dev/null || true)
  [[ -n $n ]] || n=$(hostname)
  printf '%s\n' "$n"
}
NODE=$(node_name)

# Print the last lines of the named daemon logs (stderr), for failure reports.
show_logs() {
  local f
  for f in "$@"; do
    [[ -s $f ]] || continue
    printf -- '----- last lines of %s -----\n' "$f" >&2
    tail -n 40 "$f" >&2 || true
  done
}
fail() { # fail MESSAGE LOGFILE...
  local msg=$1
  shift
  warn "$msg"
  show_logs "$@"
  exit 1
}

# --- process bookkeeping ----------------------------------------------------------------------
# pid files written by this script: $STATE_DIR/pids/<daemon>.pid
pid_file() { printf '%s/pids/%s.pid\n' "$STATE_DIR" "$1"; }

# our_pid NAME: the pid recorded for NAME if that process is alive and is NAME, else nothing.
our_pid() {
  local f pid comm
  f=$(pid_file "$1")
  [[ -r $f ]] || return 1
  pid=$(tr -dc '0-9' <"$f")
  [[ -n $pid ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
  [[ $comm == "$1" ]] || return 1
  # A zombie (exited, not yet reaped) is not running.
  [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true) != Z ]] || return 1
  printf '%s\n' "$pid"
}

# stop_pid PID NAME GRACE: SIGTERM, wait up to GRACE seconds, then SIGKILL.
stop_pid() {
  local pid=$1 name=$2 grace=$3 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < grace * 5; i++)); do
    [[ $(cat "/proc/$pid/comm" 2>/dev/null || true) == "$name" ]] || return 0
    sleep 0.2
  done
  warn "$name (pid $pid) did not exit after ${grace}s; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  sleep 0.5
}

munge_works() { timeout 10 munge -n 2>/dev/null | timeout 10 unmunge >/dev/null 2>&1; }
ctld_up() { timeout 15 scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_state() { timeout 15 sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1 || true; }
node_usable() { [[ $(node_state) =~ ^(idle|mixed|allocated|completing)$ ]]; }

# --- 1. packages --------------------------------------------------------------------------------
have_programs() {
  local p
  for p in slurmctld slurmd sinfo srun sbatch scontrol munged munge unmunge; do
    command -v "$p" >/dev/null 2>&1 || [[ -x /usr/sbin/$p ]] || return 1
  done
}

install_packages() {
  have_programs && return 0
  local cmd="apt-get install -y --no-install-recommends ${PACKAGES[*]}"
  if [[ $(id -u) -ne 0 ]]; then
    die "Slurm is not installed; run as root: $cmd"
  fi
  command -v apt-get >/dev/null 2>&1 || die "Slurm is not installed and apt-get is missing; install: ${PACKAGES[*]}"
  say "installing ${PACKAGES[*]} with apt-get"
  # Keep the packages' maintainer scripts from starting daemons (with or without systemd): this
  # script runs them itself, with its own configuration.
  local policy=/usr/sbin/policy-rc.d own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\n%s\nexit 101\n' "$MARKER" >"$policy"
    chmod 755 "$policy"
    own_policy=1
    # shellcheck disable=SC2064 # expand now: remove exactly this file, also when interrupted
    trap "head -n 2 '$policy' 2>/dev/null | grep -qxF '$MARKER' && rm -f '$policy'" EXIT
  fi
  local rc=0 log attempt
  log=$(mktemp -t hvdtrain-slurm-apt.XXXXXX.log)
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
  have_programs || fail "installed ${PACKAGES[*]} but Slurm/munge programs are still missing" "$log"
  rm -f "$log"
}

# --- 2. munge -----------------------------------------------------------------------------------
start_munge() {
  if munge_works; then
    if our_pid munged >/dev/null; then
      say "munged already running (pid $(our_pid munged))"
    else
      say "using the munged that is already running"
    fi
    return 0
  fi
  id munge >/dev/null 2>&1 || die "user munge does not exist (is the munge package installed?)"
  install -d -o munge -g munge -m 0755 /run/munge
  local d
  for d in /etc/munge /var/lib/munge /var/log/munge; do
    [[ -d $d ]] || install -d -o munge -g munge -m 0700 "$d"
  done
  local key=/etc/munge/munge.key
  if [[ ! -s $key ]]; then
    say "creating $key"
    if command -v mungekey >/dev/null 2>&1; then
      runuser -u munge -- mungekey --create --keyfile="$key"
    else
      dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    fi
  fi
  chown munge:munge "$key"
  chmod 0400 "$key"
  local pidfile=/run/munge/munged.pid
  rm -f "$pidfile"
  # munged daemonizes itself and writes its pid file; --force replaces a stale socket.
  runuser -u munge -- munged --force --pid-file="$pidfile" </dev/null >/dev/null 2>&1 9>&- ||
    fail "munged failed to start" /var/log/munge/munged.log
  local pid="" end=$((SECONDS + TIMEOUT))
  while ((SECONDS < end)); do
    if [[ -s $pidfile ]] && munge_works; then
      pid=$(tr -dc '0-9' <"$pidfile")
      break
    fi
    sleep 0.2
  done
  [[ -n $pid ]] || fail "munged did not come up within ${TIMEOUT}s" /var/log/munge/munged.log
  printf '%s\n' "$pid" >"$(pid_file munged)"
  say "started munged (pid $pid)"
}

# --- 3. configuration ---------------------------------------------------------------------------
ours_or_absent() { [[ ! -e $1 ]] || head -n 1 "$1" | grep -qxF "$MARKER"; }

check_config_ownership() {
  local f
  for f in "$SLURM_CONF_FILE" "$GRES_CONF_FILE" "$CGROUP_CONF_FILE"; do
    ours_or_absent "$f" ||
      die "$f exists and was not written by this script (no '$MARKER' first line); refusing to replace it"
  done
}

gen_slurm_conf() {
  cat <<EOF
$MARKER
# Single-node test cluster for hvdtrain; regenerated by \`scripts/slurm-local.sh up\`, removed by
# \`down\`. Edits are overwritten. State, logs and pid files live in $STATE_DIR.
ClusterName=hvdtrain
SlurmctldHost=$NODE(127.0.0.1)
AuthType=auth/munge
# A requeued job gets BeginTime = requeue time + cred_expire + 1 (Slurm default 120 s).
AuthInfo=cred_expire=10
SlurmUser=slurm
SlurmdUser=root
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmdPidFile=$STATE_DIR/run/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
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
NodeName=$NODE NodeHostname=$NODE NodeAddr=127.0.0.1 CPUs=32 RealMemory=20000 Gres=gpu:4 State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
EOF
}

gen_gres_conf() {
  local i
  printf '%s\n' "$MARKER"
  printf '# Four fake GPUs: plain files (no real device), enough for slurmd to register gpu:4.\n'
  for i in 0 1 2 3; do
    printf 'NodeName=%s Name=gpu File=%s/fake-gpu/nvidia%d\n' "$NODE" "$STATE_DIR" "$i"
  done
}

gen_cgroup_conf() {
  printf '%s\n' "$MARKER"
  printf '# No cgroup plugins are configured (proctrack/linuxproc, task/none); nothing to constrain.\n'
  printf 'CgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n'
}

# write_if_changed FILE GENERATOR: returns 0 if FILE was (re)written.
write_if_changed() {
  local file=$1 gen=$2 tmp
  tmp=$(mktemp "$file.XXXXXX")
  "$gen" >"$tmp"
  chmod 0644 "$tmp"
  if [[ -e $file ]] && cmp -s "$tmp" "$file"; then
    rm -f "$tmp"
    return 1
  fi
  mv -f "$tmp" "$file"
  return 0
}

# --- state directory (see the header: root's, made fresh, refused in one line otherwise) -------
# state_dir_problem: why $STATE_DIR must not be used, as one line; nothing when it may be (also
# when it does not exist yet and may be made).
state_dir_problem() {
  local dir name uid user mode kind
  name=$(basename -- "$STATE_DIR")
  if [[ $name == / || $name == . || $name == .. ]]; then
    echo "refusing state directory '$STATE_DIR': not a directory name; set HVDTRAIN_SLURM_DIR to a path such as /run/hvdtrain-slurm"
    return
  fi
  dir=$(dirname -- "$STATE_DIR")
  if [[ ! -d $dir ]]; then
    echo "refusing state directory $STATE_DIR: its parent $dir does not exist; create it (root's, not group/world writable) or set HVDTRAIN_SLURM_DIR elsewhere"
    return
  fi
  while :; do
    # Owner and mode of the path itself (stat without -L does not follow a symlink).
    if ! read -r uid user mode < <(stat -c '%u %U %a' -- "$dir" 2>/dev/null); then
      echo "refusing state directory $STATE_DIR: cannot stat its parent $dir"
      return
    fi
    if [[ $uid != 0 ]] || ((8#$mode & 8#022)); then
      echo "refusing state directory $STATE_DIR: its parent $dir is owned by $user (uid $uid) with mode $mode, not by root without group/world write; set HVDTRAIN_SLURM_DIR to a path under a root-only directory such as /run"
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

# The state directory's subdirectories: path, owner, mode. ctld/ is slurmctld's state, written as
# user slurm; its log and pid file slurmctld creates as root (in log/ and run/) before it becomes
# slurm.
STATE_SUBDIRS=("pids root 755" "slurmd root 755" "fake-gpu root 755" "log root 755" "run root 755"
  "ctld slurm 755")

prepare_state_dir() {
  local entry d user mode
  # Everything checked before anything is made.
  check_state_dir
  for entry in "${STATE_SUBDIRS[@]}"; do
    read -r d user mode <<<"$entry"
    check_dir "$STATE_DIR/$d" "$user" "$mode"
  done
  # Made fresh: mkdir fails if anything took the name since the check (only root could: the
  # parent is root's).
  [[ -d $STATE_DIR ]] || mkdir -m "$STATE_DIR_MODE" -- "$STATE_DIR"
  [[ -e $STATE_DIR/$STATE_MARKER ]] || : >"$STATE_DIR/$STATE_MARKER"
  for entry in "${STATE_SUBDIRS[@]}"; do
    read -r d user mode <<<"$entry"
    ensure_dir "$STATE_DIR/$d" "$user" "$mode"
  done
  local i
  for i in 0 1 2 3; do
    [[ -e $STATE_DIR/fake-gpu/nvidia$i ]] || : >"$STATE_DIR/fake-gpu/nvidia$i"
  done
}

# --- 4. daemons ---------------------------------------------------------------------------------
# launch NAME ARGS...: start a Slurm daemon in the foreground mode (-D) of its own session.
launch() {
  local name=$1 pid
  shift
  local out=$STATE_DIR/log/$name.stdout
  # 9>&-: the daemon must not inherit (and so keep holding) this script's lock.
  setsid "/usr/sbin/$name" -D "$@" </dev/null >>"$out" 2>&1 9>&- &
  pid=$!
  # Until setsid has exec'd the daemon, the pid's name is not the daemon's and our_pid would
  # report it as gone (seen: "slurmd exited" while slurmd was starting).
  local i
  for ((i = 0; i < 50; i++)); do
    [[ $(cat "/proc/$pid/comm" 2>/dev/null || true) == "$name" ]] && break
    sleep 0.1
  done
  printf '%s\n' "$pid" >"$(pid_file "$name")"
  say "started $name (pid $pid)"
}

wait_ctld() {
  local end=$((SECONDS + TIMEOUT))
  while ((SECONDS < end)); do
    ctld_up && return 0
    our_pid slurmctld >/dev/null ||
      fail "slurmctld exited during startup" "$STATE_DIR/log/slurmctld.stdout" "$STATE_DIR/log/slurmctld.log"
    sleep 0.5
  done
  fail "slurmctld did not answer within ${TIMEOUT}s" "$STATE_DIR/log/slurmctld.stdout" "$STATE_DIR/log/slurmctld.log"
}

# wait_node [SINCE]: wait until the node is usable and, with SINCE (a %Y-%m-%dT%H:%M:%S time),
# until slurmd has registered since then (the controller may still list the node as idle from
# before a slurmd restart).
wait_node() {
  local since=${1:-} state started resumed=0 end=$((SECONDS + TIMEOUT))
  while ((SECONDS < end)); do
    our_pid slurmd >/dev/null ||
      fail "slurmd exited" "$STATE_DIR/log/slurmd.stdout" "$STATE_DIR/log/slurmd.log"
    our_pid slurmctld >/dev/null ||
      fail "slurmctld exited" "$STATE_DIR/log/slurmctld.stdout" "$STATE_DIR/log/slurmctld.log"
    state=$(node_state)
    if [[ -n $since ]]; then
      started=$(timeout 15 scontrol show node "$NODE" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' || true)
      started=${started#SlurmdStartTime=}
      if [[ ! $started =~ ^[0-9]{4}- || $started < "$since" ]]; then
        sleep 0.5
        continue
      fi
    fi
    case $state in
      idle | mixed | allocated | completing) return 0 ;;
      inval*)
        fail "node $NODE is INVAL (configuration rejected by slurmd)" \
          "$STATE_DIR/log/slurmd.log" "$STATE_DIR/log/slurmctld.log" ;;
      down | drain* | fail | *drain | *drained)
        if ((resumed < 3)); then
          say "node $NODE is $state; resuming it"
          timeout 15 scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
          resumed=$((resumed + 1))
        fi
        ;;
    esac
    sleep 0.5
  done
  timeout 15 scontrol show node "$NODE" >&2 2>/dev/null || true
  fail "node $NODE not idle after ${TIMEOUT}s (state: ${state:-unknown})" \
    "$STATE_DIR/log/slurmd.log" "$STATE_DIR/log/slurmctld.log"
}

take_lock() {
  # The lock is this script itself: nothing is left behind, nothing is written in /tmp.
  exec 9<"$SCRIPT"
  flock -w 300 9 || die "another slurm-local.sh up/down is still running (lock: $SCRIPT)"
}

cmd_up() {
  if [[ -n ${SLURM_CONF:-} && $SLURM_CONF != "$SLURM_CONF_FILE" ]]; then
    warn "SLURM_CONF=$SLURM_CONF is set; Slurm clients in this environment will not use $SLURM_CONF_FILE"
  fi
  check_config_ownership
  if [[ $(id -u) -ne 0 ]]; then
    install_packages # names the missing packages and exits 1 when there are any
    die "up must run as root (slurmd runs as root and $CONF_DIR is written)"
  fi
  take_lock
  check_config_ownership
  # Before anything is read from, installed, written or started: a state directory not made by up
  # (someone else's, writable by others, a symlink) is refused in one line.
  check_state_dir
  install_packages

  # Fast path: everything that `up` starts is running and the node is usable.
  if our_pid slurmctld >/dev/null && our_pid slurmd >/dev/null && munge_works && ctld_up &&
    node_usable && [[ -e $SLURM_CONF_FILE ]] && cmp -s "$SLURM_CONF_FILE" <(gen_slurm_conf) &&
    cmp -s "$GRES_CONF_FILE" <(gen_gres_conf) && cmp -s "$CGROUP_CONF_FILE" <(gen_cgroup_conf); then
    say "already up: node $NODE is $(node_state)"
    return 0
  fi

  id slurm >/dev/null 2>&1 || die "user slurm does not exist (is slurm-wlm installed?)"
  # Refuse to fight over the ports with daemons that this script did not start (or that a run with
  # another HVDTRAIN_SLURM_DIR started).
  local d
  for d in slurmctld slurmd; do
    if ! our_pid "$d" >/dev/null && pgrep -x "$d" >/dev/null 2>&1; then
      die "a $d not started by this script (with state in $STATE_DIR) is running (pid $(pgrep -x "$d" | tr '\n' ' ')); stop it first"
    fi
  done

  prepare_state_dir
  start_munge

  install -d -m 0755 "$CONF_DIR"
  local changed=0
  write_if_changed "$SLURM_CONF_FILE" gen_slurm_conf && changed=1
  write_if_changed "$GRES_CONF_FILE" gen_gres_conf && changed=1
  write_if_changed "$CGROUP_CONF_FILE" gen_cgroup_conf && changed=1
  if ((changed)); then
    say "wrote $SLURM_CONF_FILE, $GRES_CONF_FILE, $CGROUP_CONF_FILE"
    # Daemons still running with an older configuration are restarted.
    local pid
    if pid=$(our_pid slurmd); then stop_pid "$pid" slurmd 15; fi
    if pid=$(our_pid slurmctld); then stop_pid "$pid" slurmctld 20; fi
  fi

  if ! our_pid slurmctld >/dev/null; then
    # -i: ignore unreadable state files rather than refusing to start.
    launch slurmctld -i
  fi
  wait_ctld
  local since=""
  if ! our_pid slurmd >/dev/null; then
    since=$(date +%Y-%m-%dT%H:%M:%S)
    launch slurmd
  fi
  wait_node "$since"
  say "up: node $NODE is $(node_state), gres $(timeout 15 sinfo -h -N -n "$NODE" -o '%G' 2>/dev/null | head -n 1 || true)"
}

# --- down / status ------------------------------------------------------------------------------
cancel_jobs() {
  ctld_up || return 0
  local ids
  ids=$(timeout 15 squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)
  [[ -n ${ids// /} ]] || return 0
  say "cancelling jobs: $ids"
  # shellcheck disable=SC2086
  timeout 30 scancel $ids 2>/dev/null || true
  local end=$((SECONDS + 30))
  while ((SECONDS < end)); do
    [[ -z $(timeout 15 squeue -h -o '%A' 2>/dev/null || true) ]] && return 0
    sleep 1
  done
  warn "jobs still listed after 30s: $(timeout 15 squeue -h -o '%A %T' 2>/dev/null | tr '\n' ' ' || true)"
}

cmd_down() {
  [[ $(id -u) -eq 0 ]] || die "down must run as root"
  take_lock
  # Its pid files name what down kills: only from a directory up made.
  check_state_dir
  local pid stopped=0
  if [[ -e $STATE_DIR/$STATE_MARKER ]]; then
    if our_pid slurmctld >/dev/null && command -v squeue >/dev/null 2>&1; then
      cancel_jobs
    fi
    if pid=$(our_pid slurmd); then
      stop_pid "$pid" slurmd 15
      stopped=1
      # Step daemons left behind by our slurmd (only when no other slurmd runs on this machine).
      if ! pgrep -x slurmd >/dev/null 2>&1; then
        local steps
        steps=$(pgrep -x slurmstepd 2>/dev/null | tr '\n' ' ' || true)
        if [[ -n ${steps// /} ]]; then
          warn "killing leftover slurmstepd: $steps"
          # shellcheck disable=SC2086
          kill -KILL $steps 2>/dev/null || true
        fi
      fi
    fi
    if pid=$(our_pid slurmctld); then
      stop_pid "$pid" slurmctld 20
      stopped=1
    fi
    if pid=$(our_pid munged); then
      stop_pid "$pid" munged 10
      stopped=1
    fi
  fi
  local f
  for f in "$SLURM_CONF_FILE" "$GRES_CONF_FILE" "$CGROUP_CONF_FILE"; do
    if [[ -e $f ]] && head -n 1 "$f" | grep -qxF "$MARKER"; then
      rm -f "$f"
    fi
  done
  if [[ -e $STATE_DIR/$STATE_MARKER ]]; then
    case $STATE_DIR in
      / | /var | /var/tmp | /tmp | /etc | /usr | /root | /home | /run | /var/lib | /var/run) die "refusing to remove $STATE_DIR" ;;
    esac
    rm -rf --one-file-system -- "$STATE_DIR"
  fi
  if ((stopped)); then
    say "down: stopped slurmd, slurmctld and munged started by this script; removed $STATE_DIR"
  else
    say "down: nothing of ours was running; removed our state and config if any"
  fi
}

cmd_status() {
  local problem
  problem=$(state_dir_problem)
  if [[ -n $problem ]]; then
    warn "$problem"
    return 3
  fi
  if ! command -v sinfo >/dev/null 2>&1; then
    say "down (Slurm is not installed)"
    return 3
  fi
  if ! ctld_up; then
    say "down (slurmctld does not answer)"
    return 3
  fi
  # The controller notices a dead slurmd only after SlurmdTimeout; check our own daemons directly.
  local d missing=""
  if [[ -e $STATE_DIR/$STATE_MARKER ]]; then
    for d in slurmctld slurmd; do
      our_pid "$d" >/dev/null || missing+=" $d"
    done
  fi
  timeout 15 sinfo -N -o '%N %P %T %c %m %G' || true
  timeout 15 squeue || true
  if [[ -n $missing ]]; then
    say "degraded: not running:$missing (run: scripts/slurm-local.sh up)"
    return 3
  fi
  if node_usable; then
    return 0
  fi
  say "degraded: node $NODE is $(node_state)"
  return 3
}

# down/status without HVDTRAIN_SLURM_DIR: use the state directory named in our slurm.conf, so a
# cluster brought up with a non-default directory is still found.
state_dir_from_conf() {
  [[ -z ${HVDTRAIN_SLURM_DIR:-} && -r $SLURM_CONF_FILE ]] || return 0
  head -n 1 "$SLURM_CONF_FILE" | grep -qxF "$MARKER" || return 0
  local dir
  dir=$(sed -n 's|^StateSaveLocation=\(.*\)/ctld$|\1|p' "$SLURM_CONF_FILE" | head -n 1)
  [[ -n $dir ]] && STATE_DIR=$dir
  return 0
}

case ${1:-} in
  up) cmd_up ;;
  down)
    state_dir_from_conf
    cmd_down
    ;;
  status)
    state_dir_from_conf
    rc=0
    cmd_status || rc=$?
    exit "$rc"
    ;;
  *)
    printf 'usage: %s up|down|status\n' "$0" >&2
    exit 2
    ;;
esac
