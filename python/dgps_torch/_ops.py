"""Loading of the operator library, fake (meta) implementations and the autograd function over torch.ops.dgps."""
import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load():
    libs = sorted(glob.glob(os.path.join(_HERE, "_C*.so")))
    if not libs:
        raise ImportError("dgps_torch: the operator library _C*.so is missing; install with "
                          "`pip install --no-build-isolation ./python` (docs/python.md)")
    torch.ops.load_library(libs[0])


_load()

# Preconditioner of the named models, for output shapes: None, "diag" ([N, H, K]) or "exact" ([N, H, K, K]).
_PRECOND = {"la": None, "mamba2": None, "gla": None, "dn": None, "gdn": None, "kda": None, "pdn": "diag",
            "pgdn": "diag", "pkda": "diag", "pmamba2": "diag", "mesa": "exact", "ridge": "exact"}


def precond_kind(model):
    """None, "diag" or "exact" for a model name or a "decay,gain,precond,solve" string."""
    if "," in model:
        p = model.split(",")[2] if len(model.split(",")) == 4 else "identity"
        return None if p == "identity" else ("exact" if p.startswith("exact") else "diag")
    return _PRECOND.get(model)


def _state_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _fake_forward(model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, scale, l2norm, x, eps, lamb,
                  output_final_state, save, backend, chunk_size):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    sd = _state_dtype(q)
    o = q.new_empty((B, T, HV, V))
    hT = q.new_empty((N, HV, K, V) if output_final_state else (0,), dtype=sd)
    p = precond_kind(model)
    a_shape = (0,) if not output_final_state or p is None else ((N, H, K) if p == "diag" else (N, H, K, K))
    aT = q.new_empty(a_shape, dtype=sd)
    handle = torch.empty((), dtype=torch.int64, device="cpu")  # the ops return the handle on the host
    return o, hT, aT, handle


def _fake_backward(model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, scale, l2norm, x, eps, lamb,
                   backend, chunk_size, d_o, dhT, daT, handle):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if t is not None else q.new_empty((0,))
            for t in (q, k, v, g, beta, g_p, beta_p, center, h0, a0)]


def _fake_decode(model, q, k, v, g, beta, g_p, beta_p, center, h, a, cu_seqlens, slots, out_slots, has_initial,
                 token_slots, num_accepted, scale, l2norm, x, eps, lamb, backend, algorithm, chunk_size):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))


if hasattr(torch.library, "register_fake"):
    torch.library.register_fake("dgps::decode")(_fake_decode)
    torch.library.register_fake("dgps::forward")(_fake_forward)
    torch.library.register_fake("dgps::backward")(_fake_backward)
elif hasattr(torch.library, "impl_abstract"):
    torch.library.impl_abstract("dgps::decode")(_fake_decode)
    torch.library.impl_abstract("dgps::forward")(_fake_forward)
    torch.library.impl_abstract("dgps::backward")(_fake_backward)


def _compiling():
    c = getattr(torch, "compiler", None)
    return bool(c is not None and hasattr(c, "is_compiling") and c.is_compiling())


def _last_contiguous(t):
    """`t` itself when its last dimension is contiguous (what dgps's views need), else a contiguous copy."""
    if t is None or t.dim() == 0 or t.stride(-1) == 1 or t.size(-1) == 1:
        return t
    return t.contiguous()


class _CacheHandle:
    """Releases a CPU training cache that no backward consumed (the graph was freed without a backward)."""

    def __init__(self, handle):
        self.handle = handle

    def __del__(self):
        try:
            torch.ops.dgps.release_cache(self.handle)
        except Exception:  # interpreter shutdown: the library may be gone
            pass


class Recurrence(torch.autograd.Function):
    """Autograd over torch.ops.dgps.forward / backward (gradients of every tensor input)."""

    @staticmethod
    def forward(ctx, model, opts, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens):
        scale, l2norm, x, eps, lamb, output_final_state, backend, chunk_size = opts
        save = any(ctx.needs_input_grad[2:]) and not _compiling()
        o, hT, aT, handle = torch.ops.dgps.forward(model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens,
                                                   scale, l2norm, x, eps, lamb, output_final_state, save, backend,
                                                   chunk_size)
        ctx.model, ctx.opts = model, opts
        ctx.save_for_backward(q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, handle)
        if save and q.device.type == "cpu":
            ctx.cache = _CacheHandle(handle)
        ctx.set_materialize_grads(False)
        return o, hT, aT

    @staticmethod
    def backward(ctx, d_o, dhT, daT):
        scale, l2norm, x, eps, lamb, output_final_state, backend, chunk_size = ctx.opts
        q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, handle = ctx.saved_tensors
        if d_o is None:
            d_o = torch.zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
        dhT = _last_contiguous(dhT) if dhT is not None and dhT.numel() > 0 else None
        daT = _last_contiguous(daT) if daT is not None and daT.numel() > 0 else None
        grads = torch.ops.dgps.backward(ctx.model, q, k, v, g, beta, g_p, beta_p, center, h0, a0, cu_seqlens, scale,
                                        l2norm, x, eps, lamb, backend, chunk_size, _last_contiguous(d_o), dhT, daT,
                                        handle)
        inputs = (q, k, v, g, beta, g_p, beta_p, center, h0, a0)
        out = [gr if t is not None and need else None
               for gr, t, need in zip(grads, inputs, ctx.needs_input_grad[2:12])]
        return (None, None, *out, None)
