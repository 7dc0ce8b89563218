"""``--container IMAGE``: every rank runs inside a container image, started by srun.

Two runtimes, one choice (``--container-runtime``, default ``auto``):

* **pyxis** (Enroot), where Slurm has the plugin (``srun --help`` lists ``--container-image``):
  srun itself starts each task in the image, from ``--container-image``. The launcher stays
  outside, on the batch node, since pyxis offers no srun inside a container.
* **Charliecloud** otherwise: srun starts ``ch-run IMAGE -- python ...`` for every rank. Each
  rank is in a user namespace of its own, where OpenMPI's single-copy transfers between ranks of
  a node (CMA) may be refused, so they copy through shared memory instead
  (``OMPI_MCA_btl_vader_single_copy_mechanism=none``). ``ch-run --join``, Charliecloud's answer
  (one container per node), crashed here at exit with a SquashFS image (Charliecloud 0.31: the
  rank whose ch-run served the image's FUSE mount ended first, and the others' mapped files went
  with it, SIGBUS). PMIx's shared-memory store lives in slurmd's spool directory, which the
  container does not see; ``PMIX_MCA_gds=hash`` asks the node's PMIx server over its socket.

Both see the job's files at the same paths as outside: the top directory of the working
directory and of the run directory (``/work`` for ``/work/me/project``) is bound in at the same
place. ch-run can only bind onto a directory the image has (a SquashFS image is read-only), so
the launcher looks for them in the image first; containers/build.sh makes the usual ones and
``--mount-point DIR`` adds a site's own. The ranks' interpreter is the image's ``python``
(``--container-python``).
"""
from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import subprocess
from typing import Mapping, Sequence

from hvdtrain.errors import UserError
from hvdtrain.launch.options import LaunchOptions, run_dir_of

#: Top directories that belong to the image: binding a host directory over one would hide it.
IMAGE_OWNED = frozenset({"", "bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32",
                         "opt", "proc", "root", "run", "sbin", "sys", "usr", "var", "ch"})


def choose_runtime(requested: str, srun_has_pyxis: bool, have_ch_run: bool) -> str:
    """'pyxis' or 'charliecloud' for ``--container-runtime REQUESTED``; ``UserError`` when the
    one asked for (or, for auto, either) is not here."""
    if requested == "pyxis" or (requested == "auto" and srun_has_pyxis):
        if not srun_has_pyxis:
            raise UserError("--container-runtime pyxis: this srun has no --container-image (the "
                            "pyxis plugin is not installed in this Slurm)")
        return "pyxis"
    if not have_ch_run:
        raise UserError("--container needs Slurm's pyxis plugin (srun --container-image) or "
                        "Charliecloud's ch-run on the nodes; this machine has neither")
    return "charliecloud"


def detect_runtime(requested: str) -> str:
    """``choose_runtime`` from what this machine's srun and PATH offer."""
    try:
        srun_help = subprocess.run(["srun", "--help"], capture_output=True, text=True,
                                   timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        srun_help = ""
    return choose_runtime(requested, "--container-image" in srun_help,
                          shutil.which("ch-run") is not None)


def shared_roots(paths: Sequence[str]) -> list[str]:
    """The top directories of these absolute paths, each once, in order: what is bound in."""
    roots = []
    for path in paths:
        top = "/" + os.path.abspath(path).lstrip("/").split("/", 1)[0]
        if top.strip("/") in IMAGE_OWNED:
            raise UserError(f"--container: {path} is under {top}, which the image has itself "
                            f"(binding this machine's {top} over it would hide the image's); "
                            "run from a directory on a shared file system (/home, /work, "
                            "/scratch, ...)")
        if top not in roots:
            roots.append(top)
    return roots


#: Runs its arguments once ch-run's default SquashFS mount point exists. Charliecloud 0.31's
#: ch-run makes /var/tmp/$USER.ch/mnt one directory at a time and gives up when another rank of
#: the node made one first ("can't mkdir: /var/tmp/root.ch: File exists", in this project's
#: CI, 2 ranks per node); ``mkdir -p`` does not race.
MAKE_MOUNT_POINT_THEN_EXEC = 'mkdir -p "/var/tmp/$USER.ch/mnt" && exec "$@"'


def charliecloud_prefix(image: str, roots: Sequence[str], workdir: str) -> list[str]:
    """What runs a command in the image with ch-run: ``[... IMAGE --]`` (the command follows)."""
    binds = [f"--bind={root}" for root in roots]
    # --set-env: the image's environment (its PATH, from /ch/environment) over this machine's.
    ch_run = ["ch-run", "--set-env", *binds, f"--cd={workdir}", image, "--"]
    if os.path.isdir(image):  # a directory image: nothing to mount
        return ch_run
    return ["sh", "-c", MAKE_MOUNT_POINT_THEN_EXEC, "sh", *ch_run]


def missing_mount_points(image: str, roots: Sequence[str]) -> list[str]:
    """The directories of ``roots`` that ``image`` lacks, asked of the image itself with ch-run
    (a directory image or a SquashFS file alike); ``UserError`` when ch-run cannot start it."""
    look = 'for d; do [ -d "$d" ] || echo "$d"; done'
    try:
        result = subprocess.run(["ch-run", image, "--", "/bin/sh", "-c", look, "sh", *roots],
                                capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UserError(f"--container: ch-run did not start {image} in 120 s") from None
    if result.returncode != 0:
        said = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise UserError(f"--container: ch-run cannot start {image}: {said}")
    return result.stdout.split()


def check_mount_points(image: str, roots: Sequence[str]) -> None:
    """One line when the image has nowhere to bind one of ``roots`` (ch-run would fail in every
    rank with "can't mkdir ... Read-only file system")."""
    missing = missing_mount_points(image, roots)
    if missing:
        flags = " ".join(f"--mount-point {root}" for root in missing)
        raise UserError(f"--container: {image} has no {', '.join(missing)} to bind this "
                        f"machine's onto (ch-run binds only onto directories an image has); "
                        f"rebuild it with containers/build.sh {flags}, or work under a "
                        "directory it has (/work, /scratch, /home, ...)")


def rank_env(runtime: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables the ranks need in this runtime (srun passes the environment on)."""
    if runtime != "charliecloud":
        return {}
    env = {"PMIX_MCA_gds": "hash", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    if not environ.get("USER"):  # ch-run refuses to start without it
        env["USER"] = getpass.getuser()
    return {name: value for name, value in env.items() if name not in environ}


def pyxis_flags(image: str, roots: Sequence[str], workdir: str) -> list[str]:
    """srun's flags for pyxis: the image, the shared directories, the working directory."""
    return [f"--container-image={image}",
            f"--container-mounts={','.join(f'{root}:{root}' for root in roots)}",
            f"--container-workdir={workdir}"]


def wrap(runtime: str, image: str, program: list[str], roots: Sequence[str],
         workdir: str) -> tuple[list[str], list[str]]:
    """(srun flags, the command srun starts) for ``program`` run in ``image``."""
    if runtime == "pyxis":
        return pyxis_flags(image, roots, workdir), program
    return [], [*charliecloud_prefix(image, roots, workdir), *program]


def probe_prefix(runtime: str, image: str, roots: Sequence[str], workdir: str
                 ) -> tuple[str, ...] | None:
    """What runs the launcher's probes in the image on this node (``sh -c`` takes the probe), or
    None where that would cost a job step (pyxis: the ranks report a broken image themselves)."""
    if runtime == "pyxis":
        return None
    return (*charliecloud_prefix(image, roots, workdir), "sh", "-c")


def prepare(options: LaunchOptions) -> tuple[LaunchOptions, tuple[str, ...] | None]:
    """``options`` with the container runtime decided, and what runs the launcher's probes in
    the image (None: run them here; or, with pyxis, not at all: see ``probes``)."""
    if not options.container:
        return options, None
    options = dataclasses.replace(options,
                                  container_runtime=detect_runtime(options.container_runtime))
    roots = job_roots(options)
    if options.container_runtime == "charliecloud":
        os.environ.setdefault("USER", getpass.getuser())  # ch-run refuses to start without it
        # Enroot unpacks a writable root and makes mount points itself; ch-run cannot.
        check_mount_points(options.container, roots)
    return options, probe_prefix(options.container_runtime, options.container, roots,
                                 os.getcwd())


def job_roots(options: LaunchOptions) -> list[str]:
    """What a container must share with this machine: the top directories of the working
    directory and of the run directory."""
    run_dir = run_dir_of(options, os.environ)
    return shared_roots([os.getcwd(), *([run_dir] if run_dir else [])])
