"""`python -m hvdtrain COMMAND [flags]`: the `hvdtrain` command (hvdtrain.cli)."""
from hvdtrain.cli import main

main()
