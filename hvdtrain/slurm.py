"""``python -m hvdtrain.slurm`` (``hvdtrain slurm``): the sbatch script writer of
hvdtrain.launch.slurm, under its public name."""
from hvdtrain.launch.slurm import main

if __name__ == "__main__":
    main()
