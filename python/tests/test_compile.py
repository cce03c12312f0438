"""torch.compile(fullgraph=True) traces dgps_torch's functions without graph breaks (fake implementations and the
autograd function), and the compiled forward and gradients equal the eager ones. PyTorch 2 only."""
import pytest
import torch

import dgps_torch as dt
from test_ops import make

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dt.has_cuda() else [])


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs PyTorch 2")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gdn", "pgdn"])
def test_compile_fullgraph(name, device):
    d = make(B=2, T=40, H=2, K=16, V=8, precond=name == "pgdn", h0=True, dtype=torch.float32)
    d = {k_: t.to(device) for k_, t in d.items()}

    def layer(q, k, v, g, beta, h0, *p):
        if name == "gdn":
            o, ht = dt.chunk_gated_delta_rule(q * 2, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
        else:
            o, ht, _ = dt.chunk_precond_gated_delta_rule(q * 2, k, v, p[0], g, p[1], beta, initial_state=h0,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                         log_atk_scale=p[2])
        return (o * o).sum() + ht.square().sum()

    args = [d[k_] for k_ in ("q", "k", "v", "g", "beta", "h0")] + \
        ([d["g_p"], d["beta_p"], d["center"]] if name == "pgdn" else [])
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        xs = [a.detach().clone().requires_grad_(True) for a in args]
        loss = fn(*xs)
        loss.backward()
        results.append([loss.detach()] + [x.grad for x in xs])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
