"""``lightning-moe-overlap export-hf CKPT DST --config PATH``: a checkpoint this package saved written as a Hugging Face
folder (:func:`~lightning_moe_overlap.hf.export.export_hf`), in one process."""

from __future__ import annotations

import argparse
import json
import pickle
import sys

from lightning_moe_overlap.checkpoint import safe_load
from lightning_moe_overlap.checkpoint.consolidated import load_consolidated_state_dict
from lightning_moe_overlap.hf.export import CONFIG, DEFAULT_SHARD, INDEX, export_hf, parse_size


def main(argv: list[str]) -> int:
    """``export-hf CKPT DST --config PATH``: the command-line form of :func:`export_hf` for a saved checkpoint.

    Returns 0 when written; 1 with the error's message on stderr (no traceback) when the checkpoint cannot be read
    or exported. Bad arguments exit with argparse's usage message (status 2).
    """
    prog = "lightning-moe-overlap export-hf"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a checkpoint this package saved (sharded directory or consolidated file) as a Hugging "
        "Face checkpoint folder (config.json + safetensors in the Hub's layout, sharded by size), in one process "
        "(needs the memory of the whole model).",
    )
    parser.add_argument("checkpoint", help="the checkpoint: a sharded directory or a consolidated file")
    parser.add_argument("destination", help="the folder to write (new or empty, unless --overwrite)")
    parser.add_argument("--config", required=True, help="the model's config.json, or a folder holding it")
    parser.add_argument("--prefix", default="model.", help="where the HF model sits in the keys (default: model.)")
    parser.add_argument("--family", default=None, help="key layout to write (default: from the config's model_type)")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD, help=f"largest file (default: {DEFAULT_SHARD})")
    parser.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty folder")
    safe_load.add_weights_only_flag(parser)
    args = parser.parse_args(argv)
    try:
        limit = parse_size(args.max_shard_size)
        state = load_consolidated_state_dict(args.checkpoint, weights_only=args.weights_only)
        out = export_hf(
            state, args.destination, config=args.config, family=args.family, prefix=args.prefix,
            max_shard_bytes=limit, overwrite=args.overwrite,
        )  # fmt: skip
    except (OSError, ValueError, TypeError, RuntimeError, NotImplementedError, pickle.UnpicklingError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in out.glob("model*.safetensors")) + [n for n in (INDEX, CONFIG) if (out / n).exists()]
    print(json.dumps({"exported": str(args.checkpoint), "to": str(out), "files": files}))
    return 0
