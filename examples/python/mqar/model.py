"""The MQAR model: embedding, (mixer, MLP) x 2 with pre-norm residuals, final norm, tied output head.

The mixer follows FLA's DeltaNet / GatedDeltaNet / PrecondGatedDeltaNet layers: q/k/v projections, causal
depthwise short convolutions with SiLU, beta = sigmoid(b_proj x), for gated models
g = -exp(A_log) softplus(a_proj x + dt_bias), for preconditioned models the same pair of projections for the
preconditioner's own decay and gain plus a learnable per-head center, a gated RMS output norm and o_proj.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (torch 1.13 has no nn.RMSNorm)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


class ShortConv(nn.Module):
    """Causal depthwise convolution over time followed by SiLU (FLA's ShortConvolution, no bias)."""

    def __init__(self, dim, kernel=4):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x):  # [B, T, D]
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.kernel - 1, 0)), self.weight.to(x.dtype), groups=x.shape[-1])
        return F.silu(y).transpose(1, 2)


def _dt_bias(n, gen):
    """Inverse softplus of dt ~ log-uniform(1e-3, 1e-1) (Mamba-2 / FLA gate init)."""
    dt = torch.exp(torch.rand(n, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt = dt.clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class DeltaMixer(nn.Module):
    """One sequence-mixer layer of model dn, pdn, gdn or pgdn, running its recurrence through `kernel`."""

    def __init__(self, model, d_model, heads, kernel, expand_v=1.0, conv=4, center_init=-0.2, gen=None):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"mqar: d_model {d_model} is not a multiple of heads {heads}")
        self.model, self.kernel, self.heads = model, kernel, heads
        self.dk = d_model // heads
        self.dv = int(self.dk * expand_v)
        key_dim, value_dim = heads * self.dk, heads * self.dv
        self.q_proj = nn.Linear(d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        self.q_conv, self.k_conv, self.v_conv = ShortConv(key_dim, conv), ShortConv(key_dim, conv), ShortConv(
            value_dim, conv)
        self.b_proj = nn.Linear(d_model, heads, bias=False)
        self.gated = model in ("gdn", "pgdn")
        self.precond = model in ("pdn", "pgdn")
        if self.gated:
            self.a_proj = nn.Linear(d_model, heads, bias=False)
            self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16, generator=gen)))
            self.dt_bias = nn.Parameter(_dt_bias(heads, gen))
        if self.precond:
            self.a_atk_proj = nn.Linear(d_model, heads, bias=False)
            self.b_atk_proj = nn.Linear(d_model, heads, bias=False)
            self.A_log_atk = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16, generator=gen)))
            self.dt_bias_atk = nn.Parameter(_dt_bias(heads, gen))
            self.log_atk_scale = nn.Parameter(torch.full((heads,), center_init))
        self.g_proj = nn.Linear(d_model, value_dim, bias=False)
        self.o_norm = RMSNorm(self.dv)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)
        self.last_shapes = None  # input shapes of the latest recurrence call (for isolated kernel timing)

    @staticmethod
    def _gate(a, A_log, dt_bias):
        return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())

    def forward(self, x):
        B, T, _ = x.shape
        H = self.heads
        q = self.q_conv(self.q_proj(x)).reshape(B, T, H, self.dk)
        k = self.k_conv(self.k_proj(x)).reshape(B, T, H, self.dk)
        v = self.v_conv(self.v_proj(x)).reshape(B, T, H, self.dv)
        beta = self.b_proj(x).sigmoid()
        g = self._gate(self.a_proj(x), self.A_log, self.dt_bias) if self.gated else None
        g_atk = beta_atk = center = None
        if self.precond:
            g_atk = self._gate(self.a_atk_proj(x), self.A_log_atk, self.dt_bias_atk)
            beta_atk = self.b_atk_proj(x).sigmoid()
            center = self.log_atk_scale
        self.last_shapes = (q.shape, v.shape, q.dtype)
        o = self.kernel(self.model, q, k, v, beta, g=g, g_atk=g_atk, beta_atk=beta_atk, center=center)
        gate = self.g_proj(x).reshape(B, T, H, self.dv)
        o = self.o_norm(o) * F.silu(gate.float()).to(o.dtype)
        return self.o_proj(o.reshape(B, T, H * self.dv))


class GatedMLP(nn.Module):
    """SwiGLU channel mixer (FLA's GatedMLP)."""

    def __init__(self, d_model, expand=2):
        super().__init__()
        hidden = int(d_model * expand)
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MQARModel(nn.Module):
    """Token embedding, `layers` x (pre-norm mixer, pre-norm MLP), final norm, output head tied to the embedding."""

    def __init__(self, model, vocab, d_model, heads, kernel, layers=2, mlp_expand=2, expand_v=1.0, seed=0,
                 embed_std=0.02):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # nn.Linear's default init draws from the global generator
        self.embed = nn.Embedding(vocab, d_model)
        nn.init.normal_(self.embed.weight, std=embed_std)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleList([RMSNorm(d_model), DeltaMixer(model, d_model, heads, kernel, expand_v,
                                                                           gen=gen),
                                              RMSNorm(d_model), GatedMLP(d_model, mlp_expand)]))
        self.norm = RMSNorm(d_model)

    def mixers(self):
        return [b[1] for b in self.blocks]

    def hidden(self, tokens):
        x = self.embed(tokens)
        for norm1, mixer, norm2, mlp in self.blocks:
            x = x + mixer(norm1(x))
            x = x + mlp(norm2(x))
        return self.norm(x)

    def forward(self, tokens, targets, ignore):
        """(logits at the query positions [Q, vocab], their targets [Q]): the head runs on queries only."""
        h = self.hidden(tokens)
        mask = targets != ignore
        hq = h[mask]
        return hq @ self.embed.weight.to(hq.dtype).t(), targets[mask]
