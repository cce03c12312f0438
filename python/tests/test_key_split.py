"""Key dimensions past dgps::cuda's 128: the key-block split of the key-separable models (la, mamba2, gla) against
one call (float64 CPU, within 1e-12 relative, outputs, final states and every gradient), the routing rule, and on
CUDA (when present) GLA at K = 256 through the split and KDA at K = 256 through the host, against the float64 CPU
call (bfloat16 within 2e-2, max|x - ref| / max|ref|)."""
import pytest
import torch
import torch.nn.functional as F

import dgps_torch as dt
from dgps_torch import core

SEPARABLE = [m for m in ("la", "mamba2", "gla") if m in dt.compiled_models().split(", ")]


def make(model, B=2, T=37, H=2, K=10, V=6, dtype=torch.float64, seed=0, cu=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    N = B if cu is None else len(cu) - 1
    ins = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V), "initial_state": 0.5 * r(N, H, K, V)}
    if model == "mamba2":
        ins["g"] = F.logsigmoid(r(B, T, H)) * 0.3
        ins["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    if model in ("gla", "kda"):
        ins["g"] = F.logsigmoid(r(B, T, H, K)) * 0.3
    if model == "kda":
        ins["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return {n: t.to(dtype) if n != "initial_state" else t for n, t in ins.items()}


def run(fn, ins, cot, **kw):
    leaves = {n: t.clone().requires_grad_(True) for n, t in ins.items()}
    o, hT, _ = fn(**leaves, output_final_state=True, **kw)
    ((o.double() * cot[0]).sum() + (hT.double() * cot[1]).sum()).backward()
    return {"o": o.detach(), "hT": hT.detach(), **{"d" + n: t.grad for n, t in leaves.items()}}


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("model", SEPARABLE)
@pytest.mark.parametrize("l2norm,scale,cu", [(True, None, None), (False, 0.7, None), (True, None, [0, 20, 20, 74])])
def test_split_equals_one_call(model, l2norm, scale, cu):
    B = 1 if cu else 2
    T = cu[-1] if cu else 37
    ins = make(model, B=B, T=T, cu=cu)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    gen = torch.Generator().manual_seed(5)
    cot = (torch.randn(ins["v"].shape, generator=gen, dtype=torch.float64),
           torch.randn(ins["initial_state"].shape, generator=gen, dtype=torch.float64))
    ref = run(lambda **a: dt.recurrence(model, **a), ins, cot, l2norm_qk=l2norm, scale=scale, cu_seqlens=cu_t)
    got = run(lambda **a: core.split_keys(model, 4, **a), ins, cot, l2norm_qk=l2norm, scale=scale, cu_seqlens=cu_t)
    assert set(got) == set(ref)
    bad = {n: rel(got[n], ref[n]) for n in ref if not rel(got[n], ref[n]) < 1e-12}
    assert not bad, bad


def test_routes():
    assert core.cuda_route("gla", 128) == "direct"
    assert core.cuda_route("gla", 256) == "split"
    assert core.cuda_route("la", 320) == "split" and core.cuda_route("mamba2", 512) == "split"
    assert core.cuda_route("diagonal,unit,identity,offline", 256) == "split"
    for m in ("gdn", "kda", "dn", "pgdn", "pkda", "pmamba2", "mesa", "ridge", "scalar,scalar,identity,online"):
        assert core.cuda_route(m, 256) == "host", m
    assert core.cuda_route("gla", 256, backend="cuda") == "direct"
    with pytest.raises(ValueError, match="key-separable"):
        core.split_keys("gdn", 4, **make("kda"))


cuda = pytest.mark.skipif(not torch.cuda.is_available() or not dt.has_cuda(), reason="no CUDA device or no CUDA build")


@cuda
@pytest.mark.parametrize("model", ["gla", "kda"])
def test_cuda_key_dim_256(model):
    ins = make(model, B=2, T=100, H=2, K=256, V=64, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    cot = (torch.randn(ins["v"].shape, generator=gen, dtype=torch.float64),
           torch.randn(ins["initial_state"].shape, generator=gen, dtype=torch.float64))
    ref = run(lambda **a: dt.recurrence(model, **a), ins, cot)
    dev = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float()).cuda() for n, t in ins.items()}
    with pytest.warns(UserWarning, match="CPU backend") if model == "kda" else _nothing():
        got = run(lambda **a: dt.recurrence(model, **a), dev, tuple(c.cuda() for c in cot))
    bad = {n: rel(got[n].cpu(), ref[n]) for n in ref if not rel(got[n].cpu(), ref[n]) < 2e-2}
    assert not bad, bad


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
