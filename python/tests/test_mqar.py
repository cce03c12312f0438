"""The MQAR example (examples/python/mqar): its data, its dgps kernels against its torch recurrence, and the
study script end to end at tiny sizes (the training itself is documented in docs/mqar.md, not timed here)."""
import csv
import os
import subprocess
import sys

import pytest
import torch

MQAR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python", "mqar")
sys.path.insert(0, MQAR)
from data import IGNORE, mqar_batch  # noqa: E402
from kernels import get_kernel, torch_recurrence  # noqa: E402


def test_batch_holds_pairs_and_queries():
    x, y = mqar_batch(16, 64, 8, vocab=8192, gen=torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (16, 64)
    for b in range(16):
        keys, values = x[b, 0:16:2].tolist(), x[b, 1:16:2].tolist()
        assert len(set(keys)) == 8 and all(1 <= k < 4096 for k in keys) and all(v >= 4096 for v in values)
        queries = (y[b] != IGNORE).nonzero().flatten().tolist()
        assert len(queries) == 8 and all(t >= 16 for t in queries)
        for t in queries:  # each query position holds a key, and its target is that key's value
            assert int(y[b, t]) == values[keys.index(int(x[b, t]))]


@pytest.mark.parametrize("model", ["dn", "pdn", "gdn", "pgdn"])
def test_dgps_kernel_matches_the_torch_recurrence(model):
    g = torch.Generator().manual_seed(5)
    B, T, H, K = 2, 40, 2, 16
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    beta, beta_atk = torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)
    gate, g_atk = -0.2 * torch.rand(B, T, H, generator=g), -0.2 * torch.rand(B, T, H, generator=g)
    args = dict(g=gate, g_atk=g_atk, beta_atk=beta_atk, center=torch.full((H,), -0.2))
    o = get_kernel("dgps")(model, q, k, v, beta, **args)
    ref = torch_recurrence(model, q.double(), k.double(), v.double(), beta.double(),
                           **{n: t.double() for n, t in args.items()})
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)


def test_study_grid_in_parallel_and_report(tmp_path):
    out = str(tmp_path / "grid")
    base = [sys.executable, os.path.join(MQAR, "study.py")]
    tiny = ["--steps", "2", "--batch", "4", "--d-model", "16", "--lengths", "64,128", "--kv-fixed", "8",
            "--models", "gdn,pgdn", "--lrs", "1e-3,1e-2", "--test-size", "8", "--eval-every", "2", "--threads", "1",
            "--out", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run(base + ["grid", "--jobs", "2"] + tiny, check=True, env=env, capture_output=True, timeout=600)
    runs = []
    for m in ("gdn", "pgdn"):
        with open(os.path.join(out, m, "results.csv")) as f:
            runs += list(csv.DictReader(f))
    # points (64, 8), (128, 8) and (128, 16) (slice B's 64-token point is slice A's), two rates each
    assert sorted((r["model"], r["seq_len"], r["kv_pairs"], r["lr"]) for r in runs) == sorted(
        (m, L, kv, lr) for m in ("gdn", "pgdn") for L, kv in (("64", "8"), ("128", "8"), ("128", "16"))
        for lr in ("0.001", "0.01"))
    table = open(os.path.join(out, "table.md")).read()
    assert table.count("\n| A |") == 2 and table.count("\n| B |") == 2 and "GDN" in table and "PGDN" in table
    os.remove(os.path.join(out, "table.md"))
    subprocess.run(base + ["report"] + tiny, check=True, env=env, capture_output=True, timeout=120)
    assert open(os.path.join(out, "table.md")).read() == table
