"""dgps_torch on CUDA: every FLA-named function in float32 and bfloat16 against the float64 reference (outputs, final
states, every gradient), varlen and GVA, the current stream, and CUDA graph capture. Skipped without a GPU build.
Tolerances (relative L2): the chunkwise kernels multiply 16-bit operands on the tensor cores also for float32
inputs (SPEC section 5), hence 1e-2 for float32, 3e-2 for bfloat16; gradients 3e-2 and 8e-2."""
import pytest
import torch
import torch.nn.functional as F

import dgps_torch as dt
from test_ops import CASES, MODELS, _inputs_for, _ref, _run_fla, close, grads

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dt.has_cuda()),
                                reason="needs a GPU and a CUDA build of dgps_torch")

# K = V = 64 at T = 100 (two chunks and a tail) besides the float64 suite's small cases.
GPU_CASES = CASES + [dict(B=2, T=100, H=2, HV=4, K=64, V=64, h0=True),
                     dict(B=1, T=160, H=2, K=64, V=64, cu=[0, 64, 65, 160], h0=True)]


def _to(d, dev, dtype):
    """Inputs on `dev`: q/k/v/gates in `dtype` (q and k L2-normalised so 16-bit stays in range), states float32."""
    out = {}
    for k_, t in d.items():
        t = t.detach()
        if k_ in ("q", "k"):
            t = F.normalize(t, dim=-1)
        out[k_] = t.to(dev, torch.float32 if k_ in ("h0", "a0") else dtype).requires_grad_(True)
    return out


@pytest.mark.parametrize("dtype,tol,gtol", [(torch.float32, 1e-2, 3e-2), (torch.bfloat16, 3e-2, 8e-2)])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_against_reference(name, case, dtype, tol, gtol):
    c = GPU_CASES[case]
    d = _to(_inputs_for(name, c), "cuda", dtype)
    cu = c.get("cu")
    o, ht, at = _run_fla(name, d, l2=MODELS[name][4], cu=cu)
    assert o.is_cuda and o.dtype == dtype and ht.dtype == torch.float32
    d64 = {k_: t.detach().cpu().double().requires_grad_(True) for k_, t in d.items()}
    ro, rh, ra = _ref(name, d64, cu)
    close(o.cpu(), ro, tol, "o")
    close(ht.cpu(), rh, tol, "ht")
    if ra is not None:
        close(at.cpu(), ra, tol, "at")
    ws = [torch.randn_like(ro), torch.randn_like(rh)] + ([torch.randn_like(ra)] if ra is not None else [])
    keys = list(d)
    got = grads(zip([o, ht, at][:len(ws)], [w.to("cuda", x.dtype) for w, x in zip(ws, [o, ht, at])]),
                [d[k_] for k_ in keys])
    want = grads(zip([ro, rh, ra][:len(ws)], ws), [d64[k_] for k_ in keys])
    for k_, a, b in zip(keys, got, want):
        if b is None:
            continue
        assert a is not None and a.is_cuda, f"no CUDA gradient for {k_}"
        close(a.cpu(), b, gtol, "d" + k_)


def test_cuda_current_stream_and_graph():
    d = _to(_inputs_for("gdn", dict(B=2, T=128, H=2, K=64, V=64)), "cuda", torch.bfloat16)
    args = [d[k_].detach() for k_ in ("q", "k", "v", "g", "beta")]
    want, _ = dt.chunk_gated_delta_rule(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the op must run on the caller's stream
        got, _ = dt.chunk_gated_delta_rule(*args)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        dt.chunk_gated_delta_rule(*args)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=s):
            out, _ = dt.chunk_gated_delta_rule(*args)
    torch.cuda.current_stream().wait_stream(s)
    args[2].mul_(0.5)  # a replay reads the inputs' storage as it is now
    graph.replay()
    torch.cuda.synchronize()
    want2, _ = dt.chunk_gated_delta_rule(*args)
    torch.testing.assert_close(out, want2, rtol=0, atol=0)


def test_cuda_graph_on_torch_capture_stream():
    """PyTorch's usual recipe: warm-up on a side stream, then torch.cuda.graph on its own capture stream, where the
    call finds no workspace yet (it is allocated outside the capture); forward and forward + backward replay."""
    d = _to(_inputs_for("gdn", dict(B=2, T=192, H=2, HV=4, K=64, V=64)), "cuda", torch.bfloat16)
    x = [d[k_] for k_ in ("q", "k", "v", "g", "beta")]

    def step():
        o, _ = dt.chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True)
        o.float().square().sum().backward()
        return o

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    for t in x:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    got = [out.clone()] + [t.grad.clone() for t in x]
    for t in x:
        t.grad = None
    want = [step()] + [t.grad for t in x]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("model,limit", [("gdn", 0.1), ("kda", 0.03)])
def test_cuda_gate_parameter_gradients(model, limit):
    """The gate parameters' gradients (A_log, dt_bias: sums of dg over every token) of Gated DeltaNet and KDA in
    bfloat16, at Qwen3-Next's initialisation (mostly strong decay), against the float64 gold: the in-chunk pair
    terms of dg must cancel in the chunk's reverse sum (a 16-bit residual per pair gave 0.4 - 0.85 relative error
    in GDN's A_log gradient, 6e-2 - 1.2e-1 in KDA's; python/scripts/gate_grad_error.py measures the grid)."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, K = 2, 256, 4, 8, 128
    kda = model == "kda"
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    bf = lambda x: x.to(torch.bfloat16).double()
    leaves = [bf(r(B, T, H, K)), bf(r(B, T, H, K)), bf(r(B, T, HV, K)), r(B, T, HV, K) if kda else r(B, T, HV),
              r(B, T, HV), (16 * torch.rand(HV, generator=gen, dtype=torch.float64)).clamp_min(1e-3).log(),
              torch.ones(HV * K if kda else HV, dtype=torch.float64)]
    dO = bf(r(B, T, HV, K))
    fn = dt.chunk_kda if kda else dt.chunk_gated_delta_rule

    def run(dev, io, gd):
        t = [x.detach().to(dev, io).clone().requires_grad_() for x in leaves[:3]]
        p = [x.detach().to(dev, gd).clone().requires_grad_() for x in leaves[3:]]
        if kda:
            g = -p[2].exp().view(HV, 1) * F.softplus(p[0] + p[3].view(HV, K))
        else:
            g = -p[2].exp() * F.softplus(p[0] + p[3])
        o = fn(*t, g, torch.sigmoid(p[1]), use_qk_l2norm_in_kernel=True)[0]
        (o.to(gd) * dO.to(dev, gd)).sum().backward()
        return p[2].grad.cpu().double(), p[3].grad.cpu().double()

    gold = run("cpu", torch.float64, torch.float64)
    got = run("cuda", torch.bfloat16, torch.float32)
    for name, a, b in zip(("dA_log", "ddt_bias"), got, gold):
        err = float((a - b).norm() / b.norm())
        assert err < limit, f"{model} {name}: relative L2 error {err:.3e} to the float64 gold (limit {limit})"
