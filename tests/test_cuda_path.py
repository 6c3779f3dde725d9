"""The CUDA kernels against the fp64 reference; skipped on machines without a GPU.

CI has no GPU; these run on GPU machines (``make test`` there) and check the
flash-attn and PyTorch-SDPA block kernels, including the surrogate-``out``
trick that feeds ``delta`` to their backward.
"""
from __future__ import annotations

import pytest
import torch

from burst_impl import burst_attn_func
from burst_impl.kernels import BACKENDS as _ALL
from tests.refs import attention_reference, make_inputs, max_err

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BACKENDS = ["cuda_sdpa"] + (["flash_attn"] if _ALL["flash_attn"].available() else [])


@cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_cuda_block_kernels(backend, causal, heads):
    inputs = make_inputs(2, 200, *heads, 64, torch.bfloat16)
    ref = attention_reference(*(t.double() for t in inputs), causal)
    got = attention_reference(*(t.cuda() for t in inputs), causal, backend=backend)
    plain = attention_reference(*inputs, causal, backend="cpu_flash")
    for name in ref:
        # same budget as the distributed bf16 tests: 2x plain bf16 error + one bf16 ulp
        budget = 2 * max_err(plain[name], ref[name]) + 2.0 ** -8 * max(ref[name].abs().max().item(), 1.0)
        assert max_err(got[name].cpu(), ref[name]) <= budget, (backend, name)


@cuda
def test_operator_on_cuda_world_size_one():
    q, k, v, do = (t.cuda().requires_grad_(i < 3) for i, t in
                   enumerate(make_inputs(1, 256, 8, 2, 64, torch.bfloat16)))
    out = burst_attn_func(q, k, v, causal=True)
    out.backward(do)
    ref = attention_reference(*(t.detach().double().cpu() for t in (q, k, v, do)), True)
    assert max_err(out.detach().cpu(), ref["out"]) < 3e-2
    assert max_err(q.grad.cpu(), ref["dq"]) < 6e-2
