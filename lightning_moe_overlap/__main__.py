"""``python -m lightning_moe_overlap`` is the ``lightning-moe-overlap`` console script."""

from lightning_moe_overlap.cli import main

if __name__ == "__main__":
    main()
