"""``lightning-moe-overlap consolidate-checkpoint SRC DST``: a sharded checkpoint directory written as one consolidated
file (:func:`~lightning_moe_overlap.checkpoint.consolidated.consolidate_checkpoint`), in one process."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

from lightning_moe_overlap.checkpoint import safe_load
from lightning_moe_overlap.checkpoint.atomic import local_path
from lightning_moe_overlap.checkpoint.consolidated import check_destination, consolidate_checkpoint


def main(argv: list[str]) -> int:
    """``consolidate-checkpoint SRC DST``: the command-line form of :func:`consolidate_checkpoint`.

    Returns 0 when written; 1 with the error's message on stderr (no traceback) when the source cannot be read.
    Bad arguments exit with argparse's usage message (status 2).
    """
    prog = "lightning-moe-overlap consolidate-checkpoint"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert a sharded checkpoint directory into one consolidated file, the one an unsharded "
        "single-process run would write, in one process (needs the memory of the whole checkpoint).",
    )
    parser.add_argument("source", help="the sharded checkpoint directory (format version 1 or 2)")
    parser.add_argument("destination", help="the file to write (refused when it exists, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination file")
    safe_load.add_weights_only_flag(parser)
    args = parser.parse_args(argv)
    try:
        source = local_path(args.source, "`consolidate-checkpoint`")
        if source.is_file():
            raise ValueError(
                f"`consolidate-checkpoint`: {source} is a file, not a sharded checkpoint directory; a file is "
                "already consolidated. Load it directly, or pass the directory a sharded save wrote."
            )
        check_destination(Path(args.destination), overwrite=args.overwrite)
        out = consolidate_checkpoint(source, args.destination, weights_only=args.weights_only)
    except (OSError, ValueError, TypeError, RuntimeError, NotImplementedError, pickle.UnpicklingError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"consolidated": str(args.source), "to": str(out)}))
    return 0
