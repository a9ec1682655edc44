"""The csrc kernel of few-row projections (``x @ w.T``, csrc/linear_cpu.cpp) against the
float64 reference (issue #21): every row count up to two passes over ``w`` and beyond,
shapes that fit no block, every instruction set this CPU has, one thread and two, that a
row's result does not depend on the rows beside it, its refusals, and that the model's
``linear`` routes few rows to it and many to BLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenlake.kernels import native
from tokenlake.model.llama import model as llama


def _operands(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize("n,k", [
    (576, 576),    # SmolLM2's q/o projections: w past the threads' bound
    (192, 576),    # its k/v projections
    (576, 1536),   # its down projection
    (5, 3),        # K below one vector, N below one block
    (37, 50),      # a K tail and an N tail for every row kernel
    (1001, 1000),  # both tails on the threaded path: the last thread's blocks end at N
])
def test_kernel_equals_the_reference(kernel, isas, n, k):
    for isa in isas:
        kernel.set_isa(isa)
        for m in (*range(1, 10), 13, 16, 17, 33):  # every row kernel, padded ones, 1-5 passes
            x, w = _operands(m, n, k, seed=m)
            got = native.linear(x, w)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            want = x.double() @ w.double().T
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * k ** 0.5)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, isas):
    """Row i of x @ w.T is bit for bit the same whether x has 1, 3, 8 or 20 rows, and on one
    thread or two, with every instruction set this CPU has: a request decodes the same
    numbers in any batch."""
    threads = torch.get_num_threads()
    try:
        for isa in isas:
            kernel.set_isa(isa)
            for n, k in ((576, 1536), (1001, 1000)):  # the second with K and N tails
                x, w = _operands(20, n, k, seed=7)
                alone = torch.cat([native.linear(x[i : i + 1], w) for i in range(20)])
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for m in (3, 8, 20):
                        assert torch.equal(native.linear(x[:m], w), alone[:m]), (isa, t, m)
    finally:
        torch.set_num_threads(threads)


def test_a_strided_x_and_empty_operands(kernel):
    x, w = _operands(8, 40, 64, seed=3)
    strided = x.T.contiguous().T  # the same values, column-major
    assert torch.equal(native.linear(strided, w), native.linear(x, w))
    assert native.linear(x[:0], w).shape == (0, 40)
    assert native.linear(x, w[:0]).shape == (8, 0)
    assert torch.equal(native.linear(x[:, :0], w[:, :0]), torch.zeros(8, 40))


@pytest.mark.parametrize("x,w,needle", [
    (torch.randn(2, 8), torch.randn(3, 9), r"\[M, K\]"),
    (torch.randn(2, 8, 1), torch.randn(3, 8), r"\[M, K\]"),
    (torch.randn(2, 8).double(), torch.randn(3, 8), "float32"),
    (torch.randn(2, 8), torch.randn(3, 8).half(), "float32"),
    (torch.randn(2, 8), torch.randn(8, 3).T, "contiguous"),
])
def test_operands_it_does_not_take_are_refused(kernel, x, w, needle):
    with pytest.raises(ValueError, match=needle):
        native.linear(x, w)


def test_the_models_linear_routes_few_rows_to_the_kernel(kernel):
    """``llama.linear`` gives the kernel's bits for up to NATIVE_LINEAR_ROWS rows, BLAS's
    above and when turned off."""
    limit = llama.NATIVE_LINEAR_ROWS
    x, w = _operands(limit + 1, 192, 576, seed=5)
    assert torch.equal(llama.linear(x[:limit], w), native.linear(x[:limit], w))
    assert torch.equal(llama.linear(x, w), F.linear(x, w))
    assert torch.equal(llama.linear(x[:limit, :100], w[:, :100].contiguous()),  # a strided x
                      native.linear(x[:limit, :100], w[:, :100].contiguous()))
    assert torch.equal(llama.linear(x[:4], w.T.contiguous().T), F.linear(x[:4], w))  # not contiguous
    x3 = x[:4].reshape(2, 2, -1)  # F.linear takes more dimensions, the kernel does not
    assert torch.equal(llama.linear(x3, w), F.linear(x3, w))
    xg = x[:4].clone().requires_grad_()  # autograd records: BLAS, with a gradient
    assert llama.linear(xg, w).grad_fn is not None
    with torch.no_grad():
        assert torch.equal(llama.linear(xg, w), native.linear(x[:4], w))
    llama.use_native_linear(False)
    try:
        assert torch.equal(llama.linear(x[:4], w), F.linear(x[:4], w))
    finally:
        llama.use_native_linear(True)
    assert not torch.equal(native.linear(x[:4], w), F.linear(x[:4], w)), \
        "the two paths round differently, so the equalities above tell them apart"
