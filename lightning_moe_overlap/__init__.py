"""lightning-moe-overlap: expert-parallel all-to-all overlap for Mixture-of-Experts training in Lightning."""

__version__ = "0.1.0"
