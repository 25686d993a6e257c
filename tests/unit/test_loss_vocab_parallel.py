"""``loss_parallel_scope``: torch's ``loss_parallel`` handlers (process-wide) are removed when the body raises, as
when it returns; oracle: whether ``DTensor``'s op table holds them (``loss_parallel_enabled``). The distributed
behaviour of the loss-parallel and fused heads is tested in tests/distributed/test_tensor_parallel_grads.py and
test_loss_parallel.py."""

from __future__ import annotations

import pytest

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.loss.vocab_parallel import loss_parallel_scope


def test_the_scope_is_left_when_its_body_returns_or_raises() -> None:
    with loss_parallel_scope():
        assert torch_compat.loss_parallel_enabled()
    assert not torch_compat.loss_parallel_enabled()
    with pytest.raises(ValueError, match="a failed step"), loss_parallel_scope():
        assert torch_compat.loss_parallel_enabled()
        raise ValueError("a failed step")
    assert not torch_compat.loss_parallel_enabled()
