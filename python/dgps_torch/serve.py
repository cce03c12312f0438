"""Serving through a state pool (dgps::decode with dgps::DecodeState): continuous batching and speculative
verification on the CPU, forward only. The FLA-named functions (fla.py) map vLLM's `ssm_state_indices` /
`num_accepted_tokens` and SGLang's `initial_state_indices` onto `pool_recurrence`."""
import torch

from .core import _compute_dtypes, model_string
from ._ops import _last_contiguous


def _index(name, t, dtype=torch.int64):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.device.type != "cpu":
        raise NotImplementedError(f"dgps: {name} on {t.device.type} tensors: the state pool is CPU-only for now")
    return t.to(dtype).contiguous()


def pool_recurrence(model, q, k, v, state_pool, g=None, beta=None, g_p=None, beta_p=None, center=None,
                    precond_pool=None, *, slots=None, out_slots=None, has_initial=None, token_slots=None,
                    num_accepted=None, cu_seqlens=None, scale=None, l2norm_qk=True, x=1.5, eps=1e-6, lamb=1.0,
                    backend="automatic", algorithm="automatic"):
    """Runs model `model` over new tokens of a batch of sequences whose states live in a pool; returns o.

    `state_pool` [P, HV, K, V] (float32, or float64 for float64 inputs; contiguous in V, or in K: the transposed
    view of a K-last pool [P, HV, V, K], `pool.transpose(-1, -2)`, which is used as it is) and, for the
    preconditioned models,
    `precond_pool` [P, H, K] / [P, H, K, K] are updated in place. q, k [B, T, H, K] (or packed with
    `cu_seqlens` [N+1], B = 1), v [B, T, HV, V], gates as in `recurrence`. Indices (any integer dtype):
    - `slots` [N]: sequence n starts from state slots[n] and writes its final state back there (or to
      `out_slots[n]`); negative: padding (pool untouched, outputs zero); >= P: error.
    - `has_initial` [N] (bool): False starts sequence n from zero states.
    - `token_slots` [N, D] with `num_accepted` [N] (speculative verification): start from
      token_slots[n, num_accepted[n] - 1], the state after token t goes to token_slots[n, t].
    `algorithm`: "automatic" (chunkwise for sequences longer than 16 tokens), "recurrent" or "chunkwise".
    Not differentiable. Errors (bad shapes or indices) raise ValueError before anything is written.
    """
    if q.device.type != "cpu":
        raise NotImplementedError("dgps: decode through a state pool (slots / ssm_state_indices / "
                                  "initial_state_indices) runs on the CPU only; the CUDA backend lacks it")
    m = model_string(model)
    out_dtype = q.dtype
    qd, gd = _compute_dtypes(q, k, v, (g, beta, g_p, beta_p, center))
    sd = torch.float64 if qd == torch.float64 else torch.float32
    for name, pool, k_last_ok in (("state pool", state_pool, True), ("preconditioner pool", precond_pool, False)):
        contiguous = pool is not None and (pool.stride(-1) == 1 or (k_last_ok and pool.dim() == 4
                                                                   and pool.stride(-2) == 1))
        if pool is not None and (pool.dtype != sd or pool.device.type != "cpu" or not contiguous):
            what = "in its last dimension (or, K-last, in K)" if k_last_ok else "in its last dimension"
            raise ValueError(f"dgps: the {name} must be a CPU {sd} tensor contiguous {what} (it is updated in place), "
                             f"got {pool.dtype} on {pool.device.type} with strides {pool.stride()}")
    q, k, v = (_last_contiguous(t.to(qd)) for t in (q, k, v))
    g, beta, g_p, beta_p, center = (None if t is None else _last_contiguous(t.to(gd))
                                    for t in (g, beta, g_p, beta_p, center))
    if cu_seqlens is not None:
        cu_seqlens = _index("cu_seqlens", cu_seqlens)
    with torch.no_grad():
        o = torch.ops.dgps.decode(m, q, k, v, g, beta, g_p, beta_p, center, state_pool, precond_pool, cu_seqlens,
                                  _index("slots", slots), _index("out_slots", out_slots),
                                  _index("has_initial", has_initial, torch.uint8), _index("token_slots", token_slots),
                                  _index("num_accepted", num_accepted), None if scale is None else float(scale),
                                  bool(l2norm_qk), float(x), float(eps), float(lamb), str(backend), str(algorithm), 64)
    return o if o.dtype == out_dtype else o.to(out_dtype)


def vllm_indices(fn, q, initial_state, ssm_state_indices, num_accepted_tokens, inplace_final_state):
    """Maps vLLM's (ssm_state_indices, num_accepted_tokens, inplace_final_state) onto pool_recurrence's
    arguments: returns (pool, kwargs). [N] indices: sequence n starts from initial_state[idx[n]], its final state
    replaces that slot (inplace) or row n of a new [N, HV, K, V] tensor; [N, D]: the state after token t goes to
    initial_state[idx[n, t]], the start is idx[n, num_accepted_tokens[n] - 1] (idx[n, 0] without them)."""
    if initial_state is None:
        raise ValueError(f"dgps_torch.{fn}: ssm_state_indices needs initial_state (the state pool [P, HV, K, V])")
    idx = _index("ssm_state_indices", ssm_state_indices)
    if idx.dim() == 1:
        if num_accepted_tokens is not None:
            raise ValueError(f"dgps_torch.{fn}: num_accepted_tokens needs 2-D ssm_state_indices [N, D]")
        if inplace_final_state:
            return initial_state, {"slots": idx}
        P = initial_state.shape[0]
        bad = (idx >= P).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"dgps_torch.{fn}: ssm_state_indices[{i}] = {int(idx[i])} is outside the state pool "
                             f"[0, {P})")
        pool = initial_state[idx.clamp(min=0)].clone()
        rows = torch.arange(idx.shape[0], dtype=torch.int64)
        return pool, {"slots": torch.where(idx < 0, idx, rows)}
    if idx.dim() != 2:
        raise ValueError(f"dgps_torch.{fn}: ssm_state_indices must be [N] or [N, D], got shape {tuple(idx.shape)}")
    if not inplace_final_state:
        raise NotImplementedError(f"dgps_torch.{fn}: inplace_final_state=False with [N, D] ssm_state_indices "
                                  "(per-token states in a new tensor) is not supported; keep the pool in place")
    acc = num_accepted_tokens if num_accepted_tokens is not None else torch.ones(idx.shape[0], dtype=torch.int64)
    return initial_state, {"token_slots": idx, "num_accepted": _index("num_accepted_tokens", acc)}
