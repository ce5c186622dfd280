"""AdamW over one flat buffer: torch's multi-tensor AdamW, one kernel per pass for all tensors.

On CPU torch's multi-tensor ("foreach") AdamW loops over the tensors for each of its ~10
element-wise passes, so a step over the tiny preset's 47 tensors is ~500 small kernels, about a
third of it dispatch overhead. `FlatAdamW` keeps the parameters as views into one contiguous
tensor and their moments likewise, gathers the gradients into one tensor (one copy), and runs
the very same `torch.optim.adam.adam` call on single-tensor lists. Each element goes through
the same operations as before: the result is bit-identical to `AdamW(foreach=True)`
(tests/workers/rl/test_flat_adamw.py). The fused kernel would be faster still, but it rounds
differently (see `engine.adamw_impl`).

Wherever the flat layout does not hold for a step -- a parameter without a gradient (torch then
skips it), parameters or moments re-pointed (a checkpoint load), a closure, AMSGrad, a gradient
scaler -- the step is torch's own per-tensor one on the same state, and the layout is rebuilt
at the next step that allows it. The optimizer's state dict keeps torch's per-parameter layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam


class FlatAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(params, foreach=True, ...)` whose step runs on flat buffers (one
    parameter group, dense float tensors on one CPU device)."""

    def __init__(self, params: Any, **kwargs: Any):
        super().__init__(params, foreach=True, **kwargs)
        # (flat params, flat exp_avg, flat exp_avg_sq, the shared step, element offsets)
        self._flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          list[int]] | None = None

    def step(self, closure: Any = None) -> Any:
        if closure is None and self._flat_step():
            return None
        self._unshare()
        return super().step(closure)

    # ---- the flat step -------------------------------------------------------------------

    def _eligible(self) -> list[torch.Tensor] | None:
        """The group's parameters when this step can run flat, else None."""
        if len(self.param_groups) != 1 or getattr(self, "grad_scale", None) is not None \
                or getattr(self, "found_inf", None) is not None:
            return None
        group = self.param_groups[0]
        if (group["amsgrad"] or group["maximize"] or group["capturable"]
                or group["differentiable"] or group["fused"] or not group["foreach"]
                or isinstance(group["lr"], torch.Tensor)):
            return None
        params: list[torch.Tensor] = group["params"]
        if not params:
            return None
        dtype, device = params[0].dtype, params[0].device
        for p in params:
            g = p.grad
            if (g is None or g.is_sparse or g.dtype != dtype or g.device != device
                    or p.dtype != dtype or p.device != device or p.is_complex()):
                return None
        if device.type != "cpu" or not dtype.is_floating_point:
            return None
        return params

    def _holds(self, params: list[torch.Tensor]) -> bool:
        """Whether every parameter and its moments are still the views `_flatten` made."""
        if self._flat is None:
            return False
        flat, m, v, step, offsets = self._flat
        if len(offsets) != len(params) + 1:
            return False
        size = flat.element_size()
        p0, m0, v0 = flat.data_ptr(), m.data_ptr(), v.data_ptr()
        for p, off in zip(params, offsets, strict=False):
            st = self.state.get(p)
            if (st is None or p.data_ptr() != p0 + off * size or st.get("step") is not step
                    or st["exp_avg"].data_ptr() != m0 + off * size
                    or st["exp_avg_sq"].data_ptr() != v0 + off * size
                    or not p.is_contiguous()):
                return False
        return True

    def _flatten(self, params: list[torch.Tensor]) -> bool:
        """Move the parameters and their state into flat buffers (values unchanged)."""
        states = [self.state.get(p) or {} for p in params]
        fresh = not any(states)
        if not fresh and not all({"step", "exp_avg", "exp_avg_sq"} <= set(s) for s in states):
            return False  # some tensors never stepped: torch's per-tensor step handles that
        if not fresh:
            steps = {float(s["step"]) for s in states}
            if len(steps) != 1:
                return False
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            if fresh:
                m, v = torch.zeros_like(flat), torch.zeros_like(flat)
                step = torch.tensor(0.0, dtype=torch.float32)
            else:
                m = torch.cat([s["exp_avg"].reshape(-1) for s in states]).to(flat.dtype)
                v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]).to(flat.dtype)
                step = states[0]["step"].detach().clone()
        for p, a, b in zip(params, offsets, offsets[1:], strict=False):
            p.data = flat[a:b].view_as(p)
            self.state[p] = {"step": step, "exp_avg": m[a:b].view_as(p),
                             "exp_avg_sq": v[a:b].view_as(p)}
        self._flat = (flat, m, v, step, offsets)
        return True

    def _flat_step(self) -> bool:
        params = self._eligible()
        if params is None or not (self._holds(params) or self._flatten(params)):
            return False
        assert self._flat is not None
        flat, m, v, step, _ = self._flat
        group = self.param_groups[0]
        grad = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        beta1, beta2 = group["betas"]
        adam([flat], [grad], [m], [v], [], [step], amsgrad=False, has_complex=False,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=False, foreach=True, capturable=False,
             differentiable=False, fused=None, grad_scale=None, found_inf=None,
             decoupled_weight_decay=True)
        return True

    def _unshare(self) -> None:
        """Before torch's own step: give every parameter its own step counter (the flat
        layout shares one, and torch increments each parameter's)."""
        if self._flat is None:
            return
        shared = self._flat[3]
        for st in self.state.values():
            if st.get("step") is shared:
                st["step"] = shared.clone()
        self._flat = None
