"""Prepacked linear layers: same results as F.linear, rows independent of the batch (bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragcache_backend.model.kernels.linear import pack_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_matches_f_linear(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 1536, generator=g) * 0.03).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    lin = pack_linear(w, b)
    for rows in (1, 2, 7, 64):
        x = torch.randn(rows, 1536, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), b.float())
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (lin(x).float() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_bf16_rows_do_not_depend_on_how_many_rows_run_together():
    """The last row of an N-row call equals the same row computed alone, for every N tried
    (oneDNN sums a lone row differently; :class:`Linear` runs it as two; on AMX CPUs the kernels
    change with N, and :class:`Linear` runs every call in tiles of the same row count)."""
    g = torch.Generator().manual_seed(1)
    lin = pack_linear((torch.randn(576, 1536, generator=g) * 0.03).bfloat16())
    mismatched = []
    for rows in range(2, 130):
        x = torch.randn(rows, 1536, generator=g).bfloat16()
        if not torch.equal(lin(x[-1:]), lin(x)[-1:]) or not torch.equal(lin(x[:1]), lin(x)[:1]):
            mismatched.append(rows)
    assert mismatched == []


@pytest.mark.parametrize("amx_gemm", [True, False], ids=["amx-gemm-where-it-runs", "onednn-calls"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 576), (3072, 576), (576, 1536)])  # SmolLM2-135M's layer GEMMs
def test_a_prompts_rows_round_the_same_computed_with_any_cached_prefix(shape, amx_gemm):
    """A prompt's suffix computed alone (a cache hit's new rows) gives the rows it gives inside the
    whole prompt, whatever the lengths: on AMX CPUs on our AMX GEMM (one call), and on oneDNN's
    128-row calls (its last call padded to 64 or 128 rows) where that is switched off."""
    from ragcache_backend.model.kernels import native
    from ragcache_backend.model.kernels.linear import StepRowClasses, step_rows

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(*shape, generator=g) * 0.03).bfloat16()
    before = native.bf16_amx() if native.available(torch.bfloat16, "cpu", 64) else None
    try:
        if before is not None:
            native.bf16_amx(amx_gemm and before)
        lin = pack_linear(w)
    finally:
        if before is not None:
            native.bf16_amx(before)
    assert (lin.amx is not None) == bool(amx_gemm and before)
    x = torch.randn(300, shape[1], generator=g).bfloat16()
    for total in (20, 64, 65, 129, 300):
        with step_rows(StepRowClasses.of([total], [False])):
            whole = lin(x[:total])
        for cached in sorted({0, 1, total - 64, total - 63, total - 20, total - 1} & set(range(total))):
            with step_rows(StepRowClasses.of([total - cached], [False])):
                assert torch.equal(lin(x[cached:total]), whole[cached:]), (total, cached)


def test_rows_round_the_same_whatever_step_they_share():
    """A step's prompt rows and generated tokens' rows (in either order) equal the same rows computed
    in other company: a prefill alone, the prompt's last token alone (a cache hit), a decode-only
    step. Holds on every CPU; on AMX CPUs it needs the rows split by class."""
    from ragcache_backend.model.kernels.linear import StepRowClasses, step_rows

    g = torch.Generator().manual_seed(2)
    lin = pack_linear((torch.randn(576, 1536, generator=g) * 0.03).bfloat16())
    x = torch.randn(70, 1536, generator=g).bfloat16()
    prompt, decode = x[:60], x[60:]
    with step_rows(StepRowClasses.of([60] + [1] * 10, [False] + [True] * 10)):
        mixed = lin(x)
    with step_rows(StepRowClasses.of([1] * 10, [True] * 10)):
        decode_only = lin(decode)
    with step_rows(StepRowClasses.of([1] * 10 + [60], [True] * 10 + [False])):
        reordered = lin(torch.cat((decode, prompt)))
    assert torch.equal(mixed[:60], lin(prompt)) and torch.equal(mixed[59:60], lin(prompt[-1:]))
    assert torch.equal(mixed[60:], decode_only)
    assert torch.equal(reordered[:10], decode_only) and torch.equal(reordered[10:], mixed[:60])
    with step_rows(StepRowClasses.of([1] * 11, [False] + [True] * 10)):  # one prompt row (a hit's) beside decodes
        lone = lin(torch.cat((prompt[-1:], decode)))
    assert torch.equal(lone[:1], lin(prompt[-1:])) and torch.equal(lone[1:], decode_only)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_picked_rows_layer_takes_the_few_row_kernel_at_any_row_count(dtype):
    """The LM head (one row per sequence) runs every call on the native few-row kernel where it runs
    (calls of up to 16 rows), or on AMX CPUs in bf16 on our AMX GEMM (tiles of as many rows up to
    16, padded 32-row blocks beyond), so a row's logits are the same bits whatever else shares its
    step; the decoder layers' GEMMs keep their rule (bf16: oneDNN only, for the prompts' K/V)."""
    from ragcache_backend.model.kernels import native

    g = torch.Generator().manual_seed(4)
    w = (torch.randn(256, 576, generator=g) * 0.03).to(dtype)
    x = torch.randn(40, 576, generator=g).to(dtype)
    head, layer = pack_linear(w, per_step=False, picked_rows=True), pack_linear(w)
    assert head.rows_kernel == native.linear_rows_available(w) and head.rows_max is None
    assert layer.rows_kernel == (dtype == torch.float32 and native.linear_rows_available(w))  # bf16 layers: oneDNN only
    ref = F.linear(x.double(), w.double()).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    big = head(x)
    assert (big.float() - ref).abs().max().item() < tol * ref.abs().max().item()
    for m in (1, 2, 3, 4, 7, 16, 17, 33):
        got = head(x[:m])
        assert torch.equal(got, big[:m]), m  # alone, few or many: the same bits
        assert torch.equal(got[-1:], head(x[m - 1 : m])), m
        if head.amx is not None:
            assert torch.equal(got, native.amx_linear(x[:m], head.amx)), m
        elif head.rows_kernel and m <= native.LINEAR_ROWS_MAX:
            assert torch.equal(got, native.linear_rows(x[:m], w)), m
    assert (head.amx is not None) == (dtype == torch.bfloat16 and native.amx_linear_available(w))
