"""Third-party warnings that are not ours to fix and would otherwise land inside the progress bar.

Each filter is narrow: one message, one category, raised from one module. Installed by the strategy in every rank.
"""

from __future__ import annotations

import warnings

# (message regex, category, module regex of the code that triggers it)
THIRD_PARTY_NOISE: tuple[tuple[str, type[Warning], str], ...] = (
    # torch >= 2.10 deprecates `LeafSpec`; Lightning's own pytree code still uses it on every batch.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
)


def quiet_third_party_noise() -> None:
    """Install the filters (idempotent: ``warnings`` drops an identical filter before adding it again)."""
    for message, category, module in THIRD_PARTY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
