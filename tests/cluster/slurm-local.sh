#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for hvdtrain's integration tests and CI.
#
#   tests/cluster/slurm-local.sh up      install (root only) + configure + start; idempotent, exit 0
#                                        when the node is idle and jobs can run
#   tests/cluster/slurm-local.sh down    cancel jobs, stop what `up` started, remove its state and
#                                        config
#   tests/cluster/slurm-local.sh status  print sinfo/squeue; exit 0 when usable, 3 when down or
#                                        degraded
#
# What it shares with tests/cluster/cluster-local.sh (the state directory's checks and layout,
# munged, Slurm's configuration, start and wait) is in tests/cluster/lib.sh.
#
# What `up` does (Debian 12, as root, without systemd; verified on this project's CI machine kind):
#   1. Installs Debian's slurm-wlm (22.05: slurmctld, slurmd, slurm-client) and munge with apt-get
#      when any of their programs is missing. Service starts by the packages are suppressed with a
#      temporary policy-rc.d so that this script stays the only thing running the daemons. As
#      non-root it only names the packages to install and exits 1.
#   2. Starts its own munged as user munge, with its own key and socket in the state directory
#      (a munged already running on the machine is neither needed nor touched).
#   3. Writes /etc/slurm/{slurm,gres,cgroup}.conf (the default paths, so sbatch/srun/sinfo need no
#      SLURM_CONF). Each starts with the marker line below; a file without it belongs to someone
#      else and the script refuses to touch it. One node named `hostname -s` at 127.0.0.1 (no DNS
#      needed) with 32 CPUs and 4 fake GPUs: lib.sh's gen_slurm_conf says what they configure, and
#      why.
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
#     0700: slurmctld (user slurm) and munged (user munge) must reach their subdirectories;
#   - every subdirectory is made by root with an exact owner and mode (checked the same way when
#     it exists); only slurm/ctld (slurmctld's state) and munge/ belong to those users, and root
#     writes nothing into them (the munge key is written as user munge);
#   - nothing is written under a fixed name in /tmp: the lock is this script itself and the apt
#     log comes from mktemp.
#
# Environment knobs:
#   HVDTRAIN_SLURM_DIR      state directory: logs, pid files, StateSaveLocation, slurmd spool,
#                           munged, fake GPU files (default /run/hvdtrain-slurm; an absolute path
#                           whose parent exists and is root's); removed by `down`
#   HVDTRAIN_SLURM_TIMEOUT  seconds to wait for each daemon / the node (default 60)
#
# On failure the tail of the relevant daemon log is printed and the exit status is non-zero.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname -- "$(readlink -f "$0")")/lib.sh"
use_knobs HVDTRAIN_SLURM /run/hvdtrain-slurm

# Its Slurm: Slurm's default paths and ports, one node (this machine) at 127.0.0.1.
CONF_DIR=/etc/slurm
SLURM_CONF_FILE=$CONF_DIR/slurm.conf
CLUSTER_NAME=hvdtrain
CTLD_ADDR=127.0.0.1
NODE=$(host_name)

check_config_ownership() {
  local f
  for f in "$CONF_DIR"/{slurm,gres,cgroup}.conf; do
    [[ ! -e $f ]] || ours "$f" ||
      die "$f exists and was not written by this script (no '$MARKER' first line); refusing to replace it"
  done
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
  if our_pid munged >/dev/null && our_pid slurmctld >/dev/null && our_pid "slurmd-$NODE" slurmd >/dev/null &&
    munge_works && ctld_up && node_usable "$NODE" && slurm_config_current "$NODE" "$CTLD_ADDR"; then
    say "already up: node $NODE is $(node_state "$NODE")"
    return 0
  fi

  # Refuse to fight over the ports with daemons that this script did not start (or that a run with
  # another HVDTRAIN_SLURM_DIR started).
  local daemon comm name
  for daemon in "slurmctld slurmctld" "slurmd slurmd-$NODE"; do
    read -r comm name <<<"$daemon"
    if ! our_pid "$name" "$comm" >/dev/null && pgrep -x "$comm" >/dev/null 2>&1; then
      die "a $comm not started by this script (with state in $STATE_DIR) is running (pid $(pgrep -x "$comm" | tr '\n' ' ')); stop it first"
    fi
  done

  # shellcheck disable=SC2119 # lib.sh's layout, no subdirectories of its own
  prepare_state_dir
  start_munge
  configure_slurm "$NODE" "$CTLD_ADDR"
  start_slurmctld
  start_slurmd "$NODE"
  wait_nodes "$NODE"
  say "up: node $NODE is $(node_state "$NODE"), gres $(slurm sinfo -h -N -n "$NODE" -o '%G' 2>/dev/null | head -n 1 || true)"
}

cmd_down() {
  [[ $(id -u) -eq 0 ]] || die "down must run as root"
  take_lock
  # Its pid files name what down kills: only from a directory up made.
  check_state_dir
  local pid stopped=0 f
  if [[ -e $STATE_DIR/$STATE_MARKER ]]; then
    if our_pid slurmctld >/dev/null && command -v squeue >/dev/null 2>&1; then
      cancel_jobs
    fi
    if pid=$(our_pid "slurmd-$NODE" slurmd); then
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
  for f in "$CONF_DIR"/{slurm,gres,cgroup}.conf; do
    if ours "$f"; then rm -f "$f"; fi
  done
  remove_state_dir
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
  local missing=""
  if [[ -e $STATE_DIR/$STATE_MARKER ]]; then
    our_pid munged >/dev/null || missing+=" munged"
    our_pid slurmctld >/dev/null || missing+=" slurmctld"
    our_pid "slurmd-$NODE" slurmd >/dev/null || missing+=" slurmd"
  fi
  slurm sinfo -N -o '%N %P %T %c %m %G' || true
  slurm squeue || true
  if [[ -n $missing ]]; then
    say "degraded: not running:$missing (run: tests/cluster/slurm-local.sh up)"
    return 3
  fi
  if node_usable "$NODE"; then
    return 0
  fi
  say "degraded: node $NODE is $(node_state "$NODE")"
  return 3
}

# down/status without HVDTRAIN_SLURM_DIR: use the state directory named in our slurm.conf, so a
# cluster brought up with a non-default directory is still found.
state_dir_from_conf() {
  [[ -z ${HVDTRAIN_SLURM_DIR:-} && -r $SLURM_CONF_FILE ]] || return 0
  ours "$SLURM_CONF_FILE" || return 0
  local dir
  dir=$(sed -n 's|^StateSaveLocation=\(.*\)/slurm/ctld$|\1|p' "$SLURM_CONF_FILE" | head -n 1)
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
  -h | --help) print_help ;;
  *)
    printf 'usage: %s up|down|status (--help: what each does)\n' "$0" >&2
    exit 2
    ;;
esac
