"""A float64 torch recurrence of SPEC §2, token by token (independent of dgps; differentiable by autograd)."""
import math

import torch


def l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent(q, k, v, g=None, beta=None, g_p=None, beta_p=None, center=None, h0=None, a0=None, scale=None,
              l2norm=False, x=1.5, eps=1e-6, online=True, cu_seqlens=None):
    """Returns (o, hT [N,HV,K,V], aT [N,H,K] or None). g: None, [B,T,HV] or [B,T,HV,K]; g_p/beta_p: ATK precond."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    r = HV // H
    scale = K ** -0.5 if scale is None else scale
    if l2norm:
        q, k = l2n(q), l2n(k)
    if cu_seqlens is None:
        segs = [(b, 0, T) for b in range(B)]
    else:
        cs = cu_seqlens.tolist()
        segs = [(0, cs[i], cs[i + 1]) for i in range(len(cs) - 1)]
    outs = [[None] * T for _ in range(B)]
    hTs, aTs = [], []
    for n, (b, s0, s1) in enumerate(segs):
        S = [h0[n, hv] if h0 is not None else q.new_zeros(K, V) for hv in range(HV)]
        A = [a0[n, h] if a0 is not None else q.new_zeros(K) for h in range(H)] if g_p is not None else None
        for t in range(s0, s1):
            kw = []
            for h in range(H):
                kt = k[b, t, h]
                if g_p is not None:
                    A[h] = torch.exp(g_p[b, t, h]) * A[h] + beta_p[b, t, h] * kt * kt
                    c = center[h] if center is not None else -0.2
                    rr = torch.log(A[h] + eps) - c
                    s = rr / (1 + rr.abs())
                    kw.append(kt * torch.exp(-math.log(x) * s))
                else:
                    kw.append(kt)
            row = []
            for hv in range(HV):
                h = hv // r
                Sb = S[hv]
                if g is not None:
                    d = torch.exp(g[b, t, hv])
                    Sb = Sb * (d.unsqueeze(-1) if d.dim() == 1 else d)
                bt = beta[b, t, hv] if beta is not None else 1.0
                if online:
                    u = bt * (v[b, t, hv] - Sb.t() @ k[b, t, h])
                    S[hv] = Sb + torch.outer(kw[h], u)
                else:
                    S[hv] = Sb + bt * torch.outer(kw[h], v[b, t, hv])
                row.append(S[hv].t() @ (scale * q[b, t, h]))
            outs[b][t] = torch.stack(row)
        hTs.append(torch.stack(S))
        if A is not None:
            aTs.append(torch.stack(A))
    o = torch.stack([torch.stack(outs[b][:]) if all(x is not None for x in outs[b]) else None for b in range(B)])
    return o, torch.stack(hTs), (torch.stack(aTs) if aTs else None)
