"""Tolerances derived from floating-point arithmetic, for tests that compare two computations of the same quantity
which may sum in different orders (blocked vs whole, fused vs unfused, sharded vs one process).

Why not a fitted number: ATen picks its CPU kernels at run time (``ATEN_CPU_CAPABILITY`` = ``default``, ``avx2``,
``avx512``, the best the CPU has unless set), and each kernel sums a reduction in its own order (vector width,
blocking, a tree or a running sum). A tolerance fitted to the differences one machine shows fails on another.

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1 inner products, §4.2 summation):
a sum of ``n`` terms (or a dot product of length ``n``: each product rounded once, then summed) computed in floating
point with unit roundoff ``u``, in any order, is within ``gamma_n * sum(|terms|)`` of the exact value,
``gamma_n = n u / (1 - n u)``.
Two orders are therefore within ``2 gamma_n * sum(|terms|)`` of each other: :func:`reordered_sum_tol`. Errors in
series add (to first order), and ``gamma_a + gamma_b <= gamma_(a+b)``, so a chain of reordered sums of lengths
``a``, ``b``, ... relative to the same scale is bounded by :func:`reordered_sum_tol` of ``a + b + ...``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

EPS32 = torch.finfo(torch.float32).eps  # 2**-23


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u``: half the distance from 1 to the next number of ``dtype`` (2**-24 for float32, 2**-53 for float64)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative error bound of a sum of ``n`` terms (Higham, §3.1)."""
    nu = n * unit_roundoff(dtype)
    if not 0 <= nu < 1:
        raise ValueError(f"gamma({n}, {dtype}): n * u = {nu}. Rule: 0 <= n * u < 1 for the bound to hold.")
    return nu / (1 - nu)


def reordered_sum_tol(n: int, scale: float | Tensor, dtype: torch.dtype = torch.float32) -> float | Tensor:
    """How far two evaluations of the same sum of ``n`` terms of ``dtype``, in different orders, can be apart:
    ``2 * gamma_n * scale``, ``scale`` being ``sum(|terms|)`` (``sum(|a_i * b_i|)`` for a dot product; a tensor of
    them gives a bound per entry). About ``n * eps * scale`` (``eps = 2 u``)."""
    return 2 * gamma(n, dtype) * scale


def softmax_tol(vocab: int, logit_terms: float, width: int, blocks: int = 1,
                dtype: torch.dtype = torch.float32) -> float:
    """How far two evaluations of ``softmax(z)``, ``z = h @ W.T + b`` over ``vocab`` classes, can be apart, relative
    to each probability (and absolutely, for a log-sum-exp ``lse`` or a log-probability ``z - lse``): the chain of
    reordered sums and roundings in it, each term :func:`reordered_sum_tol` of its length.

    - Each logit is a dot product of length ``width`` plus the bias: ``width + 2`` (the bias, the max subtracted)
      times ``logit_terms``, the largest ``sum_d |h_d w_d| + |b|`` of a logit, absolutely (``width=0``: logits
      computed in a wider dtype and rounded once). ``exp`` turns it into a relative error; it enters the numerator
      and the normaliser: twice.
    - The normaliser ``sum_v exp(z_v - max)``: ``vocab`` positive terms, each ``exp`` within 1 ulp (vectorised
      ``exp`` such as SLEEF's is not correctly rounded: ``2 u``, +2), and an online softmax over ``blocks``
      vocabulary blocks rescales its running sum once per block (a rounded ``exp`` factor and a product: +2 each):
      ``vocab + 2 + 2 * blocks`` relatively, which the ``log`` turns into an absolute error of ``lse``.
    - The scalar steps: ``log`` (1 ulp of at most ``log(vocab)``), ``max + log``, ``z - lse`` (each ``u`` of at most
      ``logit_terms + log(vocab)``): 4 times that; the numerator's ``exp`` (1 ulp): 2.
    """
    scalars = logit_terms + math.log(vocab)
    return (
        2 * reordered_sum_tol(width + 2, logit_terms, dtype)
        + reordered_sum_tol(vocab + 2 + 2 * blocks, 1.0, dtype)
        + reordered_sum_tol(4, scalars, dtype)
        + reordered_sum_tol(2, 1.0, dtype)
    )


def blocks_of(n: int, chunk: int) -> int:
    """How many blocks of ``chunk`` cover ``n`` (the last one short)."""
    return math.ceil(n / chunk)


def assert_within(got: Tensor, want: Tensor, bound: float | Tensor, msg: str = "") -> None:
    """``|got - want| <= bound`` entry-wise (``bound`` a number or a tensor broadcast against them), in float64, with
    the worst entry in the message."""
    diff = (got.double() - want.double()).abs()
    excess = diff - torch.as_tensor(bound, dtype=torch.float64)
    if excess.numel() and excess.max() > 0:
        i = int(excess.argmax())
        bound_i = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff).reshape(-1)[i].item()
        raise AssertionError(
            f"{msg}: {int((excess > 0).sum())} / {diff.numel()} entries apart by more than the derived bound; worst "
            f"at flat index {i}: |{got.reshape(-1)[i].item()!r} - {want.reshape(-1)[i].item()!r}| = "
            f"{diff.reshape(-1)[i].item():.3e} > {bound_i:.3e}"
        )


def logit_terms(h: Tensor, weight: Tensor, bias: Tensor | None = None) -> float:
    """The largest ``sum_d |h_d w_vd| + |b_v|`` of the logits ``h @ weight.T + bias`` (``h`` ``[..., D]``): the
    scale of their dot products, for :func:`softmax_tol`."""
    h_TD = h.detach().reshape(-1, h.shape[-1]).float()
    terms = h_TD.abs() @ weight.detach().float().abs().T
    if bias is not None:
        terms = terms + bias.detach().float().abs()
    return terms.max().item() if terms.numel() else 0.0


def cross_entropy_tols(vocab: int, width: int, tokens: int, logit_terms: float, blocks: int) -> dict[str, float]:
    """The bounds between a fused (blocked, online-softmax) linear cross-entropy and the unfused one of the same
    float32 head (``vocab`` rows, ``width`` columns) over at most ``tokens`` positions, ``blocks`` vocabulary blocks:

    - ``"prob"``: each probability, relatively, and each token's loss ``lse - z_target``, absolutely
      (:func:`softmax_tol`);
    - ``"loss_rtol"``, ``"loss_atol"``: the mean loss, a sum of at most ``tokens`` positive per-token losses (+2
      roundings: the division by their count, and one more for a mean over micro-batches or an added auxiliary
      loss) relatively, plus ``"prob"`` absolutely;
    - ``"grad_rel"``: a gradient, relative to the sum of its terms' absolute values: ``dz = (softmax - onehot) /
      count`` (off by ``"prob"``) times the head's rows summed over ``vocab`` (hidden's gradient) or times the hidden
      states over ``tokens`` (the head's weight), +2 roundings for the scale.
    """
    prob = softmax_tol(vocab, logit_terms, width, blocks)
    return {
        "prob": prob,
        "loss_rtol": reordered_sum_tol(tokens + 2, 1.0),
        "loss_atol": prob,
        "grad_rel": reordered_sum_tol(max(vocab, tokens) + 2, 1.0) + prob,
    }


def sgd_drift(lr: float, grad_bound: float, param_max: float, grad_max: float) -> float:
    """How much further apart one plain SGD step ``p - lr * g`` moves the parameters of two runs whose gradients are
    within ``grad_bound``: ``lr * grad_bound``, plus each run's two roundings (``lr * g``, then the new ``p``), at most
    ``u * (|p| + 2 * lr * |g|)`` each, ``eps`` times that for the two runs (``param_max``, ``grad_max``: the largest
    entries)."""
    return lr * grad_bound + EPS32 * (param_max + 2 * lr * grad_max)


def cross_entropy_bounds(
    h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, *, reduction: str = "mean", blocks: int = 1,
    ignore_index: int = -100,
) -> dict:
    """What a fused (blocked, online-softmax) linear cross-entropy of ``h [T, D]``, ``w [V, D]``, ``b [V]`` and the
    oracle ``F.cross_entropy(F.linear(h, w, b))`` may differ by, in float32, from the reordered sums in them:
    ``"loss"``: ``(rtol, atol)``; ``"h"``, ``"w"``, ``"b"``: a bound per gradient entry. ``blocks``: how many
    vocabulary blocks the fused normaliser is summed over (a vocabulary-parallel head: over all ranks, plus one per
    rank for the combination over ranks, which rescales each rank's sum once more).

    - Each probability: :func:`softmax_tol` relative (logits of ``D`` terms, a normaliser of ``V`` exps over
      ``blocks``); each token's loss ``lse - z_target`` the same, absolutely.
    - The loss: the sum of ``T`` positive per-token losses (+1: the division by the count), relative; plus the
      per-token bound (times the count for ``"sum"``), absolute.
    - ``dz = scale_t * (softmax - onehot)``, each entry at most ``scale_t * (softmax + onehot)`` in size and off by
      the probability's bound; the gradient of hidden sums ``V`` products ``dz * w``, those of the weight and bias
      ``T`` products ``dz * h`` / ``dz`` (+2 each: the scale's division and product): :func:`reordered_sum_tol` of
      those plus the probability's bound, times the sum of the terms' absolute values (computed here from the
      oracle's probabilities).
    """
    num_tokens, width = h.shape
    vocab = w.shape[0]
    hf, wf, bf = h.detach().float(), w.detach().float(), None if b is None else b.detach().float()
    prob = softmax_tol(vocab, logit_terms(hf, wf, bf), width, blocks)
    valid = target != ignore_index
    count = int(valid.sum())
    scale_t = valid.float() / (count if reduction == "mean" else 1)
    onehot = F.one_hot(torch.where(valid, target, 0).long(), vocab).float()
    terms = (F.linear(hf, wf, bf).softmax(dim=1) + onehot) * scale_t[:, None]  # |dz| <= this, entry-wise
    rel_h = reordered_sum_tol(vocab + 2, 1.0) + prob
    rel_wb = reordered_sum_tol(num_tokens + 2, 1.0) + prob
    return {
        "loss": (reordered_sum_tol(num_tokens + 1, 1.0), prob * (count if reduction == "sum" else 1)),
        "h": rel_h * (terms @ wf.abs()),
        "w": rel_wb * (terms.T @ hf.abs()),
        "b": rel_wb * terms.sum(dim=0),
    }


def decoder_chain(
    *, layers: int, hidden: int, heads: int, head_dim: int, ffn: int, experts: int, top_k: int, vocab: int, seq: int,
    tokens: int,
) -> int:
    """The summed length of the chain of sums from a decoder LM's inputs to its mean loss over ``tokens`` labelled
    tokens: what two evaluations (one process, and expert-parallel / micro-batched / pipelined) may order differently,
    as :func:`reordered_sum_tol`'s ``n`` (sums in series add). Per layer: two norms (``hidden`` each), q / k / v
    (``hidden``) and their norms (``head_dim``), the scores (``head_dim``), softmax and values (``seq`` each), the
    output projection (``heads * head_dim``), the router (``hidden``) and its softmax (``experts``), an expert's two
    GEMMs (``hidden``, ``ffn``), the top-k combine and the two residuals; then the final norm and the head
    (``hidden`` each), the log-sum-exp (``vocab``) and the mean (``tokens``, +2: the division and a sum over
    micro-batches). The backward runs the same chain in reverse and sums the weight gradients over the tokens:
    ``2 * chain + tokens`` bounds a gradient, relative to the sum of its terms' sizes."""
    per_layer = 2 * hidden + hidden + 2 * head_dim + head_dim + 2 * seq + heads * head_dim
    per_layer += hidden + experts + hidden + ffn + top_k + 2
    return layers * per_layer + 2 * hidden + vocab + tokens + 2


def trained_param_tol(chain: int, tokens: int, *, init: Tensor, want: Tensor) -> float:
    """How far a parameter trained by plain SGD in two such evaluations may end apart: its gradients are within
    ``reordered_sum_tol(2 * chain + tokens)`` relatively, so the change ``want - init`` (``lr`` times the gradients
    summed over the steps) is within that of its own size (its size standing for the sum of its terms' sizes: SGD's
    few steps of one sign-consistent descent do not cancel), plus one rounding of the parameter per step and run
    (:func:`sgd_drift`'s last term, ``eps * |p|``, a few steps bounded by 4)."""
    change = (want.double() - init.double()).abs().max().item()
    return reordered_sum_tol(2 * chain + tokens, change) + 4 * EPS32 * want.abs().max().item()


def low_precision_cross_entropy_bounds(
    h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, *, reduction: str = "mean", chunk: int,
    token_chunk: int | None = None, ignore_index: int = -100,
) -> dict:
    """What a fused linear cross-entropy whose GEMMs run in the inputs' low dtype (bf16 / fp16 ``h [T, D]``,
    ``w [V, D]``, ``b [V]``: products accumulated in float32 inside the kernel, each result rounded once to the low
    dtype) and whose softmax math is float32 may differ by from the exact loss of the same low-precision values (a
    float64 reference): ``"loss"``: an absolute bound; ``"h"``, ``"w"``, ``"b"``: a bound per gradient entry (the
    gradients coming back in the inputs' dtype). ``chunk`` / ``token_chunk``: the fused loss's vocabulary / token
    block sizes. ``u``: the low dtype's unit roundoff (2**-8 for bf16), ``gamma``: float32's (:func:`gamma`).

    - Each logit: a float32 dot product of ``D`` exact products (``gamma_D``), rounded to the low dtype (``u``),
      plus the bias in float32 (one more rounding): ``delta_tv = (u + 2 gamma_(D+2)) * (S_tv + |b_v|)``, ``S_tv =
      sum_d |h_td w_vd|`` (the logit's magnitude, bounding the computed one's).
    - The log-sum-exp is 1-Lipschitz, and more precisely ``|lse(z + e) - lse(z)| <= log sum_v p_v exp(delta_v)``
      when ``|e_v| <= delta_v`` (Jensen, both sides): ``Lambda_t``; each log-probability ``z - lse`` is then off by
      ``eps_tv = delta_tv + Lambda_t + s``, ``s`` the float32 softmax arithmetic on the given logits
      (:func:`softmax_tol` with ``width=0``, plus float64's own), and each probability by ``p * expm1(eps)``; each
      token's loss by ``Lambda_t + delta_t,target + s``.
    - The loss: the per-token bounds' mean (sum), plus the float32 sum of ``T`` positive terms and the division.
    - A gradient block ``G = scale * (p - onehot)`` is off by ``scale * p * expm1(eps)`` plus its float32 roundings
      (the scale's division and product, the subtraction) and its cast to the low dtype: ``c1 = u + 2 gamma_4``
      relative to ``|G| <= Ghat = scale * (p exp(eps) + onehot) * (1 + c1)``. The two GEMMs on it: float32
      accumulation over a block's ``chunk`` rows (``token_chunk`` tokens), each block's result rounded to the low
      dtype, the blocks' results summed in float32, the total rounded to the input's dtype once:
      ``(2 u + gamma_(n + blocks)) (1 + u)**2`` relative to the sum of ``Ghat`` times the other operand's absolute
      values (``n = V`` for hidden's gradient, ``T`` for the weight's and the bias's), plus float64's own
      ``gamma``. Where the low dtype's exponent range is float32's narrower (fp16), a rounding into its subnormals
      is off by up to ``tiny * u`` absolutely instead (``tiny``: its smallest normal): once per gradient-block entry
      (times the other operand's absolute values) and once per block result and the total.
    """
    low = torch.promote_types(h.dtype, w.dtype)
    u = unit_roundoff(low)
    num_tokens, width = h.shape
    vocab = w.shape[0]
    token_chunk = token_chunk or chunk
    h64, w64 = h.detach().double(), w.detach().double()
    b64 = None if b is None else b.detach().double()
    magnitude = h64.abs() @ w64.abs().T + (0.0 if b64 is None else b64.abs())  # S_tv + |b_v|
    delta = (u + 2 * gamma(width + 2)) * magnitude
    z = F.linear(h64, w64, b64)
    logp = z.log_softmax(dim=1)
    p = logp.exp()
    lam = torch.logsumexp(logp + delta, dim=1)  # Lambda_t
    blocks_v, blocks_t = blocks_of(vocab, chunk), blocks_of(num_tokens, token_chunk)
    f64 = gamma(width + vocab + num_tokens + 4, torch.float64)
    s = softmax_tol(vocab, (magnitude + delta).max().item(), 0, blocks_v) + f64 * (1 + magnitude.max().item())
    valid = target != ignore_index
    count = int(valid.sum())
    safe = torch.where(valid, target, 0).long()
    onehot = F.one_hot(safe, vocab).double()
    per_token = torch.where(valid, lam + delta.gather(1, safe[:, None]).squeeze(1) + s, 0.0)
    divisor = count if reduction == "mean" else 1
    loss = z.logsumexp(dim=1).sub(z.gather(1, safe[:, None]).squeeze(1)).mul(valid).sum().item() / divisor
    loss_bound = per_token.sum().item() / divisor
    loss_bound += gamma(num_tokens + 2) * (abs(loss) + loss_bound)
    scale = valid.double()[:, None] / divisor
    eps = delta + lam[:, None] + s
    c1 = u + 2 * gamma(4)
    ghat = scale * (p * eps.exp() + onehot) * (1 + c1)
    sub = torch.finfo(low).smallest_normal * u  # a rounding into the low dtype's subnormals, absolutely
    off = scale * (p * eps.expm1() + c1 * (p * eps.exp() + onehot)) + sub * valid.double()[:, None]  # |G_cast - G|
    c_h = (2 * u + gamma(vocab + blocks_v)) * (1 + u) ** 2 + f64
    c_w = (2 * u + gamma(num_tokens + blocks_t)) * (1 + u) ** 2 + f64
    return {
        "loss": loss_bound,
        "h": (off + c_h * ghat) @ w64.abs() + sub * (blocks_v + 1),
        "w": (off + c_w * ghat).T @ h64.abs() + sub * (blocks_t + 1),
        "b": (off + c_w * ghat).sum(dim=0) + sub * (blocks_t + 1),
    }


# The FP8 tensor cores of Hopper (H800 / H100 / H200) keep about 14 bits of their accumulator (DeepSeek-V3 technical
# report, §3.3.2, "Increasing Accumulation Precision"): the accumulation's unit roundoff taken for a CUDA FP8 GEMM.
# ``torch._scaled_mm``'s default (``use_fast_accum=False``) promotes the partial sums to float32 every few MMAs, so
# the kernel does at least this well; CPU kernels accumulate in float32 (``unit_roundoff(torch.float32)``).
CUDA_FP8_ACCUMULATION_U = 2.0**-14


def scaled_gemm_tol(k: int, terms: Tensor, ref: Tensor, out_dtype: torch.dtype, accumulation_u: float) -> Tensor:
    """How far a scaled FP8 GEMM's output (``torch._scaled_mm``, or a float32 GEMM on dequantised operands) may be
    from the float64 product ``ref`` of its own dequantised operands, per entry: ``terms`` is that product's
    ``|a| @ |b|.T`` (the sum of its terms' sizes), ``k`` the contraction length.

    - The products of two FP8 values are exact in float32; their sum of ``k`` terms, in any order, with the
      accumulator's unit roundoff ``accumulation_u``: ``gamma_k * terms`` (Higham §3.1), ``gamma_k`` of that ``u``.
    - The scales' products in the epilogue (``acc * scale_a * scale_b``, float32): two roundings,
      ``gamma_2 * (|ref| + that)``.
    - The result rounded to ``out_dtype`` once: its ``u`` times the value so far, or into its subnormals (fp16):
      ``tiny * u`` absolutely. float64's own error of ``ref`` (``gamma_k`` of float64) is added.
    """
    nu = k * accumulation_u
    if not 0 <= nu < 1:
        raise ValueError(f"scaled_gemm_tol: k * u = {nu}. Rule: 0 <= k * u < 1 for the bound to hold.")
    accumulated = nu / (1 - nu) * terms + gamma(k, torch.float64) * terms
    scaled = accumulated + gamma(2) * (ref.abs() + accumulated)
    u_out = unit_roundoff(out_dtype)
    return scaled + u_out * (ref.abs() + scaled) + torch.finfo(out_dtype).smallest_normal * u_out
