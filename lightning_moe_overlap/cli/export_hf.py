"""``lightning-moe-overlap export-hf CKPT DST --config PATH``: a checkpoint this package saved written as a Hugging Face
folder. A sharded directory is read and written in parts (:func:`~lightning_moe_overlap.hf.sharded_export.
export_checkpoint_hf`): under ``torchrun --nproc-per-node N`` each process holds ``1 / N`` of the model; a consolidated
file (or a version-1 directory) is read whole by one process (:func:`~lightning_moe_overlap.hf.export.export_hf`;
rank 0 under torchrun)."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from pathlib import Path

import torch.distributed as dist

from lightning_moe_overlap.checkpoint import safe_load
from lightning_moe_overlap.checkpoint.atomic import COMMIT_MARKER, read_marker
from lightning_moe_overlap.checkpoint.consolidated import load_consolidated_state_dict
from lightning_moe_overlap.checkpoint.fit_checks import agree
from lightning_moe_overlap.checkpoint.legacy import is_legacy
from lightning_moe_overlap.hf.export import CONFIG, DEFAULT_SHARD, INDEX, export_hf, parse_size
from lightning_moe_overlap.hf.files import GENERATION_CONFIG
from lightning_moe_overlap.hf.sharded_export import export_checkpoint_hf


def main(argv: list[str]) -> int:
    """``export-hf CKPT DST --config PATH``: the command-line form of :func:`export_hf` for a saved checkpoint.

    Returns 0 when written; 1 with the error's message on stderr (no traceback) when the checkpoint cannot be read
    or exported. Bad arguments exit with argparse's usage message (status 2).
    """
    prog = "lightning-moe-overlap export-hf"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a checkpoint this package saved (sharded directory or consolidated file) as a Hugging "
        "Face checkpoint folder (config.json + safetensors in the Hub's layout, sharded by size). A sharded directory "
        "is read in parts: under `torchrun --nproc-per-node N` each process holds 1/N of the model. A consolidated "
        "file is read whole, in one process.",
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
    if not Path(args.checkpoint).exists():
        print(f"{prog}: error: no checkpoint at {args.checkpoint}. Check the path.", file=sys.stderr)
        return 1
    started_group = _join_torchrun()
    try:
        limit = parse_size(args.max_shard_size)
        options = {"config": args.config, "family": args.family, "max_shard_bytes": limit, "overwrite": args.overwrite}
        if _in_parts(Path(args.checkpoint)):
            out = export_checkpoint_hf(
                args.checkpoint, args.destination, prefix=args.prefix, weights_only=args.weights_only, **options
            ).folder
        else:
            out = _export_whole(args, options)
    except (OSError, ValueError, TypeError, RuntimeError, NotImplementedError, pickle.UnpicklingError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    finally:
        if started_group:
            dist.destroy_process_group()
    if not started_group or int(os.environ.get("RANK", "0")) == 0:
        files = sorted(p.name for p in out.glob("model*.safetensors"))
        files += [n for n in (INDEX, CONFIG, GENERATION_CONFIG) if (out / n).exists()]
        print(json.dumps({"exported": str(args.checkpoint), "to": str(out), "files": files}))
    return 0


def _export_whole(args: argparse.Namespace, options: dict) -> Path:
    """A consolidated file (or a version-1 directory), read whole: by rank 0 alone under torchrun (the others wait
    and raise its error, if any)."""
    error: Exception | None = None
    out = Path(args.destination)
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            state = load_consolidated_state_dict(args.checkpoint, weights_only=args.weights_only)
            out = export_hf(state, args.destination, prefix=args.prefix, **options)
        except (OSError, ValueError, TypeError, RuntimeError, NotImplementedError, pickle.UnpicklingError) as err:
            error = err
    agree(error)
    return out


def _in_parts(path: Path) -> bool:
    """A committed sharded directory of format version 2: read in parts (a file or a version-1 directory is read
    whole)."""
    return path.is_dir() and (path / COMMIT_MARKER).is_file() and not is_legacy(read_marker(path))


def _join_torchrun() -> bool:
    """Under ``torchrun`` with several processes, join their group (gloo: the parts are read on the CPU); whether it
    was started here."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    dist.init_process_group("gloo")
    return True
