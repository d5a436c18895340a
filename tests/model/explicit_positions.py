"""Cases shared by the float32 and bf16 kernel tests for rows at explicit positions (the recomputed
tokens of reused chunks)."""

from __future__ import annotations

import pytest
import torch

from ragcache_backend.model.kernels import native
from ragcache_backend.model.kernels.native import NativeKernelError

#: positions on both sides of 16-row work items and 64-key blocks
EDGES = (0, 1, 15, 16, 63, 64, 65, 127, 128, 191, 192, 255, 256, 511, 512)


def scattered(context: int, count: int, seed: int, must: tuple[int, ...] = ()) -> torch.Tensor:
    """Ascending positions in ``[0, context)``: ``must`` (those inside), then random others up to ``count``."""
    g = torch.Generator().manual_seed(seed)
    picked = {p for p in must if p < context}
    for p in torch.randperm(context, generator=g).tolist():
        if len(picked) >= count:
            break
        picked.add(p)
    return torch.tensor(sorted(picked), dtype=torch.int64)


def assert_mixed_step_rows_alone(kc: torch.Tensor, vc: torch.Tensor) -> None:
    """One attention call with sequences at explicit positions beside ordinary prompts and a
    generated token gives every row the bits it has in a call of its sequence alone (``kc``, ``vc``:
    an arena of at least 2,099 slots, 3 KV heads of 64, the dtype under test)."""
    g = torch.Generator().manual_seed(14)
    perm = torch.randperm(kc.shape[0], generator=g)
    specs = [(400, scattered(400, 60, 5)), (300, None), (1200, None), (129, scattered(129, 3, 6, must=(64,))), (70, None)]
    new = [p.numel() if p is not None else n for (_, p), n in zip(specs, (0, 25, 1, 0, 70))]
    decode = [False, False, True, False, False]
    contexts, at = [], 0
    for s, _ in specs:
        contexts.append(perm[at : at + s])
        at += s
    q = torch.randn(sum(new), 9, 64, generator=g).to(kc.dtype)
    together = native.paged_attention(q, kc, vc, native.attention_batch(contexts, new, decode, [p for _, p in specs]), 0.125)
    row = 0
    for ctx, (_, pos), n, dec in zip(contexts, specs, new, decode):
        alone = native.paged_attention(q[row : row + n], kc, vc, native.attention_batch([ctx], [n], [dec], [pos]), 0.125)
        assert torch.equal(together[row : row + n], alone)
        row += n


def assert_forged_positions_fail_in_the_kernel(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
    """Positions that :func:`native.attention_batch` would refuse, forged into an
    :class:`native.AttentionBatch` (past the context, descending, negative, huge, repeated), fail
    cleanly in the C kernel (code 1), and a batch with one position too many for its rows is refused
    (``q``: 3 rows of 9 heads of 64; ``kc``, ``vc``: an arena of at least 20 slots, 3 KV heads)."""
    ctx = torch.arange(20)
    good = native.attention_batch([ctx], [3], [False], [torch.tensor([1, 5, 9])])
    native.paged_attention(q, kc, vc, good, 0.125)
    for bad in ([1, 5, 20], [9, 5, 1], [-3, 5, 9], [1, 5, 1 << 40], [1, 5, 5]):
        forged = native.AttentionBatch(good.slots, good.ctx_off, good.q_off, good.decode, torch.tensor(bad))
        with pytest.raises(NativeKernelError, match="code 1"):
            native.paged_attention(q, kc, vc, forged, 0.125)
    with pytest.raises(NativeKernelError):  # one position per row
        native.paged_attention(q[:2], kc, vc, native.AttentionBatch(good.slots, good.ctx_off, torch.tensor([0, 2]),
                                                                     good.decode, torch.tensor([1, 5, 9])), 0.125)
