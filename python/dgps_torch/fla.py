"""FLA's op functions (flash-linear-attention, fla.ops.*) on dgps: same names, argument order, defaults and returns.

Arguments dgps does not offer raise NotImplementedError naming them; other keyword arguments a function does not
use are ignored with a warning, as FLA ignores them (see _reject).
"""
import warnings

import torch
import torch.nn.functional as F

from .core import recurrence
from .serve import pool_recurrence, vllm_indices

RCP = "dgps_torch"


# FLA keyword arguments that change what a call reads or writes: never ignored where a function lacks them.
_STATEFUL = {"ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "out", "g_cumsum", "cp_context",
             "initial_state_indices", "output_state_indices", "intermediate_states_buffer", "reverse",
             "return_intermediate_states", "use_gate_in_kernel", "A_log", "dt_bias"}


def _reject(fn, kwargs, accepted=()):
    """Raises for `head_first=True`; warns about (and ignores) any other keyword argument not in `accepted`.

    FLA's op functions take `**kwargs` and ignore the names they do not use, and callers rely on it
    (transformers' Qwen3-Next passes `use_cache` and `output_router_logits` through), so dgps ignores them too,
    with a warning naming them (shown once per name)."""
    if kwargs.get("head_first"):
        raise NotImplementedError(f"{RCP}.{fn}: head_first=True is not supported (FLA removed it too): "
                                  "pass [B, T, H, D] tensors")
    for k in kwargs:
        if k in accepted or k == "head_first":
            continue
        if k in _STATEFUL and kwargs[k] is not None and kwargs[k] is not False:
            raise NotImplementedError(f"{RCP}.{fn}: argument {k} is not supported by this function")
        warnings.warn(f"{RCP}.{fn}: ignoring keyword argument {k!r}, which it does not use (as FLA does)",
                      UserWarning, stacklevel=3)


def _v_first(fn, state_v_first, kwargs):
    """FLA's state layout flag: `state_v_first`, or its deprecated name `transpose_state_layout` (as FLA: a
    DeprecationWarning; both given: ValueError)."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError(f"{RCP}.{fn}: cannot pass both `state_v_first` and the deprecated `transpose_state_layout`")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        return bool(kwargs["transpose_state_layout"])
    return bool(state_v_first)


def _unsupported(fn, **given):
    """Raises NotImplementedError naming every FLA argument given a value that dgps does not offer."""
    bad = [k for k, v in given.items() if v is not None and v is not False]
    if bad:
        raise NotImplementedError(f"{RCP}.{fn}: argument(s) {', '.join(bad)} are not supported by dgps")


def _f32(t):
    """`t` in float32 when it is a 16-bit type (FLA computes gates in float32), else unchanged."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _beta(fn, beta, use_sigmoid, allow_neg):
    if allow_neg and not use_sigmoid:
        raise ValueError(f"{RCP}.{fn}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if use_sigmoid:  # kept in float32, as FLA's kernels use it
        beta = _f32(beta).sigmoid()
        if allow_neg:
            beta = beta * 2
    return beta


def _state_in(h0, v_first):
    return h0.transpose(-1, -2) if h0 is not None and v_first else h0


def _state_out(ht, v_first):
    return ht.transpose(-1, -2) if ht is not None and v_first else ht


def _chunk_size(fn, kwargs, allowed, what):
    """Checks FLA's `chunk_size` option with FLA's message (callers match it); dgps picks its own chunk length."""
    c = kwargs.get("chunk_size", 64)
    if c not in allowed:
        choices = f"either {allowed[0]} or {allowed[1]}" if len(allowed) == 2 else \
            ", ".join(map(str, allowed[:-1])) + f", or {allowed[-1]}"
        raise ValueError(f"{RCP}.{fn}: `chunk_size` must be {choices} for {what}, got {c}.")
    return 64  # dgps's kernels use their own chunk length: the result does not depend on it


def _gdn_gate(g, A_log, dt_bias):
    """FLA's gated-DeltaNet gate: -exp(A_log) * softplus(g + dt_bias), per value head, in float32."""
    x = _f32(g) if dt_bias is None else _f32(g) + _f32(dt_bias)
    return -_f32(A_log).exp() * F.softplus(x)


def _kda_gate(g, A_log, dt_bias, lower_bound):
    """FLA's KDA gate per key channel: -exp(A_log) softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) (g + dt_bias))."""
    HV, K = g.shape[-2], g.shape[-1]
    x = _f32(g)
    if dt_bias is not None:
        x = x + _f32(dt_bias).view(HV, K)
    a = None if A_log is None else _f32(A_log).exp().view(HV, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(x if a is None else a * x)


def _center(log_atk_scale, H, ref):
    if log_atk_scale is None:
        return torch.full((H,), -0.2, dtype=torch.float32, device=ref.device)
    if isinstance(log_atk_scale, (int, float)):
        return torch.full((H,), float(log_atk_scale), dtype=torch.float32, device=ref.device)
    return log_atk_scale


def _ret2(o, ht, out):
    return o, (ht if out else None)


def _pool_view(pool, v_first):
    """The state pool as pool_recurrence takes it: [P, HV, K, V]; a K-last pool (FLA's state_v_first,
    [P, HV, V, K]) as its transposed view, updated in place through it."""
    return pool.transpose(-1, -2) if v_first else pool


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, initial_state_indices=None, has_initial_state=None, **kwargs):
    """Gated DeltaNet (FLA `fla.ops.gated_delta_rule.chunk_gated_delta_rule`). Returns (o, final_state or None).

    SGLang's prefill through a state pool (CPU): with `initial_state_indices` [N], `initial_state` is the pool
    [P, HV, K, V]; sequence n starts from initial_state[idx[n]] (from zero where `has_initial_state[n]` is False)
    and its final state replaces that slot in place; idx < 0 marks padding (pool untouched, outputs zero).
    Returns (o, initial_state). Forward only.
    """
    fn = "chunk_gated_delta_rule"
    _reject(fn, kwargs, ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "transpose_state_layout"))
    _unsupported(fn, cp_context=cp_context)
    _chunk_size(fn, kwargs, (16, 32, 64), "Gated Delta Rule")
    v_first = _v_first(fn, state_v_first, kwargs)
    if kwargs.get("use_gate_in_kernel", False):
        g = _gdn_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"))
    beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if initial_state_indices is not None:
        if initial_state is None:
            raise ValueError(f"{RCP}.{fn}: initial_state_indices needs initial_state (the state pool [P, HV, K, V])")
        o = pool_recurrence("gdn", q, k, v, _pool_view(initial_state, v_first), g=g, beta=beta,
                            slots=initial_state_indices, has_initial=has_initial_state, cu_seqlens=cu_seqlens,
                            scale=scale, l2norm_qk=use_qk_l2norm_in_kernel)
        return o, initial_state
    if has_initial_state is not None:
        raise ValueError(f"{RCP}.{fn}: has_initial_state needs initial_state_indices")
    o, ht, _ = recurrence("gdn", q, k, v, g=g, beta=beta, initial_state=_state_in(initial_state, v_first),
                          scale=scale, output_final_state=output_final_state, l2norm_qk=use_qk_l2norm_in_kernel,
                          cu_seqlens=cu_seqlens)
    return _ret2(o, _state_out(ht, v_first), output_final_state)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, inplace_final_state=True, ssm_state_indices=None,
                                     num_accepted_tokens=None, **kwargs):
    """FLA's fused_recurrent_gated_delta_rule (with a backward here). `gk` (per-key decay) is added to `g`.

    vLLM's continuous batching (CPU, forward only): with `ssm_state_indices` [N], `initial_state` is the state pool
    [P, HV, K, V]; sequence n starts from initial_state[idx[n]] and its final state replaces that slot
    (`inplace_final_state=True`; False: row n of a new [N, HV, K, V] tensor); idx < 0 is padding (pool untouched,
    outputs zero). With [N, D] indices and `num_accepted_tokens` [N] (speculative verification) sequence n starts
    from initial_state[idx[n, accepted[n] - 1]] and the state after its token t goes to initial_state[idx[n, t]].
    Returns (o, final_state) where final_state is the pool; `output_final_state` is ignored then.
    """
    fn = "fused_recurrent_gated_delta_rule"
    _reject(fn, kwargs, ("transpose_state_layout",))
    _unsupported(fn, gv=gv)
    v_first = _v_first(fn, state_v_first, kwargs)
    HV = v.shape[2]
    if beta is None:
        beta = torch.ones(q.shape[0], q.shape[1], HV, dtype=q.dtype, device=q.device)
    if beta.dim() == 4:
        raise NotImplementedError(f"{RCP}.{fn}: a per-value-channel beta [B, T, HV, V] is not supported by dgps")
    beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel and g is not None:
        g = _gdn_gate(g, A_log, dt_bias)
    if gk is not None:
        model, gate = "kda", gk if g is None else gk + g.unsqueeze(-1).to(gk.dtype)
    elif g is not None:
        model, gate = "gdn", g
    else:
        model, gate = "dn", None
    if ssm_state_indices is not None:
        pool, ix = vllm_indices(fn, q, initial_state, ssm_state_indices, num_accepted_tokens, inplace_final_state)
        o = pool_recurrence(model, q, k, v, _pool_view(pool, v_first), g=gate, beta=beta, cu_seqlens=cu_seqlens,
                            scale=scale, l2norm_qk=use_qk_l2norm_in_kernel, **ix)
        return o, pool
    if num_accepted_tokens is not None:
        raise ValueError(f"{RCP}.{fn}: num_accepted_tokens needs ssm_state_indices")
    o, ht, _ = recurrence(model, q, k, v, g=gate, beta=beta, initial_state=_state_in(initial_state, v_first),
                          scale=scale, output_final_state=output_final_state, l2norm_qk=use_qk_l2norm_in_kernel,
                          cu_seqlens=cu_seqlens)
    return _ret2(o, _state_out(ht, v_first), output_final_state)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, **kwargs):
    """Kimi Delta Attention (FLA `fla.ops.kda.chunk_kda`): per-key-channel decay g [B,T,HV,K]. Returns (o, ht)."""
    fn = "chunk_kda"
    _reject(fn, kwargs, ("A_log", "dt_bias", "chunk_size", "transpose_state_layout", "chunk_indices"))
    _unsupported(fn, cp_context=cp_context, return_intermediate_states=return_intermediate_states)
    _chunk_size(fn, kwargs, (32, 64), "KDA")
    v_first = _v_first(fn, state_v_first, kwargs)
    if use_gate_in_kernel:
        g = _kda_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"), lower_bound)
    beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, ht, _ = recurrence("kda", q, k, v, g=g, beta=beta, initial_state=_state_in(initial_state, v_first),
                          scale=scale, output_final_state=output_final_state, l2norm_qk=use_qk_l2norm_in_kernel,
                          cu_seqlens=cu_seqlens)
    return _ret2(o, _state_out(ht, v_first), output_final_state)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA's fused_recurrent_kda (differentiable here). Returns (o, ht)."""
    fn = "fused_recurrent_kda"
    _reject(fn, kwargs, ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "out",
                         "transpose_state_layout"))
    _unsupported(fn, ssm_state_indices=kwargs.get("ssm_state_indices"),
                 num_accepted_tokens=kwargs.get("num_accepted_tokens"),
                 inplace_final_state=kwargs.get("inplace_final_state"), out=kwargs.get("out"))
    v_first = _v_first(fn, state_v_first, kwargs)
    if use_gate_in_kernel:
        g = _kda_gate(g, A_log, dt_bias, lower_bound)
    beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, ht, _ = recurrence("kda", q, k, v, g=g, beta=beta, initial_state=_state_in(initial_state, v_first),
                          scale=scale, output_final_state=output_final_state, l2norm_qk=use_qk_l2norm_in_kernel,
                          cu_seqlens=cu_seqlens)
    return _ret2(o, _state_out(ht, v_first), output_final_state)


def _precond(fn, model, q, k, v, g, g_atk, beta_atk, beta, scale, initial_state, initial_A_state,
             output_final_state, l2norm, cu_seqlens, v_first, x, eps, log_atk_scale):
    center = _center(log_atk_scale, q.shape[2], q)
    o, ht, at = recurrence(model, q, k, v, g=g, beta=beta, g_p=g_atk, beta_p=beta_atk, center=center,
                           initial_state=_state_in(initial_state, v_first), initial_A_state=initial_A_state,
                           scale=scale, output_final_state=output_final_state, l2norm_qk=l2norm, x=x, eps=eps,
                           cu_seqlens=cu_seqlens)
    if not output_final_state:
        return o, None, None
    return o, _state_out(ht, v_first), at


def chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, scale=None, initial_state=None,
                                   initial_A_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
                                   transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None, **kwargs):
    """Preconditioned gated DeltaNet (FLA `chunk_precond_gated_delta_rule`). Returns (o, ht, at)."""
    fn = "chunk_precond_gated_delta_rule"
    _reject(fn, kwargs, ("chunk_indices", "chunk_size"))
    _unsupported(fn, cp_context=cp_context)
    return _precond(fn, "pgdn", q, k, v, g, g_atk, beta_atk, beta, scale, initial_state, initial_A_state,
                    output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout, x, eps,
                    log_atk_scale)


def fused_recurrent_precond_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, g_atk=None,
                                             beta_atk=None, scale=None, initial_state=None, initial_A_state=None,
                                             output_final_state=False, use_qk_l2norm_in_kernel=True,
                                             cu_seqlens=None, transpose_state_layout=False, x=1.5, eps=1e-6,
                                             log_atk_scale=None):
    """FLA's fused_recurrent_precond_gated_delta_rule (differentiable here); `gk` is added to `g`. Returns (o, ht, at)."""
    fn = "fused_recurrent_precond_gated_delta_rule"
    _unsupported(fn, gv=gv)
    if g_atk is None or beta_atk is None:
        raise ValueError(f"{RCP}.{fn}: g_atk and beta_atk are required")
    if beta is None:
        beta = torch.ones(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    if beta.dim() == 4:
        raise NotImplementedError(f"{RCP}.{fn}: a per-value-channel beta [B, T, HV, V] is not supported by dgps")
    if gk is not None:
        model, gate = "pkda", gk if g is None else gk + g.unsqueeze(-1).to(gk.dtype)
    elif g is not None:
        model, gate = "pgdn", g
    else:
        model, gate = "pdn", None
    return _precond(fn, model, q, k, v, gate, g_atk, beta_atk, beta, scale, initial_state, initial_A_state,
                    output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout, x, eps,
                    log_atk_scale)


def chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None, initial_A_state=None,
                      output_final_state=False, use_gate_in_kernel=False, safe_gate=False, lower_bound=None,
                      cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None,
                      transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None, solve_tril_precision=None,
                      disable_recompute=False, return_intermediate_states=False, **kwargs):
    """Preconditioned KDA (FLA `chunk_precond_kda`; q and k are always L2-normalised, as in FLA). Returns (o, ht, at)."""
    fn = "chunk_precond_kda"
    _reject(fn, kwargs, ("A_log", "dt_bias", "use_qk_l2norm_in_kernel", "chunk_size"))
    _unsupported(fn, cp_context=cp_context, return_intermediate_states=return_intermediate_states)
    if use_gate_in_kernel:
        g = _kda_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"), lower_bound)
    return _precond(fn, "pkda", q, k, v, g, g_atk, beta_atk, beta, scale, initial_state, initial_A_state,
                    output_final_state, True, cu_seqlens, transpose_state_layout, x, eps, log_atk_scale)


def fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, A_log=None, dt_bias=None, scale=None,
                                initial_state=None, initial_A_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, lower_bound=None,
                                cu_seqlens=None, transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None,
                                **kwargs):
    """FLA's fused_recurrent_precond_kda (differentiable here). Returns (o, ht, at)."""
    fn = "fused_recurrent_precond_kda"
    _reject(fn, kwargs)
    if use_gate_in_kernel:
        g = _kda_gate(g, A_log, dt_bias, lower_bound)
    return _precond(fn, "pkda", q, k, v, g, g_atk, beta_atk, beta, scale, initial_state, initial_A_state,
                    output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout, x, eps,
                    log_atk_scale)


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """DeltaNet (FLA `fla.ops.delta_rule.chunk_delta_rule`; float32 inputs are allowed here). Returns (o, ht)."""
    fn = "chunk_delta_rule"
    _reject(fn, kwargs, ("chunk_size",))
    _chunk_size(fn, kwargs, (16, 32, 64), "Delta Rule")
    o, ht, _ = recurrence("dn", q, k, v, beta=beta, initial_state=initial_state, scale=scale,
                          output_final_state=output_final_state, l2norm_qk=use_qk_l2norm_in_kernel,
                          cu_seqlens=cu_seqlens)
    return _ret2(o, ht, output_final_state)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """FLA's fused_recurrent_delta_rule (beta defaults to ones). Returns (o, ht)."""
    fn = "fused_recurrent_delta_rule"
    if beta is None:
        beta = torch.ones(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    if beta.dim() == 4:
        raise NotImplementedError(f"{RCP}.{fn}: a per-value-channel beta [B, T, H, V] is not supported by dgps")
    return chunk_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            cu_seqlens)


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
    """Gated linear attention (FLA `fla.ops.gla.chunk_gla`): g [B,T,H,K] log decays, no delta rule. Returns (o, ht)."""
    fn = "chunk_gla"
    _reject(fn, kwargs, ("cu_seqlens_cpu", "chunk_indices", "g_cumsum", "state_v_first"))
    _unsupported(fn, g_cumsum=kwargs.get("g_cumsum"))
    v_first = kwargs.get("state_v_first", False)
    o, ht, _ = recurrence("gla", q, k, v, g=g, initial_state=_state_in(initial_state, v_first), scale=scale,
                          output_final_state=output_final_state, l2norm_qk=False, cu_seqlens=cu_seqlens)
    return _ret2(o, _state_out(ht, v_first), output_final_state)


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """Mamba-2-style scalar-decay linear attention (FLA `chunk_simple_gla`): g [B,T,H] or g_gamma [H]. Returns (o, ht)."""
    fn = "chunk_simple_gla"
    _reject(fn, kwargs, ("chunk_size", "chunk_indices", "transpose_state_layout"))
    state_v_first = _v_first(fn, state_v_first, kwargs)
    if g is not None and g_gamma is not None:
        raise ValueError(f"{RCP}.{fn}: pass g or g_gamma, not both")
    if g_gamma is not None:
        g = g_gamma.to(q.dtype if q.device.type == "cpu" else g_gamma.dtype).view(1, 1, -1).expand(
            q.shape[0], q.shape[1], -1)
    model = "la" if g is None else "simple_gla"
    model = model if model == "la" else "scalar,unit,identity,offline"
    o, ht, _ = recurrence(model, q, k, v, g=g, initial_state=_state_in(initial_state, state_v_first), scale=scale,
                          output_final_state=output_final_state, l2norm_qk=False, cu_seqlens=cu_seqlens)
    return _ret2(o, _state_out(ht, state_v_first), output_final_state)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None,
                               **kwargs):
    """FLA's fused_recurrent_simple_gla (reverse=True is not supported). Returns (o, ht)."""
    fn = "fused_recurrent_simple_gla"
    _reject(fn, kwargs, ("transpose_state_layout",))
    _unsupported(fn, reverse=reverse)
    state_v_first = _v_first(fn, state_v_first, kwargs)
    return chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens)
