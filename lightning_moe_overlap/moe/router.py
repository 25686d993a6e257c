"""Top-k router of the reference MoE layer, on megatron-core's routing math.

Returns ``(router_logits_TE, weights_TK, indices_TK)`` like a Hugging Face v5 router. Scores follow
megatron-core's ``topk_routing_with_score_function``, computed on the ``[T, K]`` values without its dense ``[T, E]``
outputs (``topk_select.py``: bitwise its results, 8 ops fewer per forward):

- ``softmax`` with ``pre_softmax=False``: top-k of the logits, then softmax over the k (weights sum to 1; equal
  to HF's softmax -> top-k -> renormalise up to rounding, not bitwise); with ``pre_softmax=True``: softmax over
  all experts, then top-k;
- ``sigmoid``: sigmoid scores, top-k (optionally on ``score + expert_bias``), renormalised when ``k > 1``;
- ``num_groups``/``group_topk``: DeepSeek-V3 group-limited top-k: the ``group_topk`` groups with the largest sums
  of their top ``top_k // group_topk`` scores are kept, then top-k among their experts (the scores are the ones the
  top-k reads: the logits for ``softmax`` without ``pre_softmax``, the biased sigmoid scores with an expert bias);
- ``scaling_factor`` multiplies the weights.

Losses are attached to the graph, megatron's ``MoEAuxLossAutoScaler`` way: the forward value is unchanged, and
the backward adds ``aux_loss_scale * d(loss)`` as if the loss had been added to the model's loss. The
load-balancing loss rides on the weights, the z-loss on the logits. ``aux_loss_scale`` lives on the router
(never a process-wide global): set it to the scale of the main loss, e.g. ``1 / num_microbatches``.

Aux-loss-free balancing (DeepSeek-V3): with ``enable_expert_bias`` the router counts tokens per expert in
``local_tokens_per_expert`` during training forwards; after each optimizer step the strategy calls
:meth:`TopKRouter.update_expert_bias` (with the data-parallel group) to nudge ``expert_bias`` by
``± expert_bias_update_rate`` towards balance. Training forwards are those of the training step itself: not a
checkpoint's recomputation in backward, nor forwards run inside :func:`not_counted` (torch's pipeline metadata
inference); the rule holds per thread, so the overlap engine's two contexts never undo each other's counts.

Shape legend:
    T: tokens    D: hidden size    E: experts    K: top-k
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.moe.topk_select import select_topk

ScoreFunction = Literal["softmax", "sigmoid"]


def _mcore_moe_utils() -> Any:
    # Imported on first use: megatron-core's import costs seconds and only the router needs it. Its import warns
    # that TE/Apex are missing for its optimizer and grad-clip kernels and about its own internal deprecations;
    # neither concerns the routing math used here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        from megatron.core.transformer.moe import moe_utils
    return moe_utils


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output``; in backward, gives ``aux_loss`` the gradient ``scale`` (megatron's auto-scaler)."""

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class _CountingState(threading.local):
    """Per thread, i.e. per execution context of the overlap engine: the open :func:`not_counted` scopes."""

    paused = 0


_COUNTING = _CountingState()  # thread-local like torch's grad mode: one context's scope never pauses another's


@contextmanager
def not_counted() -> Iterator[None]:
    """Forwards run inside, on this thread only, are not counted by the token counters (``TopKRouter``'s expert-bias
    counts, ``e_score_correction_bias`` balancers, ``RoutingStats``): a checkpoint's recomputation, torch's
    pipeline metadata inference. The overlap engine's other context keeps counting its forwards meanwhile."""
    _COUNTING.paused += 1
    try:
        yield
    finally:
        _COUNTING.paused -= 1


def _in_training_forward() -> bool:
    """False inside a backward pass, where a checkpoint's recompute runs the router again (counting its tokens
    there would double the counts of the expert-bias update), and inside :func:`not_counted`. Both are per thread.
    (Grad mode is no guide: reentrant checkpointing runs the first forward under ``no_grad``.)"""
    return torch_compat.current_graph_task_id() == -1 and _COUNTING.paused == 0


class TopKRouter(torch_compat.Float32Buffers):
    """Linear gate + top-k selection with optional group limit, expert bias, aux loss and z-loss.

    Args:
        hidden_size: ``D``.
        num_experts: ``E``.
        top_k: experts per token ``K``.
        score_function: ``"softmax"`` or ``"sigmoid"``.
        pre_softmax: softmax over all experts before top-k (see the module docstring).
        num_groups: expert groups for group-limited routing (must divide ``E``); ``None`` disables it.
        group_topk: groups kept per token with ``num_groups``.
        scaling_factor: multiplies the routing weights (DeepSeek's ``routed_scaling_factor``).
        enable_expert_bias: aux-loss-free balancing bias (needs ``score_function="sigmoid"``).
        expert_bias_update_rate: step of each :meth:`update_expert_bias`.
        aux_loss_coeff: coefficient of the switch load-balancing loss (0 disables it).
        z_loss_coeff: coefficient of the router z-loss (0 disables it).
        dtype: compute the logits in this dtype (e.g. ``torch.float32`` under bf16 training); ``None``: as input.
    """

    float32_buffers = ("expert_bias",)  # its +-1e-3 steps would vanish in 16-bit: kept float32 through `.to(bf16)`

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_function: ScoreFunction = "softmax",
        pre_softmax: bool = False,
        num_groups: int | None = None,
        group_topk: int | None = None,
        scaling_factor: float | None = None,
        enable_expert_bias: bool = False,
        expert_bias_update_rate: float = 1e-3,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _validate_router(num_experts, top_k, score_function, num_groups, group_topk, enable_expert_bias)
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function: ScoreFunction = score_function
        self.pre_softmax = pre_softmax
        self.num_groups = num_groups
        self.group_topk = group_topk
        self.scaling_factor = scaling_factor
        self.expert_bias_update_rate = expert_bias_update_rate
        self.aux_loss_coeff = aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff
        self.router_dtype = dtype
        self.aux_loss_scale = 1.0
        # The ranks that hold other tokens of the same sequences (tp with sequence parallelism); set by the strategy.
        # The balancing loss then counts the tokens of the whole sequence, as Megatron's does (``_sequence_losses``).
        self.sequence_group: dist.ProcessGroup | None = None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.expert_bias: Tensor | None
        self.local_tokens_per_expert: Tensor | None
        if enable_expert_bias:
            self.register_buffer("expert_bias", torch.empty(num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.empty(num_experts, dtype=torch.int64))
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.reset_parameters()
        # Detached values of the latest forward, for logging only (nothing reads them back).
        self.metrics: dict[str, Tensor] = {}

    def reset_parameters(self) -> None:
        """The initial state: ``weight ~ N(0, 0.02)``, expert bias and token counts zero (also what a model built on
        the meta device gets, ``parallelize/materialize.py``)."""
        nn.init.normal_(self.weight, std=0.02)
        if self.expert_bias is not None and self.local_tokens_per_expert is not None:
            with torch.no_grad():
                self.expert_bias.zero_()
                self.local_tokens_per_expert.zero_()

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden_states [..., D]`` -> ``(logits [T, E], weights [T, K], indices [T, K])``, ``T`` = all tokens."""
        mcore = _mcore_moe_utils()
        x_TD = hidden_states.reshape(-1, self.hidden_size)
        weight = self.weight
        if self.router_dtype is not None:
            x_TD, weight = x_TD.to(self.router_dtype), weight.to(self.router_dtype)
        logits_TE = nn.functional.linear(x_TD, weight)
        train_losses = torch.is_grad_enabled() and self.training
        if train_losses and self.z_loss_coeff > 0:
            z_loss = mcore.z_loss_func(logits_TE, self.z_loss_coeff) / self._sequence_ranks()
            self.metrics["z_loss"] = z_loss.detach()
            logits_TE = AuxLossScaler.apply(logits_TE, z_loss, self.aux_loss_scale)
        weights_TK, indices_TK = select_topk(
            logits_TE,
            self.top_k,
            mcore=mcore,
            pre_softmax=self.pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
            score_function=self.score_function,
            expert_bias=self.expert_bias,
        )
        if train_losses and self.aux_loss_coeff > 0:
            aux_loss = self._load_balancing_loss(logits_TE)
            self.metrics["load_balancing_loss"] = aux_loss.detach()
            weights_TK = AuxLossScaler.apply(weights_TK, aux_loss, self.aux_loss_scale)
        if self.local_tokens_per_expert is not None and self.training and _in_training_forward():
            with torch.no_grad():
                flat = indices_TK.reshape(-1)
                self.local_tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        return logits_TE, weights_TK, indices_TK

    def _sequence_ranks(self) -> int:
        group = self.sequence_group
        return 1 if group is None else dist.get_world_size(group)

    def _load_balancing_loss(self, logits_TE: Tensor) -> Tensor:
        """Megatron's switch balancing loss. With a ``sequence_group`` (``_sequence_losses``): the token counts are
        summed over it, so each rank's loss is its share of the whole sequence's and the shares add up to it; the
        z-loss, a mean over tokens, is divided by the group's size for the same reason."""
        mcore = _mcore_moe_utils()
        map_TE, scores_TE = mcore.compute_routing_scores_for_aux_loss(logits_TE, self.top_k, self.score_function)
        tokens_per_expert = map_TE.sum(dim=0)
        ranks = self._sequence_ranks()
        if ranks > 1:
            tokens_per_expert = tokens_per_expert.detach().clone()
            dist.all_reduce(tokens_per_expert, group=self.sequence_group)
        return mcore.switch_load_balancing_loss_func(
            probs=scores_TE,
            tokens_per_expert=tokens_per_expert,
            total_num_tokens=logits_TE.shape[0] * ranks,
            topk=self.top_k,
            num_experts=self.num_experts,
            moe_aux_loss_coeff=self.aux_loss_coeff,
        )

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Move ``expert_bias`` towards balance from the counts since the last call, then reset the counts.

        Collective over ``group`` when given (use the group whose ranks see different tokens: data parallel
        times context parallel); every rank of it must call this after the same optimizer step.
        """
        if self.expert_bias is None or self.local_tokens_per_expert is None:
            raise RuntimeError(
                "`TopKRouter.update_expert_bias`: this router was built with enable_expert_bias=False, so it has "
                "no bias to update. Build it with enable_expert_bias=True, or do not call this method."
            )
        counts = self.local_tokens_per_expert.to(torch.float64)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        self.expert_bias += (torch.sign(offset) * self.expert_bias_update_rate).to(self.expert_bias.dtype)
        self.local_tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_function={self.score_function!r}, expert_bias={self.expert_bias is not None}"
        )


def _validate_router(
    num_experts: int,
    top_k: int,
    score_function: str,
    num_groups: int | None,
    group_topk: int | None,
    enable_expert_bias: bool,
) -> None:
    owner = "`TopKRouter`"
    if score_function not in ("softmax", "sigmoid"):
        raise ValueError(f"{owner}: score_function={score_function!r} is not 'softmax' or 'sigmoid'; pick one.")
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{owner}: top_k={top_k} with num_experts={num_experts}; the rule is 1 <= top_k <= num_experts. "
            f"Choose top_k in [1, {num_experts}]."
        )
    if (num_groups is None) != (group_topk is None):
        raise ValueError(
            f"{owner}: num_groups={num_groups!r} and group_topk={group_topk!r}; group-limited routing needs both "
            "or neither. Set both (DeepSeek-V3: n_group and topk_group) or leave both None."
        )
    if (
        num_groups is not None
        and group_topk is not None
        and (num_experts % num_groups or not 1 <= group_topk <= num_groups or top_k % group_topk)
    ):
        raise ValueError(
            f"{owner}: num_groups={num_groups}, group_topk={group_topk}, top_k={top_k}, "
            f"num_experts={num_experts}; the rules are num_experts % num_groups == 0, "
            "1 <= group_topk <= num_groups and top_k % group_topk == 0. Pick num_groups among the divisors of "
            "num_experts and a group_topk that divides top_k."
        )
    if num_groups is not None and group_topk is not None and top_k // group_topk > num_experts // num_groups:
        per_group = num_experts // num_groups
        raise ValueError(
            f"{owner}: top_k={top_k}, group_topk={group_topk}, num_groups={num_groups}, num_experts={num_experts}; "
            f"each kept group is scored by the sum of its top top_k // group_topk = {top_k // group_topk} scores and "
            f"holds num_experts // num_groups = {per_group} experts, so the rule is top_k // group_topk <= "
            f"num_experts // num_groups. Keep more groups (group_topk >= {-(-top_k // per_group)}), use fewer "
            "groups, or a smaller top_k."
        )
    if enable_expert_bias and score_function != "sigmoid":
        raise NotImplementedError(
            f"{owner}: enable_expert_bias=True with score_function={score_function!r}; megatron-core applies the "
            "expert bias only to sigmoid scores. Use score_function='sigmoid' (DeepSeek-V3) or disable the bias."
        )
