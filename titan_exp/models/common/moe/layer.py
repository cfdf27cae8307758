"""A mixture-of-experts feed-forward: a router picks each token's top-k experts, the tokens are
grouped by expert (a stable sort, so the grouping is the same in every layout), each expert's
SwiGLU runs over its group, and the outputs come back weighted by the router's scores, plus the
shared experts' output. Expert weights are stacked (experts × ...) so FSDP shards them by expert."""

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan_exp.models.common.moe.config import CLAMPED_GATE_GAIN, MoEConfig
from titan_exp.models.common.moe.dispatch import run_on_expert_ranks
from titan_exp.models.common.moe.grouped_mm import grouped_mm_applies, grouped_swiglu
from titan_exp.models.common.moe.tensor_parallel import ExpertTensorParallel
from titan_exp.models.common.swiglu import SwiGLU
from titan_exp.parallel.tensor_parallel import TensorParallel, replicated_on_local_tensors

# Whether a forward's routed rows count toward the experts' load (moe/balance.py).
_COUNTING = contextvars.ContextVar("moe_counting", default=True)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Forwards inside route as always but leave the load uncounted (a pipeline stage's shape
    inference: a forward of its own, not a microbatch of the step)."""
    token = _COUNTING.set(False)
    try:
        yield
    finally:
        _COUNTING.reset(token)


class Router(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.num_experts, bias=cfg.bias)
        # Added to the scores to pick the experts, not to weigh them (moe/balance.py moves it).
        # Saved with the model: it is state, though no gradient reaches it.
        if cfg.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        else:
            self.expert_bias = None

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, experts), each (tokens, top_k): whom each token goes to, and with what weight;
        and every expert's score, (tokens, experts), for the auxiliary loss."""
        cfg = self.cfg
        logits = self.gate(tokens).float()  # scores in float32 whatever the compute dtype
        scores = logits.softmax(dim=-1) if cfg.score_func == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.expert_bias is not None else scores
        eligible = self._best_groups(choice) if cfg.n_groups > 1 else choice
        experts = eligible.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if cfg.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * cfg.route_scale).type_as(tokens), experts, scores

    def _best_groups(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` with the experts outside each token's topk_groups best groups set to -inf; a
        group is as good as the sum of its two best scores (DeepSeek-V3's rule)."""
        cfg = self.cfg
        grouped = scores.view(scores.shape[0], cfg.n_groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(cfg.topk_groups, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)


class GroupedExperts(nn.Module):
    """Every expert's SwiGLU, stacked: w1 and w3 (experts, hidden, dim), w2 (experts, dim, hidden),
    and where the experts have biases (model.moe.bias) w1_bias and w3_bias (experts, hidden),
    w2_bias (experts, dim).

    Under expert parallelism (parallel/expert_parallel.py) the weights are DTensors sharded by expert over the
    EP ranks, `ep_group` is set, and each rank runs its own experts over the rows sent to them."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        experts, hidden = cfg.num_experts, cfg.hidden_dim
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        for name, width in (("w1_bias", hidden), ("w2_bias", dim), ("w3_bias", hidden)):
            self.register_parameter(name, nn.Parameter(torch.empty(experts, width)) if cfg.bias else None)
        self.activation = functools.partial(expert_activation, limit=cfg.swiglu_limit)
        self.ep_group: dist.ProcessGroup | None = None
        # The tp ranks each expert's hidden dim is split over (moe/tensor_parallel.py): each adds
        # its share of w2's bias to the partial sums they reduce.
        self.hidden_split = 1

    def forward(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`grouped`: the tokens sorted by expert, counts[e] of them for expert e."""
        if self.ep_group is None:
            return self._run(grouped, counts)
        return run_on_expert_ranks(grouped, counts, self.ep_group, self._run)

    def _run(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts over their rows (`counts[e]` for its e-th expert)."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        biases = None
        if self.w1_bias is not None:
            w2_bias = _local(self.w2_bias)
            if self.hidden_split > 1:
                w2_bias = _ShareInForward.apply(w2_bias, self.hidden_split)
            biases = (_local(self.w1_bias), w2_bias, _local(self.w3_bias))
        if grouped_mm_applies(grouped, w1):
            return grouped_swiglu(grouped, counts, w1, w2, w3, self.activation, biases)
        # Elsewhere one matmul per expert: the same numbers, one kernel launch per expert.
        outputs = []
        for expert, rows in enumerate(torch.split(grouped, counts)):
            gate, up = rows @ w1[expert].T, rows @ w3[expert].T
            if biases is not None:
                gate, up = gate + biases[0][expert], up + biases[2][expert]
            out = self.activation(gate, up) @ w2[expert].T
            outputs.append(out + biases[1][expert] if biases is not None else out)
        return torch.cat(outputs)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def expert_activation(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """An expert's hidden activation: SwiGLU's silu(gate)·up, or with `limit` GPT-OSS's clamped
    form (gate clamped above at limit, up to ±limit, then (up + 1)·gate·σ(1.702·gate))."""
    if limit is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(CLAMPED_GATE_GAIN * gate) * (up + 1)


class _ShareInForward(torch.autograd.Function):
    """`bias / parts` forward, the gradient unchanged backward: where the tp ranks each add their
    share of w2's bias to partial sums they then add up, the sum holds the bias once, and each
    rank's gradient of its share is already the whole gradient (every rank ran the same rows), as
    a replicated weight's must be."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, parts: int) -> torch.Tensor:
        return bias / parts

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _AddAuxiliaryLoss(torch.autograd.Function):
    """The layer's output unchanged; in backward the auxiliary loss gets the gradient `scale`, as
    if it had been added to the loss the output's gradient comes from (which a pipeline stage
    without the loss could not do)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.tensor(ctx.scale, device=grad.device), None


class _AddPooledAuxiliaryLoss(torch.autograd.Function):
    """The layer's output unchanged; in backward, the gradient that the loss pooled over every MoE
    layer (model.moe.aux_loss_over=all_layers) sends to this `layer`'s mean router probabilities:
    coefficient × experts × the routed fractions averaged over the layers / the layers, known once
    every layer's forward has run. Its share of the loss goes into the layer's aux_loss_total."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, mean_probs: torch.Tensor, layer: "MoE") -> torch.Tensor:
        ctx.save_for_backward(mean_probs.detach())
        ctx.layer = layer
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mean_probs,) = ctx.saved_tensors
        layer = ctx.layer
        pool, cfg = layer.aux_pool, layer.cfg
        # d pooled loss / d this layer's mean probabilities
        share = cfg.aux_loss_coeff * cfg.num_experts * pool.mean() / len(pool.fractions)
        with torch.no_grad():
            layer.aux_loss_total += torch.stack([(share * mean_probs).sum(), share.new_tensor(1 / layer.token_slices)])
        return grad, layer.aux_loss_scale * share, None


class AuxLossPool:
    """One forward's routed fractions of every MoE layer of a model (by layer: a layer that runs
    again, recomputed for activation checkpointing, writes the same), for the pooled loss."""

    def __init__(self):
        self.fractions: dict[int, torch.Tensor] = {}

    def mean(self) -> torch.Tensor:
        return torch.stack(list(self.fractions.values())).mean(dim=0)


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig, layer_id: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        # Shared by the model's MoE layers (Transformer sets it) where the loss pools them.
        self.aux_pool: AuxLossPool | None = None
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(dim, cfg)
        self.shared = SwiGLU(dim, cfg.num_shared_experts * cfg.hidden_dim) if cfg.num_shared_experts else None
        # Routed rows per expert since the last balance (moe/balance.py): training forwards only, an
        # activation-checkpointed layer's twice (a uniform factor neither the balance nor the
        # load's max/mean sees).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        # The auxiliary loss since the last balance, and the forwards it sums (for its metric).
        self.register_buffer("aux_loss_total", torch.zeros(2), persistent=False)
        # Set by the layout: the ranks whose tokens pass this layer at the same time (all but the
        # pipeline's; None on one device), how many slices of one batch's tokens they hold beyond
        # the data- and context-parallel split (TP's sequence slices), and the auxiliary loss's
        # gradient (1 / gradient-accumulation microbatches; a pipeline scales its own).
        self.token_group: dist.ProcessGroup | None = None
        self.token_slices = 1
        self.aux_loss_scale = 1.0
        # Set where TP splits the experts (moe/tensor_parallel.py).
        self.expert_tp: ExpertTensorParallel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, experts, scores = self.router(tokens)
        counts = rows_per_expert = self._counts(experts.flatten())  # this rank's tokens'
        shared_input = tokens
        if self.expert_tp is not None:  # every tp rank's tokens through its shards of the experts
            shared_input, tokens, weights, experts = self.expert_tp.gather(tokens, weights, experts)
            rows_per_expert = self._counts(experts.flatten(), count_load=False)
        order = experts.flatten().argsort(stable=True)  # grouped by expert, each group in token order
        source = order // self.cfg.top_k  # the token each sorted row came from
        routed = self.experts(tokens[source], rows_per_expert)
        # Back in token order (indexing by the inverse permutation keeps only the indices for
        # backward; index_copy and index_add keep their source too), then each token's top_k rows
        # weighed and summed in one batched matmul, as torchtitan does.
        by_token = routed[order.argsort()].view(-1, self.cfg.top_k, routed.shape[-1])
        out = torch.bmm(weights.unsqueeze(1), by_token).squeeze(1)
        shared = self.shared(shared_input) if self.shared is not None else None
        if self.expert_tp is not None:
            out = self.expert_tp.reduce(out, shared)
        elif shared is not None:
            out = out + shared
        if self.cfg.aux_loss_coeff is not None and self._counting(scores):
            out = self._with_aux_loss(out, scores, counts)
        return out.view_as(x)

    def tensor_parallel_plan(self, tp: TensorParallel) -> dict:
        """This layer under TP. Each tp rank routes its own slice of the sequence (no all-gather),
        so the router is replicated and sees different tokens on each rank (its gradients are summed
        over the ranks). Where expert parallelism spreads the experts over the tp ranks, each rank
        runs its slice's tokens through them, and the shared experts are replicated as the router;
        where TP splits the experts (moe/tensor_parallel.py), the slices are gathered first and the
        shared experts split as a dense FFN, their outputs partial sums until the layer's
        reduce-scatter."""
        self.token_slices = tp.mesh.size()
        replicated_on_local_tensors(self.router.gate, tp.mesh, Shard(0))  # (tokens, dim)
        plan = {
            "": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
        }
        if not tp.experts_split:
            if self.shared is not None:
                replicated_on_local_tensors(self.shared, tp.mesh, Shard(0))
            return plan
        self.expert_tp = ExpertTensorParallel(tp.mesh)
        if self.shared is not None:  # input: the gathered tokens, a replicated DTensor
            plan |= {
                "shared.w1": ColwiseParallel(),
                "shared.w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
                "shared.w3": ColwiseParallel(),
            }
        return plan

    @staticmethod
    def _counting(routing: torch.Tensor) -> bool:
        """Whether this forward is a training step's, with routing to count (not a dry run's)."""
        return torch.is_grad_enabled() and _COUNTING.get() and not is_fake(routing)

    def _counts(self, experts: torch.Tensor, count_load: bool = True) -> list[int]:
        """Rows routed to each expert, added to the load of a training forward (with `count_load`).
        A dry run's fake tensors hold no routing to count: there the tokens are taken as spread
        evenly (the balanced case the memory of a dry run then measures)."""
        num_experts = self.cfg.num_experts
        if is_fake(experts):
            share, extra = divmod(experts.numel(), num_experts)
            return [share + (expert < extra) for expert in range(num_experts)]
        counts = torch.bincount(experts, minlength=num_experts)
        if count_load and self._counting(experts):
            with torch.no_grad():
                self.tokens_per_expert += counts
        return counts.tolist()

    def _with_aux_loss(self, out: torch.Tensor, scores: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`out`, with Qwen3's load-balancing loss added in backward, over the global batch: the
        routed fractions summed over the token group (no gradient) against this rank's share of
        the mean router probabilities; per layer, or pooled over the layers (aux_loss_over)."""
        cfg = self.cfg
        routed = torch.tensor(counts, dtype=torch.float32, device=scores.device)
        if self.token_group is not None:
            dist.all_reduce(routed, group=self.token_group)
        fractions = routed / (routed.sum() / cfg.top_k)
        probs = scores if cfg.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        mean_probs = probs.sum(dim=0) / (probs.shape[0] * self.token_slices)
        if cfg.aux_loss_over == "all_layers":
            self.aux_pool.fractions[self.layer_id] = fractions
            return _AddPooledAuxiliaryLoss.apply(out, mean_probs, self)
        aux_loss = cfg.aux_loss_coeff * cfg.num_experts * (fractions * mean_probs).sum()
        with torch.no_grad():
            self.aux_loss_total += torch.stack([aux_loss.detach(), aux_loss.new_tensor(1 / self.token_slices)])
        return _AddAuxiliaryLoss.apply(out, aux_loss, self.aux_loss_scale)
