"""dgps_torch's FLA-named functions against a float64 torch recurrence: outputs, states and every gradient."""
import pytest
import torch
import torch.nn.functional as F

import dgps_torch as dt
from reference import recurrent

torch.manual_seed(0)


def make(B=2, T=37, H=2, HV=None, K=16, V=8, decay="scalar", precond=False, h0=False, a0=False, cu=None,
         dtype=torch.float64):
    HV = HV or H
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(1234 + T * 7 + K + HV)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    d = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), beta=torch.rand(B, T, HV, generator=gen,
                                                                                 dtype=torch.float64))
    if decay == "scalar":
        d["g"] = F.logsigmoid(r(B, T, HV))
    elif decay == "diagonal":
        d["g"] = F.logsigmoid(r(B, T, HV, K)) * 0.5
    if precond:
        d["g_p"] = F.logsigmoid(r(B, T, H))
        d["beta_p"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
        d["center"] = torch.rand(H, generator=gen, dtype=torch.float64) - 1
    if h0:
        d["h0"] = r(N, HV, K, V) * 0.3
    if a0:
        d["a0"] = torch.rand(N, H, K, generator=gen, dtype=torch.float64)
    return {k_: t.to(dtype) for k_, t in d.items()}


def close(a, b, tol, what=""):
    a, b = a.double(), b.double()
    err = (a - b).norm() / max(b.norm().item(), 1e-12)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def grads(out, inputs):
    loss = sum((o * w).sum() for o, w in out)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


CASES = [dict(), dict(HV=4), dict(h0=True), dict(B=1, T=50, cu=[0, 7, 30, 50], h0=True), dict(T=70, K=20, V=12)]


def _run_fla(name, d, l2=False, out_final=True, cu=None):
    cu_t = None if cu is None else torch.tensor(cu)
    h0 = d.get("h0")
    if name == "gdn":
        return dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=h0,
                                         output_final_state=out_final, use_qk_l2norm_in_kernel=l2,
                                         cu_seqlens=cu_t) + (None,)
    if name == "gdn_fused":
        return dt.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], beta=d["beta"], initial_state=h0,
                                                   output_final_state=out_final, use_qk_l2norm_in_kernel=l2,
                                                   cu_seqlens=cu_t) + (None,)
    if name == "kda":
        return dt.chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=h0, output_final_state=out_final,
                            use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_t) + (None,)
    if name == "kda_fused":
        return dt.fused_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=h0,
                                      output_final_state=out_final, use_qk_l2norm_in_kernel=l2,
                                      cu_seqlens=cu_t) + (None,)
    if name == "dn":
        return dt.chunk_delta_rule(d["q"], d["k"], d["v"], d["beta"], initial_state=h0, output_final_state=out_final,
                                   use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_t) + (None,)
    if name == "gla":
        return dt.chunk_gla(d["q"], d["k"], d["v"], d["g"], initial_state=h0, output_final_state=out_final,
                            cu_seqlens=cu_t) + (None,)
    if name == "simple_gla":
        return dt.chunk_simple_gla(d["q"], d["k"], d["v"], d["g"], initial_state=h0, output_final_state=out_final,
                                   cu_seqlens=cu_t) + (None,)
    if name == "pgdn":
        return dt.chunk_precond_gated_delta_rule(d["q"], d["k"], d["v"], d["g_p"], d["g"], d["beta_p"], d["beta"],
                                                 initial_state=h0, initial_A_state=d.get("a0"),
                                                 output_final_state=out_final, cu_seqlens=cu_t,
                                                 log_atk_scale=d["center"])
    if name == "pgdn_fused":
        return dt.fused_recurrent_precond_gated_delta_rule(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"],
                                                           g_atk=d["g_p"], beta_atk=d["beta_p"], initial_state=h0,
                                                           initial_A_state=d.get("a0"), output_final_state=out_final,
                                                           cu_seqlens=cu_t, log_atk_scale=d["center"])
    if name == "pkda":
        return dt.chunk_precond_kda(d["q"], d["k"], d["v"], d["g"], d["g_p"], d["beta_p"], d["beta"],
                                    initial_state=h0, initial_A_state=d.get("a0"), output_final_state=out_final,
                                    cu_seqlens=cu_t, log_atk_scale=d["center"])
    if name == "pkda_fused":
        return dt.fused_recurrent_precond_kda(d["q"], d["k"], d["v"], d["g"], d["g_p"], d["beta_p"], d["beta"],
                                              initial_state=h0, initial_A_state=d.get("a0"),
                                              output_final_state=out_final, cu_seqlens=cu_t,
                                              log_atk_scale=d["center"])
    raise KeyError(name)


# name: (decay, precond, gain used, online, l2norm default, GVA allowed)
MODELS = {"gdn": ("scalar", False, True, True, False), "gdn_fused": ("scalar", False, True, True, False),
          "kda": ("diagonal", False, True, True, False), "kda_fused": ("diagonal", False, True, True, False),
          "dn": ("none", False, True, True, False), "gla": ("diagonal", False, False, False, False),
          "simple_gla": ("scalar", False, False, False, False), "pgdn": ("scalar", True, True, True, True),
          "pgdn_fused": ("scalar", True, True, True, True), "pkda": ("diagonal", True, True, True, True),
          "pkda_fused": ("diagonal", True, True, True, True)}


def _ref(name, d, cu=None):
    decay, precond, gain, online, l2 = MODELS[name]
    return recurrent(d["q"], d["k"], d["v"], g=d.get("g"), beta=d["beta"] if gain else None, g_p=d.get("g_p"),
                     beta_p=d.get("beta_p"), center=d.get("center"), h0=d.get("h0"), a0=d.get("a0"), l2norm=l2,
                     online=online, cu_seqlens=None if cu is None else torch.tensor(cu))


def _inputs_for(name, case, dtype=torch.float64):
    decay, precond, *_ = MODELS[name]
    c = dict(case)
    if name in ("dn", "gla", "simple_gla") and c.get("HV"):
        c.pop("HV")
    return make(decay=decay, precond=precond, a0=precond and c.get("h0", False), dtype=dtype, **c)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_and_gradients_float64(name, case):
    d = _inputs_for(name, CASES[case])
    cu = CASES[case].get("cu")
    for t in d.values():
        t.requires_grad_(True)
    o, ht, at = _run_fla(name, d, l2=MODELS[name][4], cu=cu)
    ro, rh, ra = _ref(name, d, cu)
    close(o, ro, 1e-9, "o")
    close(ht, rh, 1e-9, "ht")
    if ra is not None:
        close(at, ra, 1e-9, "at")
    ws = [torch.randn_like(ro), torch.randn_like(rh)] + ([torch.randn_like(ra)] if ra is not None else [])
    keys = list(d)
    got = grads(zip([o, ht, at][:len(ws)], ws), [d[k_] for k_ in keys])
    want = grads(zip([ro, rh, ra][:len(ws)], ws), [d[k_] for k_ in keys])
    for k_, a, b in zip(keys, got, want):
        if b is None:
            continue
        assert a is not None, f"no gradient for {k_}"
        close(a, b, 1e-8, "d" + k_)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("name", ["gdn", "kda", "pgdn", "pkda", "dn", "gla", "simple_gla"])
def test_low_precision(name, dtype, tol):
    d64 = _inputs_for(name, dict(HV=4, h0=True) if name not in ("dn", "gla", "simple_gla") else dict(h0=True))
    d64["q"], d64["k"] = F.normalize(d64["q"], dim=-1), F.normalize(d64["k"], dim=-1)  # 16-bit range
    d = {k_: (t.to(dtype) if k_ not in ("h0", "a0") else t.float()) for k_, t in d64.items()}
    for t in d.values():
        t.requires_grad_(True)
    o, ht, _ = _run_fla(name, d, l2=MODELS[name][4])
    assert o.dtype == dtype and ht.dtype == torch.float32
    ref = _ref(name, {k_: t.detach().double() for k_, t in d.items()})
    close(o, ref[0], tol, "o")
    close(ht, ref[1], tol, "ht")
    o.float().sum().backward()
    assert d["q"].grad is not None and d["q"].grad.dtype == dtype and torch.isfinite(d["q"].grad.float()).all()


@pytest.mark.parametrize("name", ["gdn", "pgdn", "kda", "pkda"])
def test_gradcheck(name):
    decay, precond, *_ = MODELS[name]
    d = make(B=1, T=9, H=1, HV=2 if name in ("gdn", "pgdn") else 1, K=4, V=3, decay=decay, precond=precond, h0=True,
             a0=precond)
    keys = list(d)
    for t in d.values():
        t.requires_grad_(True)

    def f(*ts):
        o, ht, at = _run_fla(name, dict(zip(keys, ts)), l2=MODELS[name][4])
        return (o, ht) if at is None else (o, ht, at)

    assert torch.autograd.gradcheck(f, [d[k_] for k_ in keys], eps=1e-6, atol=1e-5, rtol=1e-4,
                                    nondet_tol=1e-12)  # cached vs recomputed backward


def test_strided_inputs_without_copies():
    d = make(B=2, T=20, H=2, K=8, V=8)
    # [B, H, T, K] storage viewed as [B, T, H, K]: the last dimension stays contiguous.
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (d["q"], d["k"], d["v"]))
    assert not q.is_contiguous()
    o1, h1 = dt.chunk_gated_delta_rule(q, k, v, d["g"], d["beta"], output_final_state=True)
    o2, h2 = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], output_final_state=True)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(h1, h2)


def test_state_v_first():
    d = make(h0=True)
    o1, h1 = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"],
                                       output_final_state=True)
    o2, h2 = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"],
                                       initial_state=d["h0"].transpose(-1, -2).contiguous(),
                                       output_final_state=True, state_v_first=True)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(h1, h2.transpose(-1, -2))
    # FLA's deprecated name for the flag: a DeprecationWarning, the same layout; both names at once: ValueError
    for fn in (dt.chunk_gated_delta_rule, dt.fused_recurrent_gated_delta_rule):
        with pytest.warns(DeprecationWarning):
            o3, h3 = fn(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"],
                        initial_state=d["h0"].transpose(-1, -2).contiguous(), output_final_state=True,
                        transpose_state_layout=True)
        torch.testing.assert_close(o1, o3)
        torch.testing.assert_close(h1, h3.transpose(-1, -2))
        with pytest.raises(ValueError):
            fn(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], state_v_first=True, transpose_state_layout=True)


def test_gate_in_kernel_and_beta_sigmoid():
    d = make(HV=2)
    a, A_log, dt_bias = torch.randn_like(d["g"]), torch.randn(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    b = torch.randn_like(d["beta"])
    o1, _ = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], a, b, use_gate_in_kernel=True, A_log=A_log,
                                      dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    o2, _ = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], g, 2 * b.sigmoid())
    torch.testing.assert_close(o1, o2)


def test_defaults_match_fla():
    d = make()
    o, ht = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"])
    assert ht is None
    ref = recurrent(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], l2norm=False)[0]
    close(o, ref, 1e-10, "o (no L2 norm, scale K^-0.5)")
    o2, _ = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=0.3)
    close(o2, recurrent(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], scale=0.3)[0], 1e-10, "o (scale)")


def test_g_gamma_and_linear_attention():
    d = make(decay="none")
    gamma = -torch.rand(2, dtype=torch.float64)
    o1, _ = dt.chunk_simple_gla(d["q"], d["k"], d["v"], g_gamma=gamma)
    g = gamma.view(1, 1, 2).expand(2, 37, 2)
    close(o1, recurrent(d["q"], d["k"], d["v"], g=g, online=False)[0], 1e-10, "g_gamma")
    o2, _ = dt.chunk_simple_gla(d["q"], d["k"], d["v"])
    close(o2, recurrent(d["q"], d["k"], d["v"], online=False)[0], 1e-10, "no decay")


def test_mixed_dtypes_on_cpu():
    d = make(HV=2, h0=True)
    q, k, v = (d[x].to(torch.bfloat16) for x in ("q", "k", "v"))
    o, ht = dt.chunk_gated_delta_rule(q, k, v, d["g"].float(), d["beta"].float(), initial_state=d["h0"],
                                      output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    ref = recurrent(q.double(), k.double(), v.double(), g=d["g"], beta=d["beta"], h0=d["h0"])
    close(o, ref[0], 1e-2, "o")


@pytest.mark.parametrize("model", ["gdn", "pgdn", "kda", "pkda", "gla", "mamba2"])
def test_recurrence_reference_backend(model):
    decay = {"gdn": "scalar", "pgdn": "scalar", "mamba2": "scalar", "kda": "diagonal", "pkda": "diagonal",
             "gla": "diagonal"}[model]
    precond = model.startswith("p")
    d = make(decay=decay, precond=precond, h0=True, a0=precond)
    for t in d.values():
        t.requires_grad_(True)
    kw = dict(g=d["g"], beta=None if model == "gla" else d["beta"], g_p=d.get("g_p"), beta_p=d.get("beta_p"),
              center=d.get("center"), initial_state=d["h0"], initial_A_state=d.get("a0"), output_final_state=True)
    a = dt.recurrence(model, d["q"], d["k"], d["v"], **kw)
    b = dt.recurrence(model, d["q"], d["k"], d["v"], backend="reference", **kw)
    for x, y in zip(a, b):
        if y is not None:
            close(x, y, 1e-10, model)
    ga = torch.autograd.grad(a[0].sum() + a[1].sum(), list(d.values()), allow_unused=True)
    gb = torch.autograd.grad(b[0].sum() + b[1].sum(), list(d.values()), allow_unused=True)
    for k_, x, y in zip(d, ga, gb):
        if y is not None:
            close(x, y, 1e-9, "d" + k_)


def test_recurrence_axes():
    d = make(decay="scalar")
    a = dt.recurrence(("scalar", "scalar", "identity", "online"), d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"])
    b = dt.recurrence("gdn", d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"])
    torch.testing.assert_close(a[0], b[0])


def test_retain_graph_twice():
    d = make(h0=True)
    for t in d.values():
        t.requires_grad_(True)
    o, ht = dt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"],
                                      output_final_state=True)
    loss = o.sum() + ht.square().sum()
    g1 = torch.autograd.grad(loss, list(d.values()), retain_graph=True)
    g2 = torch.autograd.grad(loss, list(d.values()))  # the cache was consumed: this one recomputes
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y)


# Errors: FLA arguments dgps lacks name themselves; malformed tensors raise dgps's message.
def test_errors():
    d = make()
    q, k, v, g, beta = d["q"], d["k"], d["v"], d["g"], d["beta"]
    with pytest.raises(NotImplementedError, match="head_first"):
        dt.chunk_gated_delta_rule(q, k, v, g, beta, head_first=True)
    with pytest.raises(NotImplementedError, match="cp_context"):
        dt.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object())
    with pytest.warns(UserWarning, match="bogus"):  # FLA ignores unknown keywords (transformers passes some)
        o_bogus = dt.chunk_gated_delta_rule(q, k, v, g, beta, bogus=1)[0]
    torch.testing.assert_close(o_bogus, dt.chunk_gated_delta_rule(q, k, v, g, beta)[0], rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="ssm_state_indices"):  # but never one that moves state
        dt.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state_indices=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):  # FLA's message
        dt.chunk_kda(q, k, v, g.unsqueeze(-1).expand(*g.shape, 16), beta, chunk_size=16)
    with pytest.raises(NotImplementedError, match="gv"):
        dt.fused_recurrent_gated_delta_rule(q, k, v, g, gv=torch.zeros_like(v), beta=beta)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        dt.chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(NotImplementedError, match="return_intermediate_states"):
        dt.chunk_kda(q, k, v, g.unsqueeze(-1).expand(*g.shape, 16), beta, return_intermediate_states=True)
    with pytest.raises(ValueError, match="chunk_size"):
        dt.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=128)
    with pytest.raises(RuntimeError, match="unknown model"):
        dt.recurrence("nope", q, k, v)
    with pytest.raises(RuntimeError):
        dt.chunk_gated_delta_rule(q, k, v, g[:, :5], beta)  # g has the wrong time length
    with pytest.raises(ValueError, match="batch size must be 1"):
        dt.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 37]))


def test_compiled_models():
    assert "gdn" in dt.compiled_models() and "pkda" in dt.compiled_models()
