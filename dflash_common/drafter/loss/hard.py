"""Weighted cross-entropy through the target's frozen lm_head, never materialising [N, V] logits.

    fused_lm_head_loss(hidden [N, H], lm_head_weight [V, H], labels int64 [N], weights [N])
        -> LossOutput(loss = sum_i w_i * CE(hidden_i @ W^T, label_i)
                             (float32 scalar, grad wrt hidden),
                      correct = argmax == label  [N] bool,
                      rows = w_i * CE_i  [N] float32, with grad wrt hidden)

Weights computed from the same forward's cross-entropy (D-PACE) need no second pass: run with unit
weights on the valid rows, form w from `rows.detach()`, and backpropagate (w * rows).sum(). Row i
of the loss depends on row i of hidden only, so the backward scales row i of the stored gradient by
the gradient arriving at rows[i]: exactly sum_i w_i dCE_i/dhidden, at the cost of one [N, H]
row-scaling (the same as the scalar scaling it replaces).

Design (FLOPs first). The lm_head is frozen, so the only gradient is d loss / d hidden. Two designs:

- Fully fused (flash-style): a Triton matmul with online softmax keeps only the log-sum-exp in the
  forward (2NVH), then recomputes the logits in the backward (2NVH) to form d_logits @ W (2NVH):
  6NVH, and a hand-written matmul that must match cuBLAS to break even.
- Gradient during the forward (chosen): rows in chunks of C; per chunk
  logits = h_chunk @ W^T (cuBLAS, 2CVH) -> a Triton kernel reads each row twice (online
  max/sum-exp/argmax/label logit, then w * (softmax - onehot) written over the logits in place)
  -> grad_h_chunk = d_logits @ W (cuBLAS, 2CVH). The backward only scales the stored [N, H]
  gradient by grad_output (in place). 4NVH in all, the minimum with an exact softmax, and the same
  work as Liger-Kernel's fused linear cross-entropy; without a gradient (validation) it is 2NVH.

The label-odds methods (`method='odds'` and `'odds_epilogue'`) take the softmax against each row's
label instead of its maximum, which needs no pass over the row before the gradient can be written.
With t = sum over v != y of exp(x_v - x_y) (the odds of each other token against the label y):
CE = log(1 + t), and d CE / d hidden = (sum_{v != y} odds_v W_v - t W_y) / (1 + t). So per chunk a
kernel reads the logits once and writes the odds over them (0 at the label) while it sums t; cuBLAS
forms G = odds @ W; the backward makes w / (1 + t) * G - w t / (1 + t) * W_y of each row (one [N, H]
pass, where the exact method scales its stored gradient). One read and one write of the chunk
instead of two reads and a write; 'odds_epilogue' forms the odds inside a Triton logits matmul and
stores no logits at all (epilogue_triton.py). Precision: the odds are rounded to the weight's
dtype as the exact method rounds its gradient, and the label's term is exact in float32 (the exact
method rounds softmax - 1 there). Odds overflow float32 once CE nears 88 nats: rows whose t reaches
e**80 (CE >= 80) are recomputed by the exact method (one host sync a call, to see whether any).

Rows whose weight is zero or whose label is IGNORE_INDEX are dropped before any matmul (position 0
of every block is such a row: 1/B of the work). Their `correct` is False.

Memory: the stored gradient ([N, H], hidden's dtype) plus one logits chunk. The chunk height follows
a byte budget, by default about the size of `hidden` itself (Liger's choice, so the peak matches
it), in multiples of 512 rows, the heights at which cuBLAS runs fastest on an H200.

Top-k (DFlash2's candidates): with `top_k` = K each kept row's K largest logits and their ids come
back too (`top_values` float32, `top_ids`), taken from the chunk's logits before the kernel writes
over them: one extra read of each chunk and no second logits matmul. 'odds_epilogue' stores no
logits; with `top_k` it runs as 'odds'.

Backends: 'triton' (CUDA, or the CPU under TRITON_INTERPRET=1), 'torch' (the same chunks with
PyTorch ops: CPU and reference), 'auto' (triton on CUDA when importable, else torch). Methods:
'exact' (the two passes above; the default), 'odds' (both backends), 'odds_epilogue' (triton; under
'auto' without Triton it runs as 'odds').
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch

from dflash_common.drafter.objective import IGNORE_INDEX

Backend = Literal["auto", "triton", "torch"]
Method = Literal["exact", "odds", "odds_epilogue"]
METHODS = ("exact", "odds", "odds_epilogue")
# Rows per chunk are a multiple of this. Measured on an H200 (benchmarks/loss.py --sweep): heights
# of 512, 1024, 1536, 2048 rows run at full speed, while 640 or 1280 rows run up to 9% slower.
_ROW_QUANTUM = 512
# Odds methods: a row whose odds sum t reaches e**80 is recomputed exactly. float32 (and bf16) end
# at e**88.7; the margin keeps G = odds @ W finite for lm_head entries up to e**8.7 in magnitude.
ODDS_LOG_LIMIT = 80.0


class LossOutput(NamedTuple):
    loss: torch.Tensor  # float32 scalar: weighted sum of per-row cross-entropy
    correct: torch.Tensor  # [N] bool: argmax of the logits == label (False for skipped rows)
    rows: torch.Tensor | None = (
        None  # [N] float32: weighted loss of each row (grad wrt hidden), 0 for skipped rows
    )
    ce: torch.Tensor | None = (
        None  # [N] float32: unweighted CE to the label, no grad (soft loss; the hard
    )
    # loss's `rows` are that under unit weights)
    top_values: torch.Tensor | None = None  # [N, K] float32: a kept row's K largest logits (top_k)
    top_ids: torch.Tensor | None = None  # [N, K] long: their ids, descending logit (0 if dropped)


def fused_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    backend: Backend = "auto",
    chunk_bytes: int | None = None,
    method: Method = "exact",
    top_k: int = 0,
) -> LossOutput:
    """Weighted CE of hidden [N, H] through the frozen lm_head [V, H]; see the module docstring."""
    if hidden.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and lm_head {tuple(lm_head_weight.shape)} do not match"
        )
    if labels.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError("labels and weights need one entry per row of hidden")
    if method not in METHODS:
        raise ValueError(f"loss method {method!r} unknown; use one of {', '.join(METHODS)}")
    if method == "odds_epilogue" and top_k:
        method = "odds"  # the epilogue stores no logits to take the top-k of
    if method == "odds_epilogue" and resolve_backend(backend, hidden.device) != "triton":
        if backend != "auto":
            raise ValueError(
                "loss method 'odds_epilogue' runs in a Triton matmul; use backend 'triton' (or "
                "method 'odds')"
            )
        method = (
            "odds"  # 'auto' without Triton (a CPU): the same odds, from the torch backend's logits
        )
    backend = resolve_backend(backend, hidden.device)
    spec = _Spec(backend, chunk_bytes, method, top_k)
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    if not need_grad:
        rows, correct, _, tops = _loss_rows(
            hidden, lm_head_weight.detach(), labels, weights, spec, False
        )
    else:
        rows, correct, *tops = _FusedLMHeadLoss.apply(
            hidden, lm_head_weight.detach(), labels, weights, spec
        )
    return LossOutput(rows.sum(), correct, rows, None, *(tops if top_k else (None, None)))


def resolve_backend(backend: Backend, device: torch.device) -> Literal["triton", "torch"]:
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"loss backend {backend!r} unknown; use 'auto', 'triton' or 'torch'")
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _Spec(NamedTuple):
    """How the chunks are computed (one object through autograd)."""

    backend: Literal["triton", "torch"]
    chunk_bytes: int | None
    method: Method
    top_k: int = 0


class _StoredGrad(NamedTuple):
    """What the forward keeps for the backward. Exact method: values [N, H] is d rows[i] / d
    hidden[i] row by row. Odds methods: values[i] = sum_{v != y_i} odds_v W_v, and d rows[i] / d
    hidden[i] = scale[i] * values[i] + label_coef[i] * W[labels[i]] (zero for dropped rows: scale =
    coef = 0)."""

    values: torch.Tensor
    scale: torch.Tensor | None = None
    label_coef: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    weight: torch.Tensor | None = None


class _FusedLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, spec):
        rows, correct, grad, tops = _loss_rows(hidden, weight, labels, weights, spec, True)
        top_values, top_ids = tops
        ctx.stored, ctx.backend = (
            grad,
            spec.backend,
        )  # row i of the gradient depends on row i of hidden only
        ctx.mark_non_differentiable(correct, top_values, top_ids)
        return rows, correct, top_values, top_ids

    @staticmethod
    def backward(ctx, grad_rows, grad_correct, grad_top_values, grad_top_ids):
        stored, ctx.stored = ctx.stored, None
        if stored is None:
            raise RuntimeError("fused_lm_head_loss supports one backward pass per forward")
        if stored.scale is None:
            return (
                stored.values.mul_(grad_rows[:, None]),
                None,
                None,
                None,
                None,
            )  # in float32, rounded once
        return _odds_grad(stored, grad_rows, ctx.backend), None, None, None, None


def chunk_rows(
    n_rows: int,
    hidden_size: int,
    vocab: int,
    logits_bytes_per_value: int,
    hidden_bytes_per_value: int,
    chunk_bytes: int | None = None,
) -> int:
    """Rows per logits chunk: an explicit byte budget is obeyed (whole quanta once it allows one);
    the default aims at the size of the [N, H] hidden input, rounded to the nearest quantum, as
    Liger-Kernel sizes its chunks, so the peak memory matches Liger's."""
    if chunk_bytes is not None:
        rows = chunk_bytes // (vocab * logits_bytes_per_value)
        return max(1, rows // _ROW_QUANTUM * _ROW_QUANTUM if rows >= _ROW_QUANTUM else rows)
    rows = n_rows * hidden_size * hidden_bytes_per_value / (vocab * logits_bytes_per_value)
    return max(1, round(rows / _ROW_QUANTUM)) * _ROW_QUANTUM


def _loss_rows(hidden, weight, labels, weights, spec: _Spec, need_grad: bool):
    """(rows_loss [N], correct [N], _StoredGrad or None, (top_values, top_ids)) by the spec's
    method."""
    tops = _new_tops(hidden.shape[0], spec.top_k, hidden.device)
    if spec.method == "exact":
        rows, correct, grad = _chunked_loss(
            hidden, weight, labels, weights, spec.backend, spec.chunk_bytes, need_grad, tops
        )
        return rows, correct, _StoredGrad(grad) if need_grad else None, tops
    return (*_chunked_odds_loss(hidden, weight, labels, weights, spec, need_grad, tops), tops)


def _new_tops(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k results as a dropped row keeps them: values -inf, ids 0 ([n, k] each; k may be
    0)."""
    return (
        torch.full((n, k), float("-inf"), dtype=torch.float32, device=device),
        torch.zeros(n, k, dtype=torch.long, device=device),
    )


def _take_top_k(logits: torch.Tensor, out: tuple[torch.Tensor, ...], index) -> None:
    """The chunk's top-k (out = (values [c, K], ids [c, K]), or empty: none asked) before its logits
    are overwritten."""
    if out and out[0].shape[1]:
        values, ids = torch.topk(logits, out[0].shape[1], dim=-1)
        _write_rows(out, (values.float(), ids), index)


def _chunked_loss(hidden, weight, labels, weights, backend, chunk_bytes, need_grad, tops=()):
    """The exact method: (loss [N], correct [N], the stored gradient [N, H] or None); each kept
    row's top-k into `tops` when given."""
    n = hidden.shape[0]
    out = (
        torch.zeros(n, dtype=torch.float32, device=hidden.device),
        torch.zeros(n, dtype=torch.bool, device=hidden.device),
        *tops,
    )

    def chunk(h, y, w, chunk_out, index):
        logits = h @ weight.T  # [c, V]; becomes d loss / d logits in place
        _take_top_k(logits, chunk_out[2:], index)
        if index is None:  # results straight into their rows: no scatter kernels a chunk
            _weighted_ce(backend, logits, y, w, need_grad, out=chunk_out[:2])
        else:
            _write_rows(chunk_out[:2], _weighted_ce(backend, logits, y, w, need_grad), index)
        return logits

    grad = _chunk_loop(hidden, weight, labels, weights, backend, chunk_bytes, need_grad, out, chunk)
    return out[0], out[1], grad


def _chunk_loop(hidden, weight, labels, weights, backend, chunk_bytes, need_grad, out, chunk):
    """The chunks of every method: the kept rows (weight != 0, a label) in chunks of the byte
    budget. chunk(h [c, H], labels [c], weights [c], chunk_out, index) writes its rows' results into
    chunk_out (views of those rows of `out` when no row is dropped, index None; else `out` itself,
    at rows `index`) and returns what the gradient matmul takes, [c, V]. -> the stored gradient
    [N, H] (rows of dropped rows zero), G = that @ W row by row, or None without a gradient."""
    n, v = hidden.shape[0], weight.shape[0]
    kept = ((weights != 0) & (labels != IGNORE_INDEX)).nonzero().squeeze(1)  # one host sync
    m = kept.numel()
    dense = m == n  # no row dropped: slices instead of gathers
    # every row of grad is written when none is dropped; else dropped rows keep a zero gradient
    grad = (torch.empty_like(hidden) if dense else torch.zeros_like(hidden)) if need_grad else None
    # the torch path also holds a float32 copy of the chunk
    per_value = weight.element_size() + (4 if backend == "torch" else 0)
    step = chunk_rows(n, hidden.shape[1], v, per_value, hidden.element_size(), chunk_bytes)
    for r0 in range(0, m, step):
        rows = slice(r0, min(r0 + step, m)) if dense else kept[r0 : r0 + step]
        chunk_out = tuple(o[rows] for o in out) if dense else out
        d = chunk(
            hidden[rows].to(weight.dtype),
            labels[rows],
            weights[rows].float(),
            chunk_out,
            None if dense else rows,
        )  # [c, V] (or None without a gradient)
        if need_grad and dense and grad.dtype == d.dtype:
            torch.mm(d, weight, out=grad[rows])  # [c, V] @ [V, H] -> [c, H], no temporary
        elif need_grad:
            grad[rows] = (d @ weight).to(grad.dtype)
        del d  # else the next chunk's matmul allocates while this one is alive: two chunks at peak
    return grad


def _write_rows(out: tuple[torch.Tensor, ...], results: tuple[torch.Tensor, ...], index) -> None:
    """Each result into its output: whole (index None: out holds the chunk's rows) or at rows
    `index`."""
    for o, r in zip(out, results):
        if index is None:
            o.copy_(r)
        else:
            o[index] = r


def _weighted_ce(backend, logits, labels, weights, compute_grad, out=None):
    """(loss per row, correct per row); with out=(loss [C], correct [C]) they are written there."""
    if backend == "triton":
        from dflash_common.drafter.loss.hard_triton import weighted_ce_rows

        loss_out, correct_out = out if out is not None else (None, None)
        return weighted_ce_rows(
            logits, labels, weights, compute_grad, loss_out=loss_out, correct_out=correct_out
        )
    loss, correct = weighted_ce_rows_torch(logits, labels, weights, compute_grad)
    if out is not None:
        _write_rows(out, (loss, correct), None)
    return loss, correct


def weighted_ce_rows_torch(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, compute_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel's contract in PyTorch: per-row weighted CE and correctness; with
    compute_grad, logits [C, V] is overwritten by w * (softmax - onehot)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)  # [C]
    x_label = x.gather(1, labels[:, None]).squeeze(1)
    loss = (lse - x_label) * weights
    correct = x.argmax(-1) == labels
    if compute_grad:
        probs = x.sub_(lse[:, None]).exp_()  # x is logits itself when they are float32
        probs[torch.arange(probs.shape[0], device=probs.device), labels] -= 1.0
        probs.mul_(weights[:, None])
        if probs is not logits:
            logits.copy_(probs)
    return loss, correct


def _chunked_odds_loss(hidden, weight, labels, weights, spec: _Spec, need_grad: bool, tops=()):
    """The label-odds methods (module docstring): per chunk the odds [c, V] (in place of the logits
    with 'odds'), then G = odds @ W into the stored gradient's rows; rows whose odds overflow,
    exactly."""
    out = (*new_odds_results(hidden.shape[0], hidden.device), *tops)
    chunk = functools.partial(_odds_rows, spec, weight, need_grad)
    grad = _chunk_loop(
        hidden, weight, labels, weights, spec.backend, spec.chunk_bytes, need_grad, out, chunk
    )
    rows_loss, correct, scale, label_coef, ok = out[:5]
    if not bool(ok.all()):  # one host sync: rows whose odds overflow (CE >= 80 nats), done exactly
        bad = (~ok).nonzero().squeeze(1)
        b_loss, b_correct, b_grad = _chunked_loss(
            hidden[bad],
            weight,
            labels[bad],
            weights[bad],
            spec.backend,
            spec.chunk_bytes,
            need_grad,
        )
        rows_loss[bad], correct[bad] = b_loss, b_correct
        if need_grad:  # their stored gradient is the exact one: scale 1, no label term
            grad[bad], scale[bad], label_coef[bad] = b_grad, 1.0, 0.0
    if not need_grad:
        return rows_loss, correct, None
    return rows_loss, correct, _StoredGrad(grad, scale, label_coef, labels, weight)


def new_odds_results(n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The odds methods' per-row results, as a dropped row keeps them: loss 0, correct False, scale
    0, label coefficient 0 (float32, bool, float32, float32 [n]) and ok True (bool [n])."""
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.zeros(n, **f32),
        torch.zeros(n, dtype=torch.bool, device=device),
        torch.zeros(n, **f32),
        torch.zeros(n, **f32),
        torch.ones(n, dtype=torch.bool, device=device),
    )


def _odds_rows(spec: _Spec, weight, compute_grad, h, labels, weights, out, index):
    """One chunk of the odds methods (a `chunk` of _chunk_loop): results into `out` (at rows
    `index`, or the views given); returns the odds [c, V] when compute_grad."""
    out, tops = out[:5], out[5:]
    if spec.method == "odds_epilogue":
        from dflash_common.drafter.loss.epilogue_triton import odds_matmul

        return odds_matmul(h, weight, labels, weights, compute_grad, out, ODDS_LOG_LIMIT, index)
    logits = h @ weight.T  # [c, V]; becomes the odds in place
    _take_top_k(logits, tops, index)
    if spec.backend == "triton":
        from dflash_common.drafter.loss.hard_triton import label_odds_rows

        label_odds_rows(logits, labels, weights, compute_grad, out, ODDS_LOG_LIMIT, index)
    else:
        _write_rows(out, label_odds_rows_torch(logits, labels, weights, compute_grad), index)
    return logits if compute_grad else None


def label_odds_rows_torch(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, compute_grad: bool
) -> tuple[torch.Tensor, ...]:
    """The odds kernels' contract in PyTorch: per row (w * CE, correct, scale, label_coef, ok) of
    hard_triton.odds_outputs; with compute_grad, logits [C, V] is overwritten by the odds
    exp(x - x_label), 0 at the label."""
    x = logits.float()
    rows = torch.arange(x.shape[0], device=x.device)
    x_label = x[rows, labels]
    odds = (x - x_label[:, None]).exp_()
    odds[rows, labels] = 0.0
    t = odds.sum(-1)
    u = 1.0 + t
    ce = torch.log1p(t)
    cols = torch.arange(x.shape[1], device=x.device)
    beat = (x > x_label[:, None]) | (
        (x == x_label[:, None]) & (cols < labels[:, None])
    )  # argmax != label
    if compute_grad:
        logits.copy_(odds)
    return (
        ce * weights,
        ~beat.any(-1),
        weights / u,
        -weights * (t / u),
        torch.log(t) < ODDS_LOG_LIMIT,
    )


def _odds_grad(stored: _StoredGrad, grad_rows: torch.Tensor, backend: str) -> torch.Tensor:
    """Row i: grad_rows[i] * (scale[i] * values[i] + label_coef[i] * W[labels[i]]), in place."""
    if backend == "triton":
        from dflash_common.drafter.loss.hard_triton import odds_grad

        return odds_grad(
            stored.values, stored.weight, stored.labels, stored.scale, stored.label_coef, grad_rows
        )
    g = grad_rows.float()
    rows = stored.labels.clamp(min=0)  # dropped rows (IGNORE_INDEX) have label_coef 0
    value = (
        stored.values.float() * (stored.scale * g)[:, None]
        + stored.weight[rows].float() * (stored.label_coef * g)[:, None]
    )
    return stored.values.copy_(value)
