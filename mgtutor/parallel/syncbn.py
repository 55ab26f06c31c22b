"""Synchronized batch norm that also runs on CPU, and ``convert_sync_batchnorm`` to switch to it.

With data parallelism each rank sees only its own slice of the batch. A plain BatchNorm layer
normalizes with the mean and variance of that slice, so with 2 ranks of 16 samples it behaves
like BatchNorm with batch size 16, not 32. Synchronized batch norm computes the statistics over
the samples of *all* ranks instead, so the model trains as if one process saw the whole batch.

``torch.nn.SyncBatchNorm`` does this on GPUs only: on CPU it raises ``ValueError: SyncBatchNorm
expected input tensor to be on GPU ...``. :class:`SyncBatchNorm` here is a small version built
from plain tensor operations and two ``dist.all_reduce`` calls, so it runs with gloo on a laptop
and can be read in one sitting:

* forward, in training: every rank sums x and x² per channel and counts its values; one
  all-reduce adds these up across ranks; every rank then normalizes with the global mean and
  variance and updates its running statistics identically. The squares are formed around the
  rank's own mean, not as x² (see ``_local_sums``), so float32 and bfloat16 inputs whose mean is
  large against their spread keep their variance.
* backward: the gradient of a normalized value depends on every sample of the channel through
  the mean and variance, so it needs two per-channel sums of the gradient over the global batch;
  a second all-reduce adds them up.
* eval: the running statistics are used, and nothing is communicated.

The cost is one small all-reduce (2C+1 numbers for C channels) per batch-norm layer in forward
and one (2C numbers) in backward: little data, but each one is a point where every rank waits
for the slowest.

On a GPU the layer does not use this code: in training with more than one rank, a CUDA input
goes through torch's own ``torch.nn.SyncBatchNorm`` kernels (fused; each rank's mean and inverse
standard deviation, computed with Welford's algorithm, are gathered from every rank), so a model
is as fast on GPUs whether it was converted before or after ``model.to(device)``.

:func:`convert_sync_batchnorm` swaps every BatchNorm layer of a model for a synchronized one:
torch's own for a layer already on CUDA, this module's otherwise.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules._functions import SyncBatchNorm as _TorchSyncBatchNormFunction
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

# The per-channel sums travel and are combined in float64: sums, unlike Welford's running means,
# combine across ranks by plain addition, so one all-reduce works even when ranks hold different
# numbers of samples, and float64 keeps the sample count exact and the final E[x²] - E[x]²
# accurate (its cancellation costs about log10(mean² / var) of float64's 16 digits).
_STATS_DTYPE = torch.float64


def _per_channel(stat: Tensor, ndim: int) -> Tensor:
    """Shape a (C,) vector as (1, C, 1, ...) so it broadcasts against an (N, C, *) input."""
    return stat.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm in training mode with statistics over the samples of every rank.

    A plain ``dist.all_reduce`` works in place and autograd does not record it (backpropagating
    through it warns and yields only the local term), so this Function writes the backward pass
    by hand, as torch's own SyncBatchNorm does. For one channel, with N values over all ranks,
    x̂ = (x - mean) * invstd and y = weight * x̂ + bias, the gradient with respect to one input
    value is::

        dL/dx = weight * invstd * (dy - sum(dy) / N - x̂ * sum(dy * x̂) / N)

    where the sums run over the global batch. Each rank computes its local ``sum(dy)`` and
    ``sum(dy * x̂)``, and one all-reduce turns them into the global sums.

    The same local sums are the gradients of bias and weight for this rank's part of the loss.
    They are *not* all-reduced here: DistributedDataParallel already combines parameter
    gradients across ranks. Summed over the ranks they equal the gradients of one BatchNorm
    over the whole batch with the losses of the ranks added up. DDP averages instead of
    summing, which matches a single process's *mean* loss when every rank takes the mean over
    an equal number of samples.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        process_group: dist.ProcessGroup | None,
    ) -> Tensor:
        channels, ndim = input.shape[1], input.dim()
        dims = [0, *range(2, ndim)]  # every dimension but the channels
        # Half-precision inputs are computed in float32, as torch's own kernels do.
        compute_dtype = torch.promote_types(input.dtype, torch.float32)
        # A rank with no samples still takes part: its zeros keep the all-reduce from hanging.
        local_count = input.numel() // channels
        local_sum = input.sum(dims, dtype=_STATS_DTYPE)
        # Each channel centred on this rank's own mean, rounded: shift. Squaring x itself would
        # lose the variance when the mean is large against the spread (float32 values near 1e4
        # with a spread of 1: each x² near 1e8 is rounded by up to 4, and the variance is 1).
        # The deviations x - shift are small, so their squares keep every digit, and
        # Σx² = Σ(x - shift)² + shift·(2·Σx - n·shift) is recovered in float64.
        shift = (local_sum / max(local_count, 1)).to(compute_dtype)
        centred = input.to(compute_dtype) - _per_channel(shift, ndim)
        shift = shift.to(_STATS_DTYPE)
        local_sum_sq = centred.square().sum(dims, dtype=_STATS_DTYPE)
        local_sum_sq += shift * (2 * local_sum - local_count * shift)
        stats = torch.cat(
            [
                local_sum,
                local_sum_sq,
                torch.tensor([local_count], dtype=_STATS_DTYPE, device=input.device),
            ]
        )
        # One collective for all three, not three: each all-reduce pays a fixed latency.
        dist.all_reduce(stats, group=process_group)
        total, total_sq, count = stats[:channels], stats[channels:-1], stats[-1]
        n = int(count.item())
        if n <= 1:
            # Every rank sees the same global count, so every rank raises: none is left waiting.
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {n} in total "
                f"across the {dist.get_world_size(process_group)} ranks (input shape on this "
                f"rank: {tuple(input.shape)})"
            )
        mean = total / n
        var = (total_sq / n - mean * mean).clamp_min(0)  # rounding can make it slightly < 0

        if running_mean is not None and running_var is not None:
            # Normalization uses the biased variance; the running estimate is unbiased, and its
            # correction uses the global count, as one BatchNorm over the whole batch would.
            unbiased_var = var * (n / (n - 1))
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)

        # x - mean = (x - shift) - (mean - shift): both terms small, so no digit is lost to a
        # large mean. Returned in the input's dtype.
        invstd = torch.rsqrt(var + eps).to(compute_dtype)
        x_hat = centred - _per_channel((mean - shift).to(compute_dtype), ndim)
        x_hat = x_hat * _per_channel(invstd, ndim)
        output = x_hat
        if weight is not None:
            output = output * _per_channel(weight.to(compute_dtype), ndim)
        if bias is not None:
            output = output + _per_channel(bias.to(compute_dtype), ndim)

        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.count = n
        ctx.process_group = process_group
        ctx.input_dtype = input.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        x_hat, weight, invstd = ctx.saved_tensors
        channels, ndim = x_hat.shape[1], x_hat.dim()
        dims = [0, *range(2, ndim)]
        grad_output = grad_output.to(x_hat.dtype)  # the compute dtype of forward
        sum_dy = grad_output.sum(dims, dtype=_STATS_DTYPE)
        sum_dy_xhat = (grad_output * x_hat).sum(dims, dtype=_STATS_DTYPE)

        grad_input = None
        # Like torch's SyncBatchNorm, skip the all-reduce when no gradient flows into the input
        # (a first layer fed straight from the data): the parameter gradients need only local
        # sums. Every rank builds the same graph, so every rank skips it together.
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])  # a copy: the local sums are still needed
            dist.all_reduce(sums, group=ctx.process_group)
            mean_dy, mean_dy_xhat = (sums / ctx.count).to(x_hat.dtype).split(channels)
            scale = invstd if weight is None else weight.to(invstd.dtype) * invstd
            grad_input = _per_channel(scale, ndim) * (
                grad_output - _per_channel(mean_dy, ndim) - x_hat * _per_channel(mean_dy_xhat, ndim)
            )
            grad_input = grad_input.to(ctx.input_dtype)

        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        # One gradient per argument of forward; the buffers, eps, momentum and group get none.
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch norm whose statistics cover the samples of every rank; works on CPU with gloo.

    A drop-in for ``torch.nn.SyncBatchNorm`` (same constructor, same behaviour) for inputs of
    shape (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W). In training mode with a process
    group of more than one rank it uses the statistics of the global batch (see the module
    docstring); ranks may hold different numbers of samples, even none. Otherwise (eval mode,
    no process group, or a group of one) it is exactly ``torch.nn.BatchNorm*d``, and in eval
    mode it communicates nothing, so ranks may evaluate independently.

    Which code synchronizes is decided by each input, not by where the layer was made: a CPU
    input runs this module's implementation (sums and ``dist.all_reduce``); a CUDA input runs
    the autograd Function behind ``torch.nn.SyncBatchNorm``, exactly what torch's layer runs.

    The running statistics come out identical on every rank, since each rank updates them
    from the same all-reduced sums.

    It subclasses torch's batch-norm base class, not ``torch.nn.SyncBatchNorm``: code that
    looks for batch-norm layers finds it, while DistributedDataParallel, which refuses
    ``torch.nn.SyncBatchNorm`` layers in a CPU model, accepts it.

    Args:
        num_features: C, the number of channels of the input.
        eps: added to the variance before its square root, for numerical stability.
        momentum: weight of the newest batch in the running statistics; None for a cumulative
            average over all batches seen so far.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running_mean and running_var for eval mode; if False, eval
            mode normalizes with the local batch's own statistics.
        process_group: the ranks whose samples are combined; None for all of them.
        device: where to create the parameters and buffers.
        dtype: their dtype.
        bias: with affine, learn the bias too (False: weight only).

    Example:
        >>> def work():
        ...     mgtutor.setup()
        ...     bn = SyncBatchNorm(1, momentum=1.0)  # running_mean becomes the batch mean
        ...     bn(torch.full((2, 1), float(dist.get_rank())))  # rank 0: zeros, rank 1: ones
        ...     return bn.running_mean.item()
        >>> mgtutor.launch(work, world_size=2).results  # BatchNorm1d would give [0.0, 1.0]
        [0.5, 0.5]
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        if affine and not bias:
            # Removed here rather than passed on: older torch versions take no `bias` argument.
            self.register_parameter("bias", None)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2 or input.shape[1] == 0:
            raise ValueError(
                f"SyncBatchNorm expects an input of shape (N, C, *) with at least one channel, "
                f"got shape {tuple(input.shape)}"
            )

    def _group_size(self) -> int:
        """Number of ranks whose statistics this layer combines (1 when not distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` per channel; see the class docstring for which statistics.

        Args:
            input: a tensor of shape (N, C, *) with C == num_features.

        Returns:
            The normalized tensor, of the same shape.
        """
        self._check_input_dim(input)

        # The factor of the newest batch in the running statistics, decided as BatchNorm does.
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative average: batch k gets weight 1/k
                momentum = 1.0 / float(self.num_batches_tracked)

        # Eval mode normalizes with the running statistics when there are any, and never syncs.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Training updates the buffers only if they are tracked; eval mode only reads them.
        pass_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if pass_buffers else None
        running_var = self.running_var if pass_buffers else None

        group_size = self._group_size()
        if not self.training or group_size == 1:
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                use_batch_stats,
                momentum,
                self.eps,
            )
        if input.is_cuda:
            # torch's own kernels, called as torch.nn.SyncBatchNorm.forward calls them. A model
            # converted on the CPU and then moved to a GPU runs the same code as one converted
            # on the GPU, and NCCL gets the collectives it is tuned for (an all-gather of each
            # rank's mean, inverse std and count in forward; an all-reduce in backward).
            return _TorchSyncBatchNormFunction.apply(
                input,
                self.weight,
                self.bias,
                running_mean,
                running_var,
                self.eps,
                momentum,
                self.process_group or dist.group.WORLD,
                group_size,
            )
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            momentum,
            self.process_group,
        )


def _is_on_cuda(layer: nn.Module) -> bool:
    """Whether any of the layer's own parameters or buffers (not its children's) is on CUDA."""
    tensors = itertools.chain(layer.parameters(recurse=False), layer.buffers(recurse=False))
    return any(t.is_cuda for t in tensors)


def _convert(module: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
    converted = module
    if isinstance(module, _BatchNorm):
        # Decided per layer, from its own tensors: a model may sit partly on the CPU. A layer
        # with no tensors (affine=False, no running statistics) gets this module's class, which
        # runs torch's kernels anyway once its input is on CUDA.
        layer_class = nn.SyncBatchNorm if _is_on_cuda(module) else SyncBatchNorm
        converted = layer_class(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        # The new layer takes over the old one's tensors themselves, not copies, as torch's
        # conversion does: values, dtype, device and requires_grad all carry over.
        converted.weight = module.weight
        converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, _convert(child, process_group))
    return converted


def convert_sync_batchnorm(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` with a synchronized one.

    A BatchNorm layer whose parameters or buffers are on CUDA becomes torch's
    ``torch.nn.SyncBatchNorm``; any other becomes this module's :class:`SyncBatchNorm`, which
    runs torch's CUDA kernels too as soon as its input is on a GPU. So the order does not
    matter: converting before or after ``model.to(device)`` computes the same on GPUs, with
    torch's kernels, and a model on the CPU gets layers that work with gloo (and that
    DistributedDataParallel accepts on the CPU, which it refuses for torch's layer). The new
    layers keep the old ones' weight, bias, running statistics, batch count, requires_grad,
    train/eval mode and qconfig, and every other layer is left as it is. Convert before
    wrapping the model in DistributedDataParallel, and before creating the optimizer.

    Args:
        module: a model, or a single BatchNorm layer.
        process_group: the ranks whose samples are combined; None for all of them.

    Returns:
        ``module`` with its BatchNorm layers replaced; a new layer if ``module`` itself is a
        BatchNorm layer.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> convert_sync_batchnorm(model)[1]
        SyncBatchNorm(8, eps=1e-05, momentum=0.1, affine=True, bias=True, track_running_stats=True)
    """
    return _convert(module, process_group)
