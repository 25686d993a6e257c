"""``lightning-moe-overlap convert-checkpoint SRC DST``: a sharded checkpoint of format version 1 rewritten as version 2
(:func:`~lightning_moe_overlap.checkpoint.legacy.convert_legacy_checkpoint`), in one process."""

from __future__ import annotations

import argparse
import json
import sys

from lightning_moe_overlap.checkpoint import safe_load
from lightning_moe_overlap.checkpoint.legacy import convert_legacy_checkpoint


def main(argv: list[str]) -> int:
    """``convert-checkpoint SRC DST``: the command-line form of :func:`convert_legacy_checkpoint`.

    Returns 0 when converted; 1 with the error's message on stderr (no traceback) when the source cannot be
    converted. Bad arguments exit with argparse's usage message (status 2).
    """
    prog = "lightning-moe-overlap convert-checkpoint"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert a sharded checkpoint of format version 1 (per-expert keys) into version 2, in one "
        "process (needs the memory of the whole checkpoint).",
    )
    parser.add_argument("source", help="the version-1 checkpoint directory")
    parser.add_argument("destination", help="where to write the version-2 directory")
    safe_load.add_weights_only_flag(parser)
    args = parser.parse_args(argv)
    try:
        out = convert_legacy_checkpoint(args.source, args.destination, weights_only=args.weights_only)
    except (OSError, ValueError, TypeError, RuntimeError, NotImplementedError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"converted": str(args.source), "to": str(out)}))
    return 0
