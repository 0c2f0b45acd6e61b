"""
Curvature over a dataset with torchrun
======================================

The loss of a training set is the mean over its samples, and so are its gradient, its
Hessian, their products and diagonals. Every function of ``curvgap.curvature`` that takes
``X, T`` also takes, in their place, an iterable of ``(X, T)`` batches (a ``DataLoader``, a
list of pairs) and returns that mean over every sample, one batch at a time.

Under ``torch.distributed``, each process passes its own shard of the data and every
process gets the mean over the union of the shards: each rank's sums and sample counts are
added with ``all_reduce``. This example computes the loss, the gradient, a Hessian-vector
product and the top Hessian eigenvalue of a Transformer layer over a dataset in this process,
then runs the same computation on two processes with ``torchrun`` and compares.
"""

# %%
# One process
# -----------
#
# A Transformer encoder layer (PyTorch's own, post-LN) with random weights, a dataset of 100
# sequences of 10 tokens with random regression targets and the mean squared error; batches
# of 32, so the last batch has 4 sequences. Each call below is one pass over the loader; the
# operator's products are one pass each. ``gnvp``, ``diagonal`` and ``loss_hessian`` take a
# loader the same way. (A Hugging Face model works the same way; this
# example keeps to PyTorch's layers so that each process ``torchrun`` starts below starts
# fast.)

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy.sparse.linalg import eigsh
from torch.utils.data import DataLoader, TensorDataset

import curvgap

torch.manual_seed(0)
shape = dict(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True)
model = torch.nn.TransformerEncoderLayer(**shape, dtype=torch.float64).eval()
dataset = TensorDataset(torch.randn(100, 10, 16, dtype=torch.float64),
                        torch.randn(100, 10, 16, dtype=torch.float64))

c = curvgap.curvature(model)
loader = DataLoader(dataset, batch_size=32)
start = time.perf_counter()
v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64,
                generator=torch.Generator().manual_seed(1))
one = {"loss": c.loss(loader), "gradient": c.gradient(loader), "hvp": c.hvp(loader, v)}
H = c.hessian_operator(loader)
v0 = np.random.default_rng(0).standard_normal(H.shape[0])
one["top"] = eigsh(H.to_scipy(), k=1, which="LA", v0=v0, tol=1e-10,
                   return_eigenvectors=False)[0]
print(f"one process: loss {float(one['loss']):.12f}, top eigenvalue {one['top']:.12f} "
      f"({time.perf_counter() - start:.1f} s)")

# %%
# Whatever the batching, the result is the same mean: here the loss of the whole dataset
# as one batch, and the Hessian-vector product over batches of 7.

whole = c.loss(*dataset.tensors)
sevens = c.hvp(DataLoader(dataset, batch_size=7), v)
print(f"one batch of 100: loss {float(whole):.12f}; product over batches of 7 vs 32: "
      f"{(sevens - one['hvp']).abs().max() / one['hvp'].abs().max():.1e}")

# %%
# The script for ``torchrun``
# ---------------------------
#
# Each rank loads the same weights and dataset (here from a file this example writes;
# in practice, a checkpoint and the dataset), takes every ``world``-th sample as its shard,
# and makes exactly the calls above. Shard by index: ``DistributedSampler`` pads uneven
# shards with repeated samples, which would change the mean. Every rank runs the same
# ``eigsh`` from the same start vector: each product is a collective pass over every rank's
# shard, the reduced products are identical on every rank, and so the solvers take the same
# steps everywhere.

SCRIPT = textwrap.dedent('''
    import datetime
    import sys

    import numpy as np
    import torch
    import torch.distributed as dist
    from scipy.sparse.linalg import eigsh
    from torch.utils.data import DataLoader, Subset, TensorDataset

    import curvgap

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = torch.load(sys.argv[1])
    model = torch.nn.TransformerEncoderLayer(**saved["shape"], dtype=torch.float64).eval()
    model.load_state_dict(saved["weights"])
    dataset = TensorDataset(saved["inputs"], saved["targets"])

    shard = Subset(dataset, range(rank, len(dataset), world))  # every world-th sample
    loader = DataLoader(shard, batch_size=32)
    c = curvgap.curvature(model)
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))  # the same on every rank
    result = {"loss": c.loss(loader), "gradient": c.gradient(loader), "hvp": c.hvp(loader, v),
              "shard": len(shard)}
    H = c.hessian_operator(loader)
    v0 = np.random.default_rng(0).standard_normal(H.shape[0])  # the same on every rank
    result["top"] = float(eigsh(H.to_scipy(), k=1, which="LA", v0=v0, tol=1e-10,
                                return_eigenvectors=False)[0])
    torch.save(result, f"{sys.argv[2]}.rank{rank}")
    dist.barrier()  # every rank is done before any tears its connections down
    dist.destroy_process_group()
''')

# %%
# Two processes
# -------------
#
# ``torchrun --nproc_per_node 2 script.py`` starts two ranks on this machine; here it runs
# as ``python -m torch.distributed.run`` (the same program) on the loopback interface,
# with the gloo backend and one thread per process. The first process to need a generated
# module makes it; the others wait for it and load it from the module cache.

workspace = tempfile.TemporaryDirectory(prefix="curvgap_torchrun_")
folder = Path(workspace.name)
(folder / "script.py").write_text(SCRIPT)
torch.save({"shape": shape, "weights": model.state_dict(),
            "inputs": dataset.tensors[0], "targets": dataset.tensors[1]},
           folder / "inputs.pt")

with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(folder / "script.py"), str(folder / "inputs.pt"), str(folder / "result")]
environment = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "TQDM_DISABLE": "1"}
start = time.perf_counter()
run = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900)
saved = [folder / f"result.rank{rank}" for rank in range(2)]
if not all(path.exists() for path in saved):
    raise RuntimeError(f"torchrun failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
if run.returncode != 0:  # a rank's teardown, after every rank saved its results
    print(f"torchrun exited with status {run.returncode} after both ranks saved their "
          f"results:\n{run.stderr[-1000:]}")
ranks = [torch.load(path) for path in saved]
workspace.cleanup()
print(f"two processes ({time.perf_counter() - start:.1f} s with their start-up), shards of "
      f"{ranks[0]['shard']} and {ranks[1]['shard']} sequences")

# %%
# Both ranks hold the same results, and they equal the single process's to rounding: the
# same sums, added in another order.


def relative(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max())


for name in ("loss", "gradient", "hvp", "top"):
    print(f"{name:9s} rank 0 vs rank 1: {relative(ranks[0][name], ranks[1][name]):.1e}, "
          f"two processes vs one: {relative(ranks[0][name], one[name]):.1e}")
print(f"top eigenvalue: one process {one['top']:.12f}, two processes {ranks[0]['top']:.12f}")

# %%
# The Hessian-vector product over the dataset, one process against two, each entry; and
# where they differ, the difference against the entry: within a few units of rounding
# (``ε = 2.2e-16`` in float64) of the product's largest entry. The group of entries near
# 1e-18 are the key bias's, zero in exact arithmetic (adding the same number to every score
# of a row leaves its softmax unchanged, so the loss does not depend on the key bias).

fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
x, y = one["hvp"].numpy(), ranks[0]["hvp"].numpy()
a.plot([x.min(), x.max()], [x.min(), x.max()], color="k", lw=0.8)
a.scatter(x, y, s=4)
a.set_xlabel("(Hv)_i, one process")
a.set_ylabel("(Hv)_i, two processes (torchrun)")
a.set_title(f"Hessian-vector product over {len(dataset)} sequences ({x.size} entries)")
differ = y != x
scale = np.finfo(np.float64).eps * np.abs(x).max()
b.loglog(np.abs(x[differ]), np.abs(y - x)[differ], ".", ms=3, label="entries that differ")
b.axhline(scale, color="k", lw=0.8, label="ε · max |Hv|")
b.set_xlabel("|(Hv)_i|, one process")
b.set_ylabel("|two processes − one|")
b.set_title(f"{int((~differ).sum())} of {x.size} entries are equal")
b.legend(fontsize="small", loc="lower right")
fig.tight_layout()
