"""``python -m hvdtrain.netcheck``: the per-host probe of the launcher's network check
(hvdtrain.launch.netcheck), under the name the launcher starts it by on every host."""
from hvdtrain.launch.netcheck import main

if __name__ == "__main__":
    main()
