"""dgps_torch.recurrence: any DGPS recurrence (SPEC §2) on PyTorch tensors, with autograd."""
import warnings

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


# dgps::cuda takes key_dim <= 128 (cuda/api.cu).
CUDA_MAX_KEY_DIM = 128
# The named models without a preconditioner or a delta-rule (online) solve.
_KEY_SEPARABLE = {"la", "mamba2", "gla"}


def key_separable(model):
    """True when the state's key rows evolve independently (no preconditioner, no delta-rule solve: la, mamba2,
    gla, simple GLA): o = sum over key blocks of each block's output, so any key_dim splits into blocks."""
    m = model_string(model)
    if "," not in m:
        return m in _KEY_SEPARABLE
    axes = m.split(",")
    return len(axes) == 4 and axes[2] == "identity" and axes[3] == "offline"


def cuda_route(model, key_dim, backend="automatic"):
    """How a CUDA call runs: "direct" (dgps::cuda), "split" (key blocks of <= CUDA_MAX_KEY_DIM columns, each on
    dgps::cuda, outputs summed; key-separable models) or "host" (the CPU backend, tensors copied there and back:
    the delta-rule models past CUDA_MAX_KEY_DIM). An explicit backend="cuda" always runs "direct" (and raises
    past the limit)."""
    if key_dim <= CUDA_MAX_KEY_DIM or backend != "automatic":
        return "direct"
    return "split" if key_separable(model) else "host"


def _l2norm(x):
    """SPEC §1's x / sqrt(sum(x^2) + 1e-6) per head, in float32 (float64 for float64), back in x's dtype."""
    w = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return (w * torch.rsqrt((w * w).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def split_keys(model, block, q, k, v, g=None, beta=None, initial_state=None, scale=None, output_final_state=False,
               l2norm_qk=True, cu_seqlens=None, backend="automatic", chunk_size=64, **unused):
    """A key-separable model (key_separable) as calls on key blocks of at most `block` columns: q and k
    normalised over the whole key_dim first, the scale of the whole key_dim, per-channel gates and the initial
    state sliced with the block, outputs summed (in float32) and final states concatenated. Same results as
    one call, up to the outputs' rounding; differentiable like it."""
    m = model_string(model)
    if not key_separable(m):
        raise ValueError(f"dgps: split_keys needs a key-separable model (la, mamba2, gla, ...), got {m!r}")
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    if l2norm_qk:
        q, k = _l2norm(q), _l2norm(k)
    per_channel = g is not None and g.dim() == 4
    o_sum, states = None, []
    for c0 in range(0, K, block):
        sl = slice(c0, min(K, c0 + block))
        o, hT, _ = _recurrence(m, q[..., sl], k[..., sl], v, g=g[..., sl] if per_channel else g, beta=beta,
                               initial_state=None if initial_state is None else initial_state[:, :, sl],
                               scale=scale, output_final_state=output_final_state, l2norm_qk=False,
                               cu_seqlens=cu_seqlens, backend=backend, chunk_size=chunk_size)
        o = o.to(torch.float64 if o.dtype == torch.float64 else torch.float32)
        o_sum = o if o_sum is None else o_sum + o
        states.append(hT)
    o = o_sum.to(q.dtype)
    return o, (torch.cat(states, dim=2) if output_final_state else None), None


def _on_host(model, args):
    """The call on the CPU backend (dgps's CPU kernels take any key_dim), tensors copied there and back."""
    dev = args["q"].device
    warnings.warn(f"dgps: dgps::cuda takes key_dim <= {CUDA_MAX_KEY_DIM}; {model_string(model)} with key_dim "
                  f"{args['q'].shape[-1]} runs on the CPU backend (tensors copied to the host and back)", stacklevel=3)
    host = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    out = _recurrence(model, **host)
    return tuple(None if t is None else t.to(dev) for t in out)


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
    contiguous are passed without copies; mixed dtypes on the CPU are computed in the wider one. On CUDA past
    key_dim 128 (what dgps::cuda takes), key-separable models run as key blocks on the GPU and the others on
    the CPU backend, with a warning (cuda_route); backend="cuda" raises there instead.
    """
    args = dict(q=q, k=k, v=v, g=g, beta=beta, g_p=g_p, beta_p=beta_p, center=center, initial_state=initial_state,
                initial_A_state=initial_A_state, scale=scale, output_final_state=output_final_state,
                l2norm_qk=l2norm_qk, x=x, eps=eps, lamb=lamb, cu_seqlens=cu_seqlens, backend=backend,
                chunk_size=chunk_size)
    route = cuda_route(model, q.shape[-1], backend) if q.device.type == "cuda" else "direct"
    if route == "split":
        return split_keys(model, CUDA_MAX_KEY_DIM, **args)
    if route == "host":
        return _on_host(model, args)
    return _recurrence(model, **args)


def _recurrence(model, q, k, v, g=None, beta=None, g_p=None, beta_p=None, center=None, initial_state=None,
                initial_A_state=None, scale=None, output_final_state=False, l2norm_qk=True, x=1.5, eps=1e-6,
                lamb=1.0, cu_seqlens=None, backend="automatic", chunk_size=64):
    """One operator call (recurrence's arguments)."""
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
