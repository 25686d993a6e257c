"""The processes of a run: launching, supervision (no orphans, exits attributed), shutdown."""
