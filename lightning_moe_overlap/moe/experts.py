"""The routed experts as 3-D weight tensors, in the Hugging Face transformers v5 layout and call signature.

``gate_up_proj`` is ``[E, 2F, D]`` (gate rows first, then up rows), ``down_proj`` is ``[E, D, F]``, and
``forward(hidden_states_TD, top_k_index_TK, top_k_weights_TK) -> out_TD`` computes
``sum_k w_tk * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = top_k_index[t, k]``. Indices outside
``[0, E)`` (HF marks dropped choices with ``E``) contribute nothing. Because the interface matches HF, the same
expert-parallel wrapper serves this module and every HF v5 experts module.

Shape legend:
    T: tokens   K: top-k   D: hidden size   F: expert ffn size   E: experts   A: kept (token, choice) pairs
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_moe_overlap.moe.grouped import GemmImpl, ProjectionKernel, grouped_mlp
from lightning_moe_overlap.moe.permute import gather_rows, scatter_weighted, sort_by_expert
from lightning_moe_overlap.overlap.runtime import CommRuntime

ExpertsImpl = Literal["grouped", "loop"]

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
}


def make_activation(activation: str | nn.Module) -> nn.Module:
    """An activation module from its name (``silu``, ``gelu``, ``gelu_tanh``, ``relu``) or as given."""
    if isinstance(activation, nn.Module):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not a known activation name; the names are {sorted(ACTIVATIONS)}. "
            "Pass one of them or an `nn.Module`."
        )
    return ACTIVATIONS[activation]()


def routed_experts_forward(
    hidden_TD: Tensor,
    indices_TK: Tensor,
    weights_TK: Tensor,
    gate_up_eFD: Tensor,
    down_eDF: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    runtime: CommRuntime | None = None,
    impl: GemmImpl = "auto",
    kernel: ProjectionKernel | None = None,
) -> Tensor:
    """Single-process grouped path: sort the assignments by expert, run :func:`grouped_mlp`, scatter back.

    Host syncs: one, the number of kept rows (``counts_E.sum()``, a shape); the grouped GEMMs need none. The
    loop GEMMs (``impl="loop"``, or where the grouped kernel does not apply) read the counts back once more.
    """
    num_experts = gate_up_eFD.shape[0]
    order_TK, counts_E = sort_by_expert(indices_TK, num_experts)
    kept = int(counts_E.sum())  # NOTE: D2H sync (the number of kept rows is a shape)
    assign_A = order_TK[:kept]
    x_AD = gather_rows(hidden_TD, assign_A, indices_TK.shape[-1])
    # The counts stay on the device: the grouped GEMM builds its offsets there (the loop reads them back).
    y_AD = grouped_mlp(x_AD, counts_E, gate_up_eFD, down_eDF, act_fn, runtime, impl=impl, kernel=kernel)
    return scatter_weighted(y_AD, assign_A, weights_TK, hidden_TD.shape[0], hidden_TD.dtype)


class Experts(nn.Module):
    """``num_experts`` gated MLP experts held as two 3-D parameters (HF v5 layout and forward signature).

    Attribute ``kernel``: the projections' kernel on the grouped path (``None``: ``GroupedLinear``; the FP8 experts'
    kernel after ``lightning_moe_overlap.fp8.apply_fp8``), a plain attribute, not a parameter or buffer. With a kernel
    set, ``impl="loop"`` takes the grouped path too (the kernel is the computation).

    Args:
        num_experts: number of routed experts ``E``.
        hidden_size: model hidden size ``D``.
        ffn_hidden_size: per-expert intermediate size ``F``.
        activation: activation name (``silu``, ``gelu``, ``gelu_tanh``, ``relu``) or module.
        impl: ``"grouped"`` (sort by expert, grouped GEMM where supported) or ``"loop"`` (one masked pass per
            expert, like HF eager; the test oracle).
        init_std: standard deviation of the normal initialisation.
        runtime: where deferred weight-gradient GEMMs go; ``None`` computes them inline.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str | nn.Module = "silu",
        impl: ExpertsImpl = "grouped",
        init_std: float = 0.02,
        runtime: CommRuntime | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`Experts`: {name}={value!r} must be a positive integer.")
        if impl not in ("grouped", "loop"):
            raise ValueError(f"`Experts`: impl={impl!r} is not 'grouped' or 'loop'; pick one of those.")
        self.num_experts = num_experts
        self.hidden_dim = hidden_size
        self.intermediate_dim = ffn_hidden_size
        self.impl: ExpertsImpl = impl
        self.runtime = runtime
        self.kernel: ProjectionKernel | None = None
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **factory))
        self.act_fn = make_activation(activation)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.init_std)
        nn.init.normal_(self.down_proj, std=self.init_std / math.sqrt(2.0))

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``hidden_states [T, D]``, ``top_k_index [T, K]``, ``top_k_weights [T, K]`` -> ``[T, D]``."""
        if self.impl == "loop" and self.kernel is None:
            return self.forward_loop(hidden_states, top_k_index, top_k_weights)
        return routed_experts_forward(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn, self.runtime,
            kernel=self.kernel,
        )

    def forward_loop(self, hidden_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor) -> Tensor:
        """Reference path: for each expert, its tokens through ``down(act(gate) * up)``, weighted, summed."""
        out_TD = torch.zeros_like(hidden_TD)
        for expert in range(self.num_experts):
            token_idx, choice_idx = torch.where(indices_TK == expert)
            if token_idx.numel() == 0:  # NOTE: D2H sync (reference path only)
                continue
            gate, up = nn.functional.linear(hidden_TD[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            y = y * weights_TK[token_idx, choice_idx, None]
            out_TD = out_TD.index_add(0, token_idx, y.to(out_TD.dtype))
        return out_TD

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_dim}, "
            f"ffn_hidden_size={self.intermediate_dim}, impl={self.impl!r}"
        )
