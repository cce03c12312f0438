"""The sequence mixer's recurrence for each `--kernel`: dgps (dgps_torch), fla (fla.ops) or torch (written here).

Every kernel takes un-normalised q, k [B,T,H,K], v [B,T,H,V], beta [B,T,H] in (0,1), the log decay g [B,T,H]
(gated models), the preconditioner's log decay g_atk and gain beta_atk [B,T,H] and center [H] (preconditioned
models); q and k are L2-normalised inside and q is scaled by 1/sqrt(K), as in FLA's layers.
"""
import math

import torch

MODELS = ("dn", "pdn", "gdn", "pgdn")
SQUASH_X, SQUASH_EPS = 1.5, 1e-6


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def torch_recurrence(model, q, k, v, beta, g=None, g_atk=None, beta_atk=None, center=None):
    """Token-by-token recurrence in float32 (SPEC §2): the reference the other kernels are checked against."""
    out_dtype = q.dtype
    B, T, H, K = q.shape
    q = _l2norm(q.float()) * (1.0 / math.sqrt(K))
    k = _l2norm(k.float())
    v, beta = v.float(), beta.float()
    S = q.new_zeros(B, H, K, v.shape[-1])
    A = q.new_zeros(B, H, K)
    log_x = math.log(SQUASH_X)
    # unbind once: indexing t per step would make every backward step write a full-size zero gradient
    qs, ks, vs, bs = q.unbind(1), k.unbind(1), v.unbind(1), beta.unbind(1)
    gs = g.float().exp().unbind(1) if model in ("gdn", "pgdn") else None
    if model in ("pdn", "pgdn"):
        ags, bas = g_atk.float().exp().unbind(1), beta_atk.float().unbind(1)
        c = center.float()[None, :, None]
    outs = []
    for t in range(T):
        kt = ks[t]
        if gs is not None:
            S = S * gs[t][..., None, None]
        kw = kt
        if model in ("pdn", "pgdn"):
            A = A * ags[t][..., None] + bas[t][..., None] * kt * kt
            r = torch.log(A + SQUASH_EPS) - c
            kw = kt * torch.exp(-log_x * (r / (1 + r.abs())))
        resid = vs[t] - (S * kt[..., :, None]).sum(-2)
        S = S + (bs[t][..., None] * kw)[..., :, None] * resid[..., None, :]
        outs.append((S * qs[t][..., :, None]).sum(-2))
    return torch.stack(outs, 1).to(out_dtype)


def _dgps():
    import dgps_torch as D

    pdn_compiled = "pdn" in [m.strip() for m in str(D.compiled_models()).split(",")]

    def run(model, q, k, v, beta, g=None, g_atk=None, beta_atk=None, center=None):
        if model == "dn":
            return D.chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)[0]
        if model == "gdn":
            return D.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        if model == "pgdn":
            return D.chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, use_qk_l2norm_in_kernel=True,
                                                    x=SQUASH_X, eps=SQUASH_EPS, log_atk_scale=center)[0]
        if q.is_cuda or pdn_compiled:  # no FLA name for PDN: the general entry
            return D.recurrence("pdn", q, k, v, beta=beta, g_p=g_atk, beta_p=beta_atk, center=center,
                                l2norm_qk=True, x=SQUASH_X, eps=SQUASH_EPS)[0]
        # Host builds without dgps::dynamic lack PDN; PGDN with a zero log decay is the same recurrence.
        zero = torch.zeros_like(beta, dtype=torch.float32)
        return D.chunk_precond_gated_delta_rule(q, k, v, g_atk, zero, beta_atk, beta, use_qk_l2norm_in_kernel=True,
                                                x=SQUASH_X, eps=SQUASH_EPS, log_atk_scale=center)[0]

    return run


def _fla(hopper_gated_backward=False):
    """FLA's functions. On Hopper with Triton >= 3.4, < 3.7.1 FLA refuses its gated backward (that Triton
    miscompiles it into wrong gradients, FLA issue #640); `hopper_gated_backward` runs it anyway, to measure
    its time and to see what training on it does, never as a reference."""
    if hopper_gated_backward:
        import importlib
        importlib.import_module("fla.ops.common.chunk_o").TRITON_ABOVE_3_7_1 = True
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    try:
        from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule
    except ImportError:
        chunk_precond_gated_delta_rule = None

    def run(model, q, k, v, beta, g=None, g_atk=None, beta_atk=None, center=None):
        if model == "dn":
            return chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)[0]
        if model == "gdn":
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        if chunk_precond_gated_delta_rule is None:
            raise RuntimeError("mqar: this FLA has no fla.ops.precond_gated_delta_rule (PDN/PGDN)")
        if model == "pdn":  # FLA has no PDN op: PGDN with a zero log decay
            g = torch.zeros_like(beta, dtype=torch.float32)
        return chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, use_qk_l2norm_in_kernel=True,
                                              x=SQUASH_X, eps=SQUASH_EPS, log_atk_scale=center)[0]

    return run


def get_kernel(name, fla_hopper_gated_backward=False):
    """The mixer function for `--kernel name`: f(model, q, k, v, beta, g, g_atk, beta_atk, center) -> o."""
    if name == "dgps":
        return _dgps()
    if name == "fla":
        try:
            return _fla(fla_hopper_gated_backward)
        except ImportError as e:
            raise SystemExit(f"mqar: --kernel fla needs flash-linear-attention installed beside ({e})")
    if name == "torch":
        return torch_recurrence
    raise ValueError(f"mqar: unknown kernel {name!r} (dgps, fla, torch)")
