"""
A padded text dataset with the model's own loss
================================================

A language-model dataset is a set of token sequences of different lengths; a data collator
pads each batch to its longest sequence and hands the model a dict: ``input_ids``,
``attention_mask``, and ``labels`` with ``-100`` where a token is padding. The model's own
loss (``model(**batch).loss``) shifts the labels by one position, ignores the ``-100`` ones
and averages over the tokens it counts.

``curvgap.curvature(model, loss="model")`` reads that loss from the model's trace, takes the
collator's dicts as they are, and over a loader of them gives the dataset's quantities as one
batch: every counted token weighs the same, whatever the batch it fell in and however long
its sequence. This example finds the top Hessian eigenvalues and the largest entries of the
exact Hessian diagonal of a small GPT-2 over such a dataset, on one process and then on two
with ``torchrun``.
"""

# %%
# The dataset and the model
# -------------------------
#
# Twenty sequences of 4 to 15 tokens, a collator that pads to the longest sequence of each
# batch, batches of 6 (the last one has 2), and a GPT-2 language model with random weights
# (its head untied from the token table: the exact diagonal of a tied table is not yet
# available).

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
import transformers
from scipy.sparse.linalg import eigsh
from torch.utils.data import DataLoader

import curvgap

torch.manual_seed(0)
config = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=2, n_inner=32, n_positions=32,
                                 vocab_size=40, bos_token_id=0, eos_token_id=0,
                                 pad_token_id=0, tie_word_embeddings=False)
model = transformers.GPT2LMHeadModel(config).to(torch.float64).eval()
generator = torch.Generator().manual_seed(1)
sequences = [torch.randint(1, 40, (int(n),), generator=generator)
             for n in torch.randint(4, 16, (20,), generator=generator)]


def collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right padding to the longest sequence; the padding's labels are -100."""
    length = max(len(s) for s in batch)
    ids = torch.stack([torch.nn.functional.pad(s, (0, length - len(s))) for s in batch])
    mask = (torch.arange(length) < torch.tensor([len(s) for s in batch])[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


loader = DataLoader(sequences, batch_size=6, collate_fn=collate)
c = curvgap.curvature(model, loss="model")
with torch.no_grad():
    own = float(model(**collate(sequences)).loss)
print(f"loss over the loader {float(c.loss(loader)):.12f}, the model's own on the whole "
      f"dataset as one batch {own:.12f}")

# %%
# The two agree to float32's rounding: the model computes its loss in float32 (its logits
# are upcast with ``.float()``, which leaves float64 as it is only in name), curvgap in the
# model's float64.
#
# The top eigenvalues
# -------------------
#
# Over a loader, ``hessian_operator`` is an operator whose every product is one pass over
# the batches; scipy's Lanczos finds the largest eigenvalues from its products.

H = c.hessian_operator(loader)
start = time.perf_counter()
v0 = np.random.default_rng(0).standard_normal(H.shape[0])
top = np.sort(eigsh(H.to_scipy(), k=3, which="LA", v0=v0, tol=1e-10,
                    return_eigenvectors=False))[::-1].copy()
print(f"top eigenvalues {np.array2string(top, precision=8)} ({time.perf_counter() - start:.1f} s)")

# %%
# The exact diagonal
# ------------------
#
# ``diagonal`` gives the Hessian's diagonal without forming the Hessian: exact, not a
# Hutchinson estimate. ``layer_slices`` says where each parameter lies in it.

start = time.perf_counter()
diagonal = c.diagonal(loader)
print(f"diagonal of {diagonal.numel()} entries ({time.perf_counter() - start:.1f} s)")
slices = c.layer_slices()
owner = np.empty(diagonal.numel(), dtype=object)
for name, where in slices.items():
    owner[where] = name
for k in torch.argsort(diagonal.abs(), descending=True)[:5].tolist():
    name = owner[k]
    entry = np.unravel_index(k - slices[name].start, model.get_parameter(name).shape)
    print(f"{float(diagonal[k]):+.6f}  {name}{list(map(int, entry))}")

# %%
# Each parameter's entries of the diagonal, spread over ten orders of magnitude. The biases
# of the projections back into the residual stream and the position table hold the largest;
# the exact zeros (drawn at 1e-16) are the key biases' (adding one number to every score of a
# row leaves its softmax unchanged) and the rows of the tokens and positions the dataset never
# uses.

fig, ax = plt.subplots(figsize=(9, 5))
names = list(slices)
for row, name in enumerate(names):
    values = diagonal[slices[name]].abs().clamp_min(1e-16).numpy()
    ax.scatter(values, np.full(values.size, row) + np.random.default_rng(row).uniform(
        -0.3, 0.3, values.size), s=2)
ax.set_xscale("log")
ax.set_yticks(range(len(names)), names, fontsize=7)
ax.set_xlabel("|H_ii|, exact")
ax.set_title(f"The Hessian diagonal of a GPT-2 over {len(sequences)} padded sequences")
fig.tight_layout()

# %%
# Two processes with ``torchrun``
# -------------------------------
#
# Each rank takes every second sequence as its shard, batches and pads it the same way, and
# makes the same calls: the counts of tokens are added over the ranks, so both get the
# dataset's quantities, equal to one process's to rounding.

SCRIPT = textwrap.dedent('''
    import datetime
    import sys

    import numpy as np
    import torch
    import torch.distributed as dist
    import transformers
    from scipy.sparse.linalg import eigsh
    from torch.utils.data import DataLoader

    import curvgap

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = torch.load(sys.argv[1])
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**saved["config"]))
    model = model.to(torch.float64).eval()
    model.load_state_dict(saved["weights"])

    def collate(batch):
        length = max(len(s) for s in batch)
        ids = torch.stack([torch.nn.functional.pad(s, (0, length - len(s))) for s in batch])
        mask = (torch.arange(length) < torch.tensor([len(s) for s in batch])[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}

    shard = saved["sequences"][rank::world]
    loader = DataLoader(shard, batch_size=6, collate_fn=collate)
    c = curvgap.curvature(model, loss="model")
    H = c.hessian_operator(loader)
    v0 = np.random.default_rng(0).standard_normal(H.shape[0])  # the same on every rank
    top = np.sort(eigsh(H.to_scipy(), k=3, which="LA", v0=v0, tol=1e-10,
                        return_eigenvectors=False))[::-1].copy()
    result = {"loss": c.loss(loader), "top": top, "diagonal": c.diagonal(loader)}
    torch.save(result, f"{sys.argv[2]}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()
''')

workspace = tempfile.TemporaryDirectory(prefix="curvgap_padded_")
folder = Path(workspace.name)
(folder / "script.py").write_text(SCRIPT)
torch.save({"config": config.to_dict(), "weights": model.state_dict(), "sequences": sequences},
           folder / "inputs.pt")
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(folder / "script.py"), str(folder / "inputs.pt"), str(folder / "result")]
environment = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "TQDM_DISABLE": "1"}
run = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900)
saved = [folder / f"result.rank{rank}" for rank in range(2)]
if not all(path.exists() for path in saved):
    raise RuntimeError(f"torchrun failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
ranks = [torch.load(path, weights_only=False) for path in saved]
workspace.cleanup()


def relative(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max())


one = {"loss": c.loss(loader), "top": top, "diagonal": diagonal}
for name in ("loss", "top", "diagonal"):
    print(f"{name:8s} rank 0 vs rank 1: {relative(ranks[0][name], ranks[1][name]):.1e}, "
          f"two processes vs one: {relative(ranks[0][name], one[name]):.1e}")
