"""``from_pretrained`` inside ``configure_model`` under the meta device: the model is built from its folder's
``config.json`` on meta, and its weights are declared for the load that reads each rank's part after sharding.

:func:`meta_from_pretrained` is the scope (``MoEOverlapStrategy.model_sharded_context`` opens it around
``configure_model`` only). While it is open, this thread's calls of ``PreTrainedModel.from_pretrained`` (where the
auto classes' ``from_pretrained`` ends, ``AutoModelForCausalLM.from_pretrained(folder)`` among them) are recognised:

- **honoured**: a local folder with ``config.json`` and ``*.safetensors`` whose keys fill the model (headers only,
  the load's own match), called with arguments a build from the config keeps (the config's own keyword arguments,
  ``config=``, ``dtype``, ``attn_implementation``, ``experts_implementation``, and download options a local folder
  ignores): the model is built on the meta device with its class's ``from_config``, float32 unless the call names a
  ``dtype`` (as ``demo_hf.build_hf_model_from``), in eval mode as ``from_pretrained`` returns it, and remembered;
- **run as written** otherwise (a Hub id, ``device_map``, ``quantization_config``, ``state_dict``, positional model
  arguments, a class with its own ``from_pretrained``, ...): out of the meta device, on ``device``, so this rank reads
  the whole checkpoint (:attr:`PretrainedCalls.fell_back` says why).

After ``configure_model``, :meth:`PretrainedCalls.weights` finds each remembered model's attribute path in the
LightningModule and gives ``HFWeights(folder, prefix=path + ".")`` for it; a model that is not reachable there gets
its values from the call as written instead (out of meta, every rank reading the whole checkpoint).

The interception replaces ``PreTrainedModel.from_pretrained`` while at least one scope is open in any thread (a lock
counts them) and puts the original back when the last one closes, on error too; a call from another thread, or one
made while a recognised call runs, goes to the original unchanged.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe_overlap._compat import transformers as hf_compat
from lightning_moe_overlap.hf.load import HFWeights, match_files

SCALABLE = (
    "The path that scales: build the model from its config in configure_model and declare the weights, "
    "`self.hf_weights = HFWeights(folder, prefix=...)` (lightning_moe_overlap.hf), or use "
    "`HFMoECausalLM(pretrained=folder)` (docs/hf_checkpoints.md)."
)

# keyword arguments of `from_pretrained` that a build from the config honours or that do not matter for a local folder
_BUILD = frozenset({"dtype", "torch_dtype", "attn_implementation", "experts_implementation"})
_NO_EFFECT = frozenset({
    "cache_dir", "force_download", "local_files_only", "token", "revision", "proxies", "code_revision", "_commit_hash",
    "weights_only", "disable_mmap", "tqdm_class", "_from_auto", "_from_pipeline", "trust_remote_code",
    "low_cpu_mem_usage", "mirror", "_fast_init", "offload_state_dict", "from_tf", "from_flax",
})  # fmt: skip
_QUIET = frozenset({"config", "adapter_kwargs"})  # what the auto classes pass on: not shown in the log
# arguments a build on the meta device cannot honour, with the value that means "not used"
_UNHONOURED_DEFAULTS: dict[str, Any] = {
    "device_map": None, "max_memory": None, "offload_folder": None, "offload_buffers": False,
    "quantization_config": None, "state_dict": None, "variant": None, "gguf_file": None, "subfolder": "",
    "distributed_config": None, "device_mesh": None, "tp_plan": None, "tp_size": None, "key_mapping": None,
    "use_kernels": False, "kernel_config": None, "allow_all_kernels": False, "output_loading_info": False,
    "generation_config": None, "fusion_config": None, "ignore_mismatched_sizes": False, "adapter_name": "default",
}  # fmt: skip


def _at_default(name: str, value: Any) -> bool:
    """Whether ``value`` is the "not used" value of ``name`` (the auto classes pass some on, e.g. ``subfolder=''``)."""
    default = _UNHONOURED_DEFAULTS.get(name, ...)
    return value is default or (type(value) is type(default) and isinstance(value, (str, bool)) and value == default)


@dataclass(frozen=True)
class Call:
    """One ``from_pretrained`` call, as the model class's own ``from_pretrained`` received it."""

    cls: type
    path: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def describe(self) -> str:
        """``Qwen3MoeForCausalLM.from_pretrained('/models/x', device_map='cpu')``: what the user's code asked for."""
        shown = [repr(str(self.path)), *map(repr, self.args)]
        shown += [f"{k}={v!r}" for k, v in self.kwargs.items()
                  if k not in _NO_EFFECT and k not in _QUIET and not _at_default(k, v)]  # fmt: skip
        return f"`{self.cls.__name__}.from_pretrained({', '.join(shown)})`"

    def run(self, device: torch.device) -> nn.Module:
        """The call as written, out of the meta device (on ``device``): Hugging Face's own loader."""
        with _busy(), torch.device(device):
            return _PATCH.original(self.cls, self.path, *self.args, **self.kwargs)


@dataclass(frozen=True)
class Recognised:
    """A call built on the meta device: its model waits for the weights of ``folder``."""

    call: Call
    folder: str | os.PathLike
    model: nn.Module


@dataclass(frozen=True)
class FellBack:
    """A call that ran as written (real tensors, the whole checkpoint on this rank), and why."""

    call: Call
    reason: str


@dataclass
class PretrainedCalls:
    """The ``from_pretrained`` calls of one ``configure_model`` (:func:`meta_from_pretrained`).

    Attributes:
        device: where a call that is not honoured runs (the rank's device).
        recognised: the calls built on the meta device.
        fell_back: the calls that ran as written, with the reason.
        declared: ``(call, prefix)`` of each recognised model found in the module (:meth:`weights`).
    """

    device: torch.device
    recognised: list[Recognised] = field(default_factory=list)
    fell_back: list[FellBack] = field(default_factory=list)
    declared: list[tuple[Call, str]] = field(default_factory=list)

    def intercept(self, call: Call) -> nn.Module:
        """The model for ``call``: built on meta when honoured (remembered), else the call run as written."""
        with _busy():
            reason = _unhonoured(call)
            built = None
            if reason is None:
                built, reason = _build_on_meta(call)
        if built is None:
            self.fell_back.append(FellBack(call, reason or "unknown"))
            return call.run(self.device)
        self.recognised.append(Recognised(call, call.path, built))
        return built

    def weights(self, module: nn.Module) -> list[HFWeights]:
        """``HFWeights(folder, prefix=<attribute path>.)`` of each recognised model reachable in ``module``; one that
        is not reachable is given its values by the call as written (out of meta), and counts as fallen back."""
        names: dict[int, str] = {}
        for name, m in module.named_modules():
            names.setdefault(id(m), name)
        found = []
        for item in self.recognised:
            name = names.get(id(item.model))
            if not name:
                _adopt(item.model, item.call.run(self.device))
                why = "the model it returns is not an attribute of the LightningModule, so no prefix names its weights"
                self.fell_back.append(FellBack(item.call, why))
                continue
            self.declared.append((item.call, f"{name}."))
            found.append(HFWeights(item.folder, prefix=f"{name}."))
        return found

    def describe(self, owner: str, added: list[HFWeights]) -> list[str]:
        """The lines to log once: what was built on meta and declared, and what ran as written (with
        :data:`SCALABLE`); ``added``: the weights declared (the others were the module's own)."""
        lines = []
        prefixes = {w.prefix for w in added}
        if self.declared:
            parts = [
                f"{call.describe()} -> `HFWeights({str(call.path)!r}, prefix={prefix!r})`"
                + ("" if prefix in prefixes else " (the module's own `hf_weights` covers it)")
                for call, prefix in self.declared
            ]
            lines.append(
                f"{owner}: built on the meta device from config.json, each rank reading its part of the checkpoint "
                f"after sharding: {'; '.join(parts)}."
            )
        if self.fell_back:
            parts = [f"{f.call.describe()} ({f.reason})" for f in self.fell_back]
            lines.append(
                f"{owner}: ran as written, with real tensors, every rank reading the whole checkpoint into memory: "
                f"{'; '.join(parts)}. {SCALABLE}"
            )
        return lines


@contextmanager
def meta_from_pretrained(device: torch.device | None = None) -> Iterator[PretrainedCalls]:
    """Recognise this thread's ``from_pretrained`` calls while open (see the module docstring); the calls come back
    in the :class:`PretrainedCalls` it yields. A call not honoured runs on ``device`` (None: the device tensors are
    created on when the scope opens, e.g. Lightning's ``tensor_init_context``'s). Without transformers installed,
    nothing is intercepted."""
    calls = PretrainedCalls(torch.empty(0).device if device is None else torch.device(device))
    with _PATCH.installed():
        outer = getattr(_STATE, "calls", None)
        _STATE.calls = calls
        try:
            yield calls
        finally:
            _STATE.calls = outer


# -- the interception --------------------------------------------------------------------------------------------
_STATE = threading.local()  # .calls: the innermost open scope of this thread; .busy: a recognised call runs


class _Patch:
    """``PreTrainedModel.from_pretrained`` replaced while any scope is open (counted under a lock); one instance,
    :data:`_PATCH` (an instance, so that the saved classmethod is not bound on access)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.saved: Any = None  # the class attribute put back (the original classmethod)

    def original(self, cls: type, path: Any, *args: Any, **kwargs: Any) -> nn.Module:
        """Hugging Face's own ``from_pretrained`` for ``cls``, whether the replacement is in place or not."""
        from transformers import PreTrainedModel

        descriptor = self.saved if self.saved is not None else PreTrainedModel.__dict__["from_pretrained"]
        return descriptor.__func__(cls, path, *args, **kwargs)

    @contextmanager
    def installed(self) -> Iterator[None]:
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover - depends on the environment
            yield
            return
        with self.lock:
            if self.count == 0:
                self.saved = PreTrainedModel.__dict__["from_pretrained"]
                PreTrainedModel.from_pretrained = classmethod(_intercepted)
            self.count += 1
        try:
            yield
        finally:
            with self.lock:
                self.count -= 1
                if self.count == 0:
                    PreTrainedModel.from_pretrained = self.saved
                    self.saved = None


_PATCH = _Patch()


def _intercepted(cls: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> nn.Module:
    calls = getattr(_STATE, "calls", None)
    if calls is None or getattr(_STATE, "busy", False):  # another thread, or a call inside a recognised one
        return _PATCH.original(cls, pretrained_model_name_or_path, *args, **kwargs)
    return calls.intercept(Call(cls, pretrained_model_name_or_path, args, dict(kwargs)))


@contextmanager
def _busy() -> Iterator[None]:
    outer = getattr(_STATE, "busy", False)
    _STATE.busy = True
    try:
        yield
    finally:
        _STATE.busy = outer


# -- honoured or not ---------------------------------------------------------------------------------------------
def _unhonoured(call: Call) -> str | None:
    """Why ``call`` cannot be built on meta and loaded by rank (None: it can), from its arguments and folder only."""
    own = getattr(call.cls.from_pretrained, "__func__", None)
    if own is not _intercepted:
        return f"`{call.cls.__name__}` has its own `from_pretrained`"
    if call.args:
        return f"positional arguments for the model's `__init__` ({len(call.args)})"
    where = Path(call.path) if isinstance(call.path, (str, os.PathLike)) else None
    if where is None or not (where / "config.json").is_file():
        return "not a local folder with a config.json (a Hub id is read by Hugging Face's own loader)"
    if (where / "adapter_config.json").is_file():
        return "the folder holds an adapter (adapter_config.json)"
    used = sorted(k for k, default in _UNHONOURED_DEFAULTS.items() if k in call.kwargs and call.kwargs[k] != default)
    if call.kwargs.get("use_safetensors") is False:
        used.append("use_safetensors")
    if "_adapter_model_path" in (call.kwargs.get("adapter_kwargs") or {}):
        used.append("adapter_kwargs")
    if used:
        return f"{', '.join(f'`{k}`' for k in used)} has no meaning for a build on the meta device"
    config = call.kwargs.get("config")
    if config is not None and not hasattr(config, "to_dict"):
        return f"`config={config!r}` is not a config object"
    return None


def _build_on_meta(call: Call) -> tuple[nn.Module | None, str | None]:
    """``(model on meta, None)``, or ``(None, why not)`` when the config or the files do not allow it."""
    folder = Path(str(call.path))
    settings = {k: v for k, v in call.kwargs.items() if k in _BUILD}
    rest = {
        k: v for k, v in call.kwargs.items()
        if k not in _BUILD and k not in _NO_EFFECT and k not in _UNHONOURED_DEFAULTS
        and k not in ("config", "use_safetensors", "adapter_kwargs")
    }  # fmt: skip
    config = call.kwargs.get("config")
    if config is None:
        config, rest = call.cls.config_class.from_pretrained(folder, return_unused_kwargs=True, **rest)
    else:
        config = copy.deepcopy(config)  # as `from_pretrained` does: the caller's object is left as it was
    if rest:
        return None, f"arguments for the model's `__init__`: {', '.join(f'`{k}`' for k in sorted(rest))}"
    if getattr(config, "quantization_config", None) is not None:
        return None, "its config.json quantizes the model (`quantization_config`)"
    dtype = _dtype(settings.pop("dtype", None) or settings.pop("torch_dtype", None), config)
    settings.pop("torch_dtype", None)
    with torch.device("meta"):
        model = hf_compat.from_config(call.cls, config, dtype=dtype, **settings)
    model.config.name_or_path = str(call.path)
    model.eval()  # as `from_pretrained` returns it
    shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    try:
        with torch.device("cpu"):  # headers only, the load's own match (its coverage counts are real tensors)
            match_files(folder, shapes, family=None, prefix="", ignore=())
    except (ValueError, NotImplementedError, OSError) as err:
        return None, f"its files do not fill the model built from its config: {str(err).splitlines()[0][:300]}"
    return model, None


def _dtype(named: Any, config: Any) -> torch.dtype:
    """The parameters' dtype: float32 (the master weights) unless the call names one; ``"auto"``: the config's."""
    if named == "auto":
        named = getattr(config, "dtype", None) or torch.float32
    if named is None:
        return torch.float32
    return getattr(torch, named) if isinstance(named, str) else named


def _adopt(target: nn.Module, source: nn.Module) -> None:
    """Give ``target`` (built on meta) the parameters and buffers of ``source`` (the same class from the same
    config, with values); tied tensors stay tied, as in ``source``."""
    pairs = zip(target.named_modules(remove_duplicate=False), source.named_modules(remove_duplicate=False))
    for (name, mine), (theirs_name, theirs) in pairs:
        if name != theirs_name:
            raise RuntimeError(
                f"`from_pretrained` out of the meta device: the model built from the config has module {name!r} where "
                f"the loaded one has {theirs_name!r}. Rule: both come from the same class and config. Fix: load it "
                "in configure_model with `build_on_meta = False` on the LightningModule."
            )
        persistent = set(theirs.state_dict(keep_vars=True))
        for key, param in theirs.named_parameters(recurse=False):
            mine.register_parameter(key, param)
        for key, buffer in theirs.named_buffers(recurse=False):
            mine.register_buffer(key, buffer, persistent=key in persistent)
    target.train(source.training)

