"""``configure_model`` under the meta device: the model arrives without memory, and each rank later allocates only
what it holds (``parallelize/materialize.py``).

Hugging Face's ``from_pretrained`` called there is recognised (``hf/pretrained.py``): on a local folder the model is
built from its ``config.json`` on meta and its weights are declared as the module's ``hf_weights``
(``declare_weights``), read after sharding by ``parallelize/steps.py``'s ``apply_pretrained``. A LightningModule with
``build_on_meta = False`` builds with real tensors instead, nothing intercepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_moe_overlap.hf.pretrained import meta_from_pretrained
from lightning_moe_overlap.parallelize.materialize import build_on_meta, declare_weights


@contextmanager
def meta_build(module: nn.Module | None, *, name: str, pp: int) -> Iterator[None]:
    """Run the body (``configure_model``) under the meta device unless ``module`` opts out; afterwards declare the
    weights of the models it loaded with ``from_pretrained`` and log once (rank 0) what was recognised and what ran
    as written. ``name``: the strategy's class name, ``pp``: its pipeline size (both for the messages).

    Raises:
        RuntimeError: a loader the meta build does not recognise refused to load weights under the meta device; the
            message names the ways out (``build_on_meta = False``, ``hf_weights``, loading in ``__init__``).
    """
    if not build_on_meta(module):
        yield
        return
    with meta_from_pretrained() as calls:  # a call not honoured runs on the device configure_model was given
        try:
            with torch.device("meta"):
                yield
        except RuntimeError as err:
            if "from_pretrained" not in str(err) or "meta device" not in str(err):
                raise
            raise RuntimeError(
                f"`{name}(pp={pp})`: `{type(module).__name__}.configure_model` runs under the meta device (at every "
                "pp, each rank allocates only what it holds), and a `from_pretrained` the strategy does not "
                "recognise refused to load weights there (it recognises `PreTrainedModel.from_pretrained` and the "
                "auto classes'). Rule: a model loaded in configure_model by another loader opts out of the meta "
                "device. Fix: set `build_on_meta = False` on the LightningModule (every rank loads the whole "
                "checkpoint into host memory, then keeps only what it holds), or build the model from its config in "
                "configure_model and declare the weights to load (`hf_weights`), or load it in `__init__`."
            ) from err
    if module is not None:
        added = declare_weights(module, calls.weights(module))
        for line in calls.describe(f"`{name}`: `{type(module).__name__}.configure_model`", added):
            rank_zero_info(line)
