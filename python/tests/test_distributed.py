"""dgps_torch.distributed: a sequence split over 2 and 3 gloo ranks (processes on this host) against the single call,
forward and backward, for every compiled chunkwise model; on CUDA (when present) the ranks share the one GPU and
gather through the host. Float64 within 1e-10, float32 within 1e-4 (CPU) or 1e-3 (CUDA), bfloat16 within 3e-2
(max|x - ref| / max|ref| per tensor)."""
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import dgps_torch as dt
from dgps_torch import distributed as dd

B, H, HV, K, V, T = 2, 2, 4, 8, 6, 150
DIAG = {"pdn", "pgdn", "pkda", "pmamba2"}
MODELS = [m for m in ("la", "mamba2", "gla", "dn", "gdn", "kda", "pdn", "pgdn", "pkda", "pmamba2")
          if m in dt.compiled_models().split(", ")]


TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}


def inputs(model, dtype, device="cpu", seed=3):
    """The full sequence's inputs, cotangents and initial states (leaf tensors)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    ins = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V), "initial_state": 0.5 * r(B, HV, K, V)}
    if model in ("mamba2", "gdn", "pgdn", "pmamba2"):
        ins["g"] = F.logsigmoid(r(B, T, HV)) * 0.3
    if model in ("gla", "kda", "pkda"):
        ins["g"] = F.logsigmoid(r(B, T, HV, K)) * 0.3
    if model not in ("la", "gla"):
        ins["beta"] = torch.rand(B, T, HV, generator=g, dtype=torch.float64)
    if model in DIAG:
        ins["g_p"] = F.logsigmoid(r(B, T, H)) * 0.2
        ins["beta_p"] = torch.rand(B, T, H, generator=g, dtype=torch.float64)
        ins["center"] = -0.2 + 0.3 * r(H)
        ins["initial_A_state"] = torch.rand(B, H, K, generator=g, dtype=torch.float64)
    cot = {"o": r(B, T, HV, V), "hT": r(B, HV, K, V), "aT": r(B, H, K) if model in DIAG else None}
    cast = lambda t: t.to(dtype if t.dtype == torch.float64 and dtype != torch.float64 else t.dtype)
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    ins = {n: (t.to(sd) if n in ("initial_state", "initial_A_state") else cast(t)).to(device) for n, t in ins.items()}
    cot = {n: None if t is None else t.to(device) for n, t in cot.items()}
    return ins, cot


def loss_of(o, hT, aT, cot, o_rows, final):
    loss = (o.double() * cot["o"][:, o_rows]).sum()
    if final:
        loss = loss + (hT.double() * cot["hT"]).sum()
        if aT is not None:
            loss = loss + (aT.double() * cot["aT"]).sum()
    return loss


def _worker(rank, world, port, lens, dtype, device, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t0 = sum(lens[:rank])
        rows = slice(t0, t0 + lens[rank])
        for model in MODELS:
            ins, cot = inputs(model, dtype, device)
            tol = 1e-3 if device == "cuda" and dtype == torch.float32 else TOL[dtype]
            # The single call on the whole sequence.
            full = {n: t.clone().requires_grad_(True) for n, t in ins.items()}
            o, hT, aT = dt.recurrence(model, **full, output_final_state=True)
            loss_of(o, hT, aT, cot, slice(0, T), True).backward()
            # This rank's segment.
            seg = {n: (t[:, rows] if t.dim() >= 3 and t.shape[1] == T and n not in ("initial_state",
                                                                                      "initial_A_state") else t)
                   for n, t in ins.items()}
            seg = {n: t.clone().requires_grad_(True) for n, t in seg.items()}
            so, shT, saT = dd.recurrence(model, **seg, output_final_state=True)
            loss_of(so, shT, saT, cot, rows, rank == world - 1).backward()

            def err(x, ref):
                den = ref.abs().max().item()
                return (x.double() - ref.double()).abs().max().item() / (den if den > 0 else 1.0)

            checks = {"o": err(so, o[:, rows]), "hT": err(shT, hT)}
            if aT is not None:
                checks["aT"] = err(saT, aT)
            for n, t in seg.items():
                if n in ("initial_state", "initial_A_state"):
                    if rank == 0:
                        checks["d" + n] = err(t.grad, full[n].grad)
                    else:
                        assert t.grad is None or t.grad.abs().max().item() == 0, (model, n)
                elif n == "center":  # the ranks' shares sum to the gradient
                    share = t.grad.clone()
                    dist.all_reduce(share)
                    checks["dcenter"] = err(share, full[n].grad)
                else:
                    checks["d" + n] = err(t.grad, full[n].grad[:, rows])
            bad = {n: e for n, e in checks.items() if not e < tol}
            assert not bad, f"{model} {dtype} rank {rank} of {lens}: {bad}"
        open(os.path.join(out_dir, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("lens,dtype", [([64, 86], torch.float64), ([40, 17, 93], torch.float32),
                                        ([1, 63, 86], torch.float64)])
def test_split_equals_single_call(lens, dtype):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(len(lens), _free_port(), lens, dtype, "cpu", d), nprocs=len(lens), join=True)
        assert sorted(os.listdir(d)) == [f"ok{r}" for r in range(len(lens))]


@pytest.mark.skipif(not torch.cuda.is_available() or not dt.has_cuda(), reason="no CUDA device or no CUDA build")
@pytest.mark.parametrize("lens,dtype", [([64, 86], torch.float32), ([40, 17, 93], torch.bfloat16)])
def test_split_equals_single_call_cuda(lens, dtype):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(len(lens), _free_port(), lens, dtype, "cuda", d), nprocs=len(lens), join=True)
        assert sorted(os.listdir(d)) == [f"ok{r}" for r in range(len(lens))]


def test_exact_preconditioners_refused():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        q = torch.randn(1, 8, 1, 4)
        with pytest.raises(ValueError, match="exact preconditioners"):
            dd.recurrence("mesa", q, q, q)
    finally:
        dist.destroy_process_group()
