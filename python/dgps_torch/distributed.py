"""dgps_torch.distributed: one sequence split over the ranks of a torch.distributed process group (context
parallelism), exact, differentiable, for every chunkwise model (docs/distributed.md).

Rank r holds tokens [t_r, t_{r+1}) of every sequence, in group-rank order. Its segment acts on the state as an
affine map S_out = M_r S_in + B_r; one dgps call with the values widened to [v | 0] from the state [0 | I] gives
[B_r | M_r] as its final state and, in the last K output columns, p_t = M_{<=t}^T q_t, so that the outputs from the
true incoming state are o_t(0) + S_in^T p_t. The diagonal preconditioner's statistics compose the same way
(A_out = exp(sum g_p) A_in + b_r). The ranks all-gather these maps (N * HV * K * (K + V) values each, whatever the
length) and fold them in rank order. Autograd runs through the whole composition, the gather included (its
backward all-reduces the gathered maps' gradients), so `loss.backward()` on every rank gives each rank the
gradients of the sum of all ranks' losses with respect to its own segment's inputs. The backward's collectives
run in the same order on every rank (maps, then statistics): every rank must run backward through its outputs.
"""
import torch
import torch.distributed as dist

from ._ops import precond_kind
from .core import model_string, recurrence as _recurrence


def _check_sizes(sizes, group, device):
    """Every rank's (B, H, HV, K, V) equals this rank's: a mismatch would hang or corrupt the gathers."""
    mine = torch.tensor(sizes, dtype=torch.int64, device="cpu" if dist.get_backend(group) == "gloo" else device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    for j, s in enumerate(every):
        if not torch.equal(s, mine):
            raise ValueError(f"dgps: distributed: rank {j}'s sizes [B, H, HV, K, V] = {s.tolist()} differ from rank "
                             f"{dist.get_rank(group)}'s {list(sizes)}")


def _staged(group, x):
    """Gloo gathers host tensors only: device tensors travel through the host there."""
    return x.device.type != "cpu" and dist.get_backend(group) == "gloo"


class _AllGather(torch.autograd.Function):
    """[R, *x.shape]: every rank's x, in rank order. Backward: the gathered gradient summed over the ranks (each
    rank's loss reads every rank's map), this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        staged = _staged(group, x)
        src = x.detach().contiguous()
        if staged:
            src = src.cpu()
        parts = [torch.empty_like(src) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, src, group=group)
        return torch.stack(parts).to(x.device)

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous()
        staged = _staged(ctx.group, g)
        if staged:
            g = g.cpu()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g[ctx.rank].to(grad.device), None


class _Tie(torch.autograd.Function):
    """`a` unchanged, made to depend on `b` (zero gradient to b): every rank's backward then reaches the gathers in
    the same order (maps, then statistics), exactly once, whatever its loss reads."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.b_shape, ctx.b_dtype, ctx.b_device = b.shape, b.dtype, b.device
        return a.view_as(a)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.zeros(ctx.b_shape, dtype=ctx.b_dtype, device=ctx.b_device)


def _stats_map(k, g_p, beta_p, l2norm_qk):
    """This segment's diagonal statistics map: (G [B, H], b [B, H, K]) with A_out = exp(G) A_in + b (float32 or
    float64), the statistics step of SPEC §2 summed in closed form."""
    kf = k.to(torch.float64 if k.dtype == torch.float64 else torch.float32)
    if l2norm_qk:
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    gp = g_p.to(kf.dtype)
    G = gp.sum(1)  # [B, H]
    after = G.unsqueeze(1) - torch.cumsum(gp, 1)  # sum of g_p over the tokens after t: <= 0 in normal use
    b = torch.einsum("bth,bthk->bhk", torch.exp(after) * beta_p.to(kf.dtype), kf * kf)
    return G, b


def recurrence(model, q, k, v, g=None, beta=None, g_p=None, beta_p=None, center=None, initial_state=None,
               initial_A_state=None, scale=None, output_final_state=False, l2norm_qk=True, x=1.5, eps=1e-6,
               group=None, backend="automatic", chunk_size=64):
    """dgps_torch.recurrence over a sequence split across the ranks of `group` (default: the world group).

    Arguments as dgps_torch.recurrence, for this rank's segment: q, k [B, T_r, H, K], v [B, T_r, HV, V], gates
    [B, T_r, ...] (T_r may differ between ranks; rank 0 holds the first tokens). `initial_state`,
    `initial_A_state` are read on rank 0 only. Returns (o [B, T_r, HV, V], hT, aT): this rank's outputs and, with
    output_final_state, the sequences' final states after the last rank (on every rank). Differentiable: on every
    rank, backward gives the gradients of the sum of all ranks' losses with respect to this rank's inputs (and
    initial states on rank 0). Every rank must call it with the same model and sizes B, H, HV, K, V; chunkwise
    models only (not the exact preconditioners), no cu_seqlens. A group of one rank is the plain call.
    """
    m = model_string(model)
    pk = precond_kind(m)
    if pk == "exact":
        raise ValueError("dgps: distributed: the exact preconditioners have no distributed algorithm")
    group = group if group is not None else dist.group.WORLD
    R, r = dist.get_world_size(group), dist.get_rank(group)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    sd = torch.float64 if q.dtype == torch.float64 else torch.float32
    _check_sizes((B, H, HV, K, V), group, q.device)
    kw = dict(scale=scale, l2norm_qk=l2norm_qk, x=x, eps=eps, backend=backend, chunk_size=chunk_size)

    # 1. Statistics entering this segment (diagonal preconditioners): fold of the ranks' (G, b) before r.
    a_in = None
    if pk == "diag":
        G, b = _stats_map(k, g_p, beta_p, l2norm_qk)
        if r == 0:
            a0 = initial_A_state.to(sd) if initial_A_state is not None else torch.zeros_like(b, dtype=sd)
            b = torch.exp(G).unsqueeze(-1).to(sd) * a0 + b.to(sd)
            G = torch.zeros_like(G)
        msg = torch.cat([G.to(sd).unsqueeze(-1), b.to(sd)], -1)  # [B, H, 1 + K]
        allm = _AllGather.apply(msg, group)
        a_in = torch.zeros((B, H, K), dtype=sd, device=q.device)
        folds = []
        for j in range(R):
            a_in = torch.exp(allm[j, ..., 0]).unsqueeze(-1) * a_in + allm[j, ..., 1:]
            folds.append(a_in)
        a_in_r = folds[r - 1] if r > 0 else initial_A_state
        a_final = folds[-1]

    # 2. This rank's map: rank 0 from the caller's h0 (a constant map), the others from [0 | I] with [v | 0].
    if r == 0:
        o, hT0, _ = _recurrence(m, q, k, v, g, beta, g_p, beta_p, center, initial_state,
                                initial_A_state if pk == "diag" else None, output_final_state=True, **kw)
        msg = torch.cat([hT0.to(sd), torch.zeros((B, HV, K, K), dtype=sd, device=q.device)], -1)
        if pk == "diag":
            msg = _Tie.apply(msg, allm)
    else:
        v_aug = torch.cat([v, v.new_zeros((B, T, HV, K))], -1)
        h0_aug = torch.cat([torch.zeros((B, HV, K, V), dtype=sd, device=q.device),
                            torch.eye(K, dtype=sd, device=q.device).expand(B, HV, K, K)], -1)
        o_aug, msg, _ = _recurrence(m, q, k, v_aug, g, beta, g_p, beta_p, center, h0_aug, a_in_r if pk else None,
                                    output_final_state=True, **kw)
        msg = msg.to(sd)
    maps = _AllGather.apply(msg, group)  # [R, B, HV, K, V + K]

    # 3. The state entering this segment, the outputs, the final states.
    s = None
    states = []
    for j in range(R):
        s = maps[j, ..., :V] if s is None else maps[j, ..., :V] + maps[j, ..., V:] @ s
        states.append(s)
    if r > 0:
        s_in = states[r - 1]
        p = o_aug[..., V:].to(sd)
        o = (o_aug[..., :V].to(sd) + torch.einsum("bthk,bhkv->bthv", p, s_in)).to(q.dtype)
    o = _Tie.apply(o, maps)
    if not output_final_state:
        return o, None, None
    return o, states[-1], (a_final if pk == "diag" else None)
