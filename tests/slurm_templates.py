"""Rewrite the shipped sbatch scripts: `python tests/slurm_templates.py` (from the repository).

`slurm/*.sh` are what `hvdtrain.launch.slurm.render` writes for `TEMPLATES`, and a golden-file
test (test_launch.py) fails when they differ. After changing the renderer or a template, run this,
then review the scripts' diff like any other change. It writes into the repository, so it lives
with the tests, not in the installed package.
"""
from __future__ import annotations

from pathlib import Path

from hvdtrain.launch.slurm import TEMPLATES, render

SLURM_DIR = Path(__file__).resolve().parent.parent / "slurm"
COMMAND = "python tests/slurm_templates.py"


def write_templates(directory: Path = SLURM_DIR) -> list[Path]:
    """Render every template into ``directory`` as an executable script; the paths written."""
    written = []
    for file_name, job in TEMPLATES.items():
        path = directory / file_name
        path.write_text(render(job))
        path.chmod(0o755)
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_templates():
        print(written_path)
