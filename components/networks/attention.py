"""Fused window attention for MONAI's Swin transformer, in training as well as in inference.

MONAI's ``WindowAttention`` calls ``torch.nn.functional.scaled_dot_product_attention`` only when gradients are
off (its ``use_flash_attention``); in training it builds the attention matrix explicitly: ``q @ k^T``, the relative
position bias, the shifted-window mask, softmax, dropout, ``@ v``, each a separate kernel with its own saved
activation. :class:`FusedWindowAttention` computes the same function with one ``scaled_dot_product_attention``
call whose additive mask is the relative position bias (with its gradient) plus the shifted-window mask, in
training and in inference. PyTorch picks the kernel: a fused one (flash / memory-efficient) where the device, dtype
and shapes allow, otherwise its math kernel. On the CPU in training there is no fused kernel with a bias gradient,
and PyTorch's math path was slower than MONAI's own code (the SSL bundle's 64^3 / feature 12 step: 4.6 s against
3.6 s on 2 vCPUs), so there the module computes MONAI's explicit attention (the same function) and says so once
at INFO.

The class only replaces ``forward``: parameters, buffers and state-dict keys are MONAI's, so weights load both
ways and :func:`use_fused_attention` switches a built network in place (and back).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from monai.networks.nets.swin_unetr import WindowAttention

__all__ = ["FusedWindowAttention", "use_fused_attention"]

logger = logging.getLogger(__name__)


class FusedWindowAttention(WindowAttention):
    """MONAI's ``WindowAttention`` computed by ``scaled_dot_product_attention`` with gradients.

    Shapes: ``x`` ``(B * nW, N, C)`` (the windows of each image consecutive, as ``window_partition`` gives them),
    ``mask`` ``(nW, N, N)`` (0 / -100, shifted windows) or None; output ``(B * nW, N, C)``. The relative position
    bias and the mask are added inside the kernel; the windows of one image share one ``(nW * heads, N, N)`` bias,
    broadcast over the images instead of copied for each. Attention dropout is the kernel's ``dropout_p`` (in
    training only). Under autocast the bias takes the query's dtype, as the kernel requires.

    Built by :func:`use_fused_attention` from an existing ``WindowAttention``; constructing it directly takes
    ``WindowAttention``'s arguments. ``fused_cpu_training`` (default false) also uses the kernel when training on
    the CPU, where MONAI's explicit attention is otherwise computed (see the module docstring).
    """

    fused_cpu_training: bool = False
    _cpu_fallback_logged: bool = False

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cpu" and torch.is_grad_enabled() and not self.fused_cpu_training:
            if not FusedWindowAttention._cpu_fallback_logged:
                FusedWindowAttention._cpu_fallback_logged = True
                logger.info("fused_attention: training on the CPU computes MONAI's explicit window attention "
                            "(PyTorch has no fused CPU kernel with a bias gradient; its math path is slower)")  # fmt: skip
            return super().forward(x, mask)
        b, n, c = x.shape
        heads = self.num_heads
        q, k, v = self.qkv(x).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)  # each (b, heads, n, d)
        index = self.relative_position_index[:n, :n].reshape(-1)  # type: ignore[index]
        bias = self.relative_position_bias_table[index].reshape(n, n, heads).permute(2, 0, 1)  # (heads, n, n)
        if mask is None:
            groups, bias = b, bias.unsqueeze(0)  # (1, heads, n, n) over every window
        else:
            windows = mask.shape[0]
            groups = b // windows
            bias = (bias.unsqueeze(0) + mask.unsqueeze(1)).reshape(1, windows * heads, n, n)  # per window and head
        # the windows of an image side by side along the head axis: (B, nW * heads, n, d) meets the (nW * heads) bias
        q, k, v = (t.reshape(groups, -1, n, t.shape[-1]) for t in (q, k, v))
        dropout = self.attn_drop.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout, scale=self.scale)
        out = out.reshape(b, heads, n, -1).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))


def use_fused_attention(network: torch.nn.Module, enabled: bool = True, fused_cpu_training: bool = False) -> torch.nn.Module:
    """Switches every MONAI ``WindowAttention`` in ``network`` to :class:`FusedWindowAttention` (``enabled``) or
    back to MONAI's explicit computation, in place, and returns ``network`` (for use in a bundle config:
    ``"$components.use_fused_attention(@network_def, @speed#fused_attention).to(@device)"``).

    Only the class of each module changes: parameters, buffers, state-dict keys and the modules' identities stay,
    so an optimizer or a DDP wrapper built before still holds the same tensors. ``fused_cpu_training``: use the
    kernel in CPU training too (see :class:`FusedWindowAttention`).

    Raises:
        ValueError: when ``enabled`` is true and ``network`` holds no ``WindowAttention`` (nothing to switch is a
            wrong network, not a no-op).

    Example::

        >>> net = use_fused_attention(SwinUNETR(in_channels=1, out_channels=2, feature_size=12))
        >>> sum(isinstance(m, FusedWindowAttention) for m in net.modules())
        8
    """
    enabled = bool(enabled)
    target = FusedWindowAttention if enabled else WindowAttention
    blocks = [m for m in network.modules() if isinstance(m, WindowAttention)]
    if enabled and not blocks:
        raise ValueError(f"fused_attention: {type(network).__name__} has no MONAI WindowAttention to switch.")
    for module in blocks:
        module.__class__ = target
        if enabled:
            module.fused_cpu_training = bool(fused_cpu_training)
    logger.info("fused_attention %s: %d window-attention blocks of %s use %s", enabled, len(blocks),
                type(network).__name__, "scaled_dot_product_attention" if enabled else "MONAI's explicit attention")  # fmt: skip
    return network
