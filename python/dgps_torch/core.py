"""dgps_torch.recurrence: any DGPS recurrence (SPEC §2) on PyTorch tensors, with autograd."""
import torch

from ._ops import Recurrence, _last_contiguous

_AXES = ({"none", "scalar", "diagonal"}, {"unit", "scalar"},
         {"identity", "diag-atk", "diag-atq", "exact-atk", "exact-atq"}, {"online", "offline"})


def model_string(model):
    """A model name ("gdn", "pkda", ...), an axes string "decay,gain,precond,solve" or a 4-tuple of axes."""
    if isinstance(model, (tuple, list)):
        if len(model) != 4:
            raise ValueError(f"dgps: model axes are (decay, gain, precond, solve), got {model!r}")
        for a, allowed in zip(model, _AXES):
            if a not in allowed:
                raise ValueError(f"dgps: axis value {a!r} is not one of {sorted(allowed)}")
        return ",".join(model)
    if not isinstance(model, str):
        raise TypeError(f"dgps: model must be a name or 4 axes, got {type(model).__name__}")
    return model


def _compute_dtypes(q, k, v, gates):
    """(qkv dtype, gate dtype): unchanged when they already agree, else the wider float type (one cast)."""
    present = [t for t in gates if t is not None]
    if q.device.type == "cuda":
        gd = present[0].dtype if present and all(t.dtype == present[0].dtype for t in present) else torch.float32
        return q.dtype, gd
    dtypes = {t.dtype for t in (q, k, v, *present)}
    if len(dtypes) == 1:
        return q.dtype, q.dtype
    wide = torch.float64 if torch.float64 in dtypes else torch.float32
    return wide, wide


def recurrence(model, q, k, v, g=None, beta=None, g_p=None, beta_p=None, center=None, initial_state=None,
               initial_A_state=None, scale=None, output_final_state=False, l2norm_qk=True, x=1.5, eps=1e-6,
               lamb=1.0, cu_seqlens=None, backend="automatic", chunk_size=64):
    """Forward of any DGPS recurrence, differentiable in every tensor input.

    model: a name ("la", "mamba2", "gla", "dn", "gdn", "kda", "pdn", "pgdn", "pkda", "pmamba2", "mesa",
    "ridge"), an axes string "decay,gain,precond,solve" or a 4-tuple of axes. Shapes (SPEC §1): q, k
    [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV] or [B,T,HV,K]; beta [B,T,HV]; g_p, beta_p [B,T,H]; center [H];
    initial_state [N,HV,K,V]; initial_A_state [N,H,K] (diagonal) or [N,H,K,K] (exact); cu_seqlens int64 [N+1]
    with B = 1. dgps's defaults (l2norm_qk=True). Returns (o [B,T,HV,V] in q's dtype, hT, aT); hT and aT are
    None unless output_final_state (aT also None without a preconditioner). Tensors whose last dimension is
    contiguous are passed without copies; mixed dtypes on the CPU are computed in the wider one.
    """
    m = model_string(model)
    out_dtype = q.dtype
    qd, gd = _compute_dtypes(q, k, v, (g, beta, g_p, beta_p, center))
    q, k, v = (t.to(qd) for t in (q, k, v))
    g, beta, g_p, beta_p, center = (None if t is None else t.to(gd) for t in (g, beta, g_p, beta_p, center))
    sd = torch.float64 if qd == torch.float64 else torch.float32
    h0 = None if initial_state is None else initial_state.to(sd)
    a0 = None if initial_A_state is None else initial_A_state.to(sd)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64)
        if q.shape[0] != 1:
            raise ValueError(f"dgps: with cu_seqlens the batch size must be 1 (packed sequences), got {q.shape[0]}")
    ts = [_last_contiguous(t) for t in (q, k, v, g, beta, g_p, beta_p, center, h0, a0)]
    opts = (None if scale is None else float(scale), bool(l2norm_qk), float(x), float(eps), float(lamb),
            bool(output_final_state), str(backend), int(chunk_size))
    o, hT, aT = Recurrence.apply(m, opts, *ts, cu_seqlens)
    if o.dtype != out_dtype:
        o = o.to(out_dtype)
    if not output_final_state:
        return o, None, None
    return o, hT, (aT if aT.numel() > 0 else None)
