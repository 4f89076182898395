"""fastrope's registered ops and Hugging Face drop-in, without a GPU.

What does not need the kernel is checked here: the op schemas, the fake implementations (shapes,
dtypes and strides on meta tensors), ``torch.library.opcheck`` over the argument matrix,
``torch.compile(fullgraph=True)`` with zero graph breaks and one compile across sequence
lengths, the in-place path with autograd, and hf.py's argument checks and its mapping of
transformers' cos/sin rows. The kernel is replaced by :func:`_oracle_rotate`, the float64 oracle
behind the signature of ``ports.fastrope.run.rotate_positional`` (the ops' implementation), so the
registration, tracing and argument plumbing are tested without a device; the GPU suite
(tests/test_gpu_fastrope_torch.py) repeats them with the kernel.
"""
from __future__ import annotations

import itertools
import types

import pytest
import torch

from ports.fastrope import ablation, api, apply_rope, apply_rope_inplace, hf, problem, run
from reference import tables
from reference.eager import hf_apply_rotary_pos_emb
from reference.oracle import rope_oracle
from reference.vocabulary import BSH_AXES
from test_fastrope import fake  # CPU tensors that pass problem.validate's device check

OPS = [torch.ops.fastrope.rope.default, torch.ops.fastrope.rope_.default,
       torch.ops.fastrope.rope_out.default]


# ---- the oracle behind run.rotate's signature (and run.rotate_positional's, below) ---------------
def _token_positions(x, layout, positions, offsets, cu_seqlens):
    """Each token's position: [b, s] for the dense layouts, [t] for thd."""
    if layout == "thd":
        if positions is not None:
            return positions.long()
        cu = cu_seqlens.long()
        seq = torch.bucketize(torch.arange(x.shape[0]), cu[1:], right=True)
        pos = torch.arange(x.shape[0]) - cu[seq]
        return pos + (offsets.long()[seq] if isinstance(offsets, torch.Tensor) else offsets or 0)
    b, s = (x.shape[a] for a in BSH_AXES[layout][:2])
    if positions is not None:
        return positions.long().expand(b, s)
    pos = torch.arange(s).expand(b, s)
    return pos + (offsets.long()[:, None] if isinstance(offsets, torch.Tensor) else offsets or 0)


def _oracle_rotate(q, k=None, *, in_place, inverse=False, out=None, cos=None, sin=None,
                   positions=None, offsets=None, cu_seqlens=None, max_seqlen=None,
                   style="rotate_half", layout="bshd", rotary_dim=None, base=10000.0,
                   inv_freq=None, check_positions=True):
    """``run.rotate`` computed by the float64 oracle (CPU, any layout and position form), after
    the real argument checks (so the arguments the ops pass on must be a valid call)."""
    problem.validate(q=fake(q), k=None if k is None else fake(k), cos=cos, sin=sin,
                     positions=positions, offsets=offsets, cu_seqlens=cu_seqlens,
                     max_seqlen=max_seqlen, style=style, layout=layout, rotary_dim=rotary_dim,
                     base=base, inv_freq=inv_freq)
    given = out
    rot = rotary_dim or q.shape[-1]
    pos = _token_positions(q, layout, positions, offsets, cu_seqlens)
    if cos is None:
        freqs = tables.inv_freq(rot, base) if inv_freq is None else inv_freq
        rows = int(pos.max()) + 1 if pos.numel() else 1
        cos, sin = tables.cos_sin(tables.angles(torch.arange(rows), freqs), style,
                                  torch.float64)
    elif cos.shape[1] != rot:
        cos, sin = tables.expand_half(cos, style), tables.expand_half(sin, style)
    sin = -sin if inverse else sin
    outs = []
    for x in [q] if k is None else [q, k]:
        y = rope_oracle(x[..., :rot], cos, sin, pos, layout=layout, style=style).to(x.dtype)
        out = x.clone(memory_format=torch.contiguous_format)
        out[..., :rot] = y
        outs.append(x.copy_(out) if in_place else out)
    if given is not None:
        outs = [o.copy_(y) for o, y in zip(given, outs)]
    return outs[0] if k is None else tuple(outs)


def _oracle_positional(planner, q, k, in_place, inverse, check_positions, *arguments):
    """:func:`_oracle_rotate` behind ``run.rotate_positional``'s signature (what the ops and
    ``run.rotate`` call): the keywords positional, ``out`` last when given."""
    names = list(run.ARGUMENT_DEFAULTS)
    out = arguments[len(names)] if len(arguments) > len(names) else None
    return _oracle_rotate(q, k, in_place=in_place, inverse=inverse, out=out,
                          check_positions=check_positions, **dict(zip(names, arguments)))


@pytest.fixture
def oracle_kernel(monkeypatch):
    monkeypatch.setattr(run, "rotate_positional", _oracle_positional)


def _rand(*shape):
    return torch.randn(*shape) + 0.5


# ---- registration -----------------------------------------------------------------------------
def test_ops_are_registered_with_their_schemas():
    functional, in_place, into = (op._schema for op in OPS)
    assert str(functional).startswith("fastrope::rope(Tensor q, Tensor? k, Tensor? cos, Tensor? sin")
    assert str(functional).endswith("bool check_positions, bool inverse) -> Tensor[]")
    assert not functional.is_mutable
    for schema, written in ((in_place, ["q", "k"]), (into, ["q_out", "k_out"])):
        assert schema.is_mutable and str(schema).endswith("-> ()")
        mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert mutated == written
    assert [a.name for a in into.arguments][4:] == [a.name for a in functional.arguments][2:]


@pytest.mark.parametrize("with_k", [False, True])
def test_fake_outputs_are_contiguous_like_the_kernel(with_k):
    """On meta tensors: a [b, h, s, d] view of [b, s, h, d] memory gives a contiguous output of
    the view's shape and dtype (the kernel's outputs are new contiguous tensors)."""
    q = torch.empty(2, 7, 4, 16, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(2, 7, 2, 16, device="meta", dtype=torch.bfloat16).transpose(1, 2) \
        if with_k else None
    outs = torch.ops.fastrope.rope(q, k, None, None, None, None, 0, None, None, "rotate_half",
                                   "bhsd", None, 10000.0, None, True, False)
    assert len(outs) == (2 if with_k else 1)
    for x, out in zip([q, k], outs):
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert torch.ops.fastrope.rope_(q, k, None, None, None, None, 0, None, None, "rotate_half",
                                    "bhsd", None, 10000.0, None, True) is None


def test_fake_tensor_mode_goes_through_the_op():
    """Under FakeTensorMode the public function reaches the fake implementation (it does not
    try the launch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 5, 2, 8)
        out = apply_rope(q)
        assert out.shape == q.shape and out.is_contiguous()


# ---- opcheck over the argument matrix -----------------------------------------------------------
def _matrix(full: bool = False):
    """(style, layout, angle source, position form, rotary_dim, with k): every layout with every
    angle source (full tables, half tables, computed) and position form (arange, ids, offset
    tensor, int offset); both styles and both of (full rotary with k, partial rotary q alone)
    for each (``full``), or alternating (a covering set, a quarter of the cases)."""
    kinds = [(style, rot, with_k) for style in ("rotate_half", "interleaved")
             for rot, with_k in ((16, True), (8, False))]
    cases = []
    for layout, source, pos in itertools.product(("bshd", "sbhd", "bhsd", "thd"),
                                                 ("tables", "half tables", "computed"),
                                                 ("arange", "ids", "offsets", "int")):
        i = len(cases) if not full else None
        for style, rot, with_k in kinds if full else [kinds[(i % 2) * 2 + i // 2 % 2]]:
            cases.append((style, layout, source, pos, rot, with_k))
    return cases


def _case_args(style, layout, source, pos, rot, with_k, device="cpu"):
    """q, k and the rest of fastrope::rope's arguments (less ``inverse``) for a _matrix case."""
    torch.manual_seed(0)
    b, s, d = 2, 5, 16
    shape = {"bshd": (b, s, 4, d), "sbhd": (s, b, 4, d), "bhsd": (b, 4, s, d),
             "thd": (b * s, 4, d)}[layout]
    q = _rand(*shape)
    k = _rand(*shape[:-2], 2, d) if with_k else None
    if layout == "bhsd":
        k = _rand(b, 2, s, d) if with_k else None
    cu = torch.tensor([0, 3, b * s], dtype=torch.int32) if layout == "thd" else None
    nseq = 2
    cos = sin = inv = None
    if source != "computed":
        width = rot if source == "tables" else rot // 2
        cos, sin = _rand(32, width), _rand(32, width)
    else:
        inv = tables.inv_freq(rot, 500.0).float()
    positions, offsets, offset = None, None, 0
    if pos == "ids":
        positions = torch.randint(0, 20, (b * s,) if layout == "thd" else (b, s))
    elif pos == "offsets":
        offsets = torch.tensor([4, 1][:nseq], dtype=torch.int32)
    elif pos == "int":
        offset = 3
    q, k, cos, sin, positions, offsets, cu, inv = (
        None if t is None else t.to(device) for t in (q, k, cos, sin, positions, offsets, cu, inv))
    rest = (cos, sin, positions, offsets, offset, cu, (7 if layout == "thd" else None), style,
            layout, rot, 10000.0, inv, True)
    return q, k, rest


@pytest.mark.parametrize("case", _matrix(), ids=lambda c: "-".join(map(str, c)))
def test_opcheck_matrix(oracle_kernel, case):
    q, k, rest = _case_args(*case)
    q.requires_grad_(True)
    torch.library.opcheck(torch.ops.fastrope.rope.default, (q, k, *rest, False))
    torch.library.opcheck(torch.ops.fastrope.rope_.default,
                          (q.detach().clone(), None if k is None else k.clone(), *rest))
    outs = run.new_outputs([q.detach()] if k is None else [q.detach(), k])
    torch.library.opcheck(torch.ops.fastrope.rope_out.default,
                          (q.detach(), k, outs[0], outs[1] if k is not None else None, *rest,
                           False))


# ---- the public functions through the ops -------------------------------------------------------
@pytest.mark.parametrize("with_k", [False, True])
@pytest.mark.parametrize("through_ops", [False, True], ids=["eager", "ops"])
def test_autograd_in_place_matches_out_of_place(oracle_kernel, monkeypatch, with_k, through_ops):
    """apply_rope_inplace with a gradient recorded gives apply_rope's values and gradients, on
    the eager path (mark_dirty) and through the ops (rope + copy_, as traced); the backward is
    the inverse rotation."""
    if through_ops:
        monkeypatch.setattr(api, "_direct", lambda: False)
    cos, sin = _rand(16, 16), _rand(16, 16)
    leaves = [_rand(2, 5, 4, 16).requires_grad_(True)]
    if with_k:
        leaves.append(_rand(2, 5, 2, 16).requires_grad_(True))
    dys = [torch.randn_like(x) for x in leaves]
    outs = apply_rope(*leaves, cos=cos, sin=sin, offsets=2)
    outs = outs if with_k else (outs,)
    grads = torch.autograd.grad(outs, leaves, dys)
    copies = [x.clone() for x in leaves]
    inplace = apply_rope_inplace(*copies, cos=cos, sin=sin, offsets=2)
    inplace = inplace if with_k else (inplace,)
    assert all(a is b for a, b in zip(inplace, copies))
    grads_inplace = torch.autograd.grad(inplace, leaves, dys)
    for a, b in zip(outs + grads, inplace + grads_inplace):
        assert torch.equal(a, b)
    for x, dy, g in zip(leaves, dys, grads):
        want = _oracle_rotate(dy, in_place=False, inverse=True, cos=cos, sin=sin, offsets=2)
        assert torch.equal(g, want)


@pytest.mark.parametrize("through_ops", [False, True], ids=["eager", "ops"])
@pytest.mark.parametrize("views", ["q", "k", "both", "q alone", "packed qkv"])
def test_autograd_in_place_into_views(oracle_kernel, monkeypatch, through_ops, views):
    """q and k as a model has them, views of its projections' outputs (``q_proj(x).view(...)``):
    apply_rope_inplace with a gradient recorded gives apply_rope's values and gradients. PyTorch
    lets an in-place Function on a view return one tensor, so the eager path rotates both in one
    launch and records a Function each ("q alone": no k, the one Function; "packed qkv": q and
    k views of one projection's output, as a fused qkv projection gives them)."""
    if through_ops:
        monkeypatch.setattr(api, "_direct", lambda: False)
    launches = []

    def counted(planner, q, k, in_place, inverse, *rest):
        launches.append(inverse)
        return _oracle_positional(planner, q, k, in_place, inverse, *rest)

    monkeypatch.setattr(run, "rotate_positional", counted)
    gen = torch.Generator().manual_seed(4)
    leaves = [torch.randn(*shape, generator=gen).requires_grad_(True)
              for shape in ((2, 5, 24), (24, 64), (24, 32))]
    cos, sin = _rand(16, 16), _rand(16, 16)  # each pair's members differ: asymmetric
    dys = [torch.randn(2, 5, h, 16, generator=gen) for h in (4, 2)]

    def step(rope):
        x, wq, wk = leaves
        q = (x @ wq).view(2, 5, 4, 16)
        k = (x @ wk).view(2, 5, 2, 16)
        q, k = (t if views in (name, "both") else t * 1.0 for name, t in (("q", q), ("k", k)))
        if views == "q alone":
            q, k = (x @ wq).view(2, 5, 4, 16), None
        elif views == "packed qkv":  # [q heads, k heads, v heads] of one output, sliced
            qkv = (x @ torch.cat([wq, wk, wk], 1)).view(2, 5, 8, 16)
            q, k = qkv[:, :, :4], qkv[:, :, 4:6]
        assert q._is_view() == (views != "k")
        outs = rope(q, k, cos=cos, sin=sin, offsets=2)
        outs = (outs,) if k is None else outs
        assert rope is apply_rope or all(o is t for o, t in zip(outs, (q, k)))
        return list(outs) + list(torch.autograd.grad(outs, leaves, dys[:len(outs)],
                                                     allow_unused=True))

    want = step(apply_rope)
    launches.clear()
    got = step(apply_rope_inplace)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert (a is None and b is None) or torch.equal(a, b)
    if not through_ops:  # one forward for both; dq's and dk's apart (q alone: one backward)
        assert launches == ([False, True] if views == "q alone" else [False, True, True])


@pytest.mark.parametrize("through_ops", [False, True], ids=["eager", "ops"])
def test_in_place_refuses_views_of_split_before_writing(oracle_kernel, monkeypatch, through_ops):
    """q and k from ``qkv.split(...)``: PyTorch's autograd lets no output of a function that
    returns several views be written in place. A RuntimeError that says so, before anything is
    written (the eager path checks first; the ops path's ``copy_`` is refused by PyTorch)."""
    if through_ops:
        monkeypatch.setattr(api, "_direct", lambda: False)
    x = _rand(2, 5, 24).requires_grad_(True)
    w = _rand(24, 128)
    q, k, _ = (x @ w).view(2, 5, 8, 16).split([4, 2, 2], 2)
    q0, k0 = q.detach().clone(), k.detach().clone()
    with pytest.raises(RuntimeError, match="view"):
        apply_rope_inplace(q, k, cos=_rand(16, 16), sin=_rand(16, 16))
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0)


@pytest.mark.parametrize("through_ops", [False, True], ids=["eager", "ops"])
def test_in_place_refuses_a_leaf_that_requires_grad_before_writing(oracle_kernel, monkeypatch,
                                                                   through_ops):
    """A leaf that requires grad cannot be rotated in place with a gradient recorded: a
    RuntimeError that says so, and the leaf is left as it was."""
    if through_ops:
        monkeypatch.setattr(api, "_direct", lambda: False)
    q = _rand(2, 5, 4, 16).requires_grad_(True)
    k = _rand(2, 5, 2, 16) * 1.0
    q0 = q.detach().clone()
    with pytest.raises(RuntimeError, match="leaf"):
        apply_rope_inplace(q, k, cos=_rand(16, 16), sin=_rand(16, 16))
    assert torch.equal(q.detach(), q0)


@pytest.mark.parametrize("in_place", [False, True])
def test_ablation_autograd_rotates_the_gradient_back(monkeypatch, in_place):
    """The ablation functions (their own plans, so no op) record their own autograd: the
    backward is the inverse rotation with the same ablation."""
    planners = []

    def planned(planner, q, k=None, **kw):
        planners.append(planner)
        return _oracle_rotate(q, k, **kw)

    monkeypatch.setattr(run, "rotate_planned", planned)
    cos, sin = _rand(16, 16), _rand(16, 16)
    leaf = _rand(2, 5, 4, 16).requires_grad_(True)
    fn = ablation.apply_rope_inplace if in_place else ablation.apply_rope
    out = fn(leaf.clone() if in_place else leaf, cos=cos, sin=sin, ablation="table_per_head")
    dy = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, leaf, dy)
    assert torch.equal(grad, _oracle_rotate(dy, in_place=False, inverse=True, cos=cos, sin=sin))
    want = ablation.planner(ablation.ABLATIONS["table_per_head"])
    assert planners == [want, want] and want is not run.DESIGN


def test_offsets_of_another_type_are_refused_on_the_op_path(monkeypatch):
    monkeypatch.setattr(api, "_direct", lambda: False)
    q = _rand(2, 5, 4, 16)
    with pytest.raises(TypeError, match="offsets must be an int or an int tensor, got float"):
        apply_rope(q, offsets=1.5)


class _Attention(torch.nn.Module):
    """Attention over [b, s, h, d] q, k, v with RoPE: out of place on q, in place on (a copy
    of) k."""

    def forward(self, q, k, v, cos, sin, offset):
        b, s = q.shape[:2]
        q = apply_rope(q, cos=cos, sin=sin, offsets=offset)
        k = apply_rope_inplace(k.clone(), cos=cos, sin=sin, offsets=offset)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return att.transpose(1, 2).reshape(b, s, -1)


def _qkv(b, s, h, d, device="cpu", grad=False):
    """q, k, v [b, s, h, d], strided views cut from one [b, s, 3, h, d] tensor (as from a fused
    projection); leaves that require grad when ``grad``."""
    qkv = torch.randn(b, s, 3, h, d, device=device)
    return [x.detach().requires_grad_(grad) for x in qkv.unbind(2)]


def _grads(out, inputs, dy):
    return torch.autograd.grad(out, inputs, dy)


def _count_graphs():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


@pytest.mark.parametrize("grad", [False, True])
def test_compile_fullgraph_without_breaks(oracle_kernel, grad):
    """torch.compile(fullgraph=True) takes the module whole, through the ops; it matches eager
    bit for bit, forward and backward; dynamic sequence lengths compile once."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Attention()
    cos, sin = _rand(64, 16), _rand(64, 16)
    graphs, backend = _count_graphs()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    for s in (5, 9, 17):
        qkv = _qkv(2, s, 4, 16, grad=grad)
        with torch.set_grad_enabled(grad):
            want, got = model(*qkv, cos, sin, 3), compiled(*qkv, cos, sin, 3)
        assert torch.equal(want, got)
        if grad:
            dy = torch.randn_like(want)
            for a, b in zip(_grads(want, qkv, dy), _grads(got, qkv, dy)):
                assert torch.equal(a, b)
    assert len(graphs) == 1
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    # with a gradient: rope (its autograd), and rope + copy_ for the in-place call; without:
    # new outputs and rope_out, and rope_
    assert ("fastrope.rope" in ops) == grad
    assert ("fastrope.rope_out.default" in ops) == (not grad)
    assert ("fastrope.rope_" in ops) == (not grad)


def test_aot_autograd_traces_the_backward_op(oracle_kernel):
    """Under AOTAutograd (aot_eager) the backward runs the registered autograd (the inverse
    rotation) and matches eager."""
    torch._dynamo.reset()
    model = _Attention()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    qkv = _qkv(2, 6, 4, 16, grad=True)
    cos, sin = _rand(16, 16), _rand(16, 16)
    got, want = compiled(*qkv, cos, sin, 1), model(*qkv, cos, sin, 1)
    assert torch.equal(got, want)
    dy = torch.randn_like(want)
    for a, b in zip(_grads(want, qkv, dy), _grads(got, qkv, dy)):
        assert torch.equal(a, b)


# ---- Hugging Face drop-in -----------------------------------------------------------------------
def _hf_inputs(batch_rows: int, b=2, s=6, d=16):
    q = _rand(b, s, 4, d).transpose(1, 2)  # [b, h, s, d] over [b, s, h, d] memory
    k = _rand(b, s, 2, d).transpose(1, 2)
    angle = torch.rand(batch_rows, s, d // 2) * 6
    emb = torch.cat([angle, angle], dim=-1)
    return q, k, emb.cos(), emb.sin()


@pytest.mark.parametrize("batch_rows", [1, 2])
def test_hf_drop_in_matches_transformers_formula(oracle_kernel, batch_rows):
    q, k, cos, sin = _hf_inputs(batch_rows)
    got = hf.apply_rotary_pos_emb(q, k, cos, sin)
    want = hf_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6)


def test_hf_drop_in_bshd_with_unsqueeze_dim_2(oracle_kernel):
    q, k, cos, sin = _hf_inputs(2)
    got = hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                  unsqueeze_dim=2)
    want = hf.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want):
        assert torch.equal(g, w.transpose(1, 2))


@pytest.mark.parametrize("change,match", [
    (dict(unsqueeze_dim=0), "unsqueeze_dim must be 1"),
    (dict(cos=torch.ones(3, 6, 16)), r"cos must be \[b=2 or 1, s=6, d=16\]"),
    (dict(cos=torch.ones(1, 5, 16)), r"cos must be"),
    (dict(cos=torch.ones(1, 6, 8)), r"cos must be"),
    (dict(sin=torch.ones(2, 6, 16)), r"sin \(2, 6, 16\) must match cos"),
])
def test_hf_drop_in_checks_its_arguments(change, match):
    q, k, cos, sin = _hf_inputs(1)
    kw = dict(q=q, k=k, cos=cos, sin=sin) | change
    with pytest.raises(ValueError, match=match):
        hf.apply_rotary_pos_emb(**kw)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        hf.apply_rotary_pos_emb(q, None, cos, sin)
    with pytest.raises(TypeError, match="pass unsqueeze_dim by keyword"):
        hf.apply_rotary_pos_emb(q, k, cos, sin, 2)


def test_patch_replaces_and_restores():
    module = types.ModuleType("modeling_fake")
    module.apply_rotary_pos_emb = original = object()
    with hf.Patch(module, "apply_rotary_pos_emb", hf.apply_rotary_pos_emb) as patch:
        assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    assert module.apply_rotary_pos_emb is original
    patch = hf.Patch(module, "apply_rotary_pos_emb", hf.apply_rotary_pos_emb)
    patch.undo()
    assert module.apply_rotary_pos_emb is original


def test_patch_llama_without_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="patch_llama needs Hugging Face transformers"):
            hf.patch_llama()
    else:
        pytest.skip("transformers is installed: tests/test_gpu_fastrope_torch.py patches Llama")


def test_direct_path_only_when_nothing_traces():
    """Eager calls skip the dispatcher; under a dispatch mode they do not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert api._direct()
    with FakeTensorMode():
        assert not api._direct()
    q = _rand(2, 3, 4, 8)
    assert not api._records_grad(q, None) and api._records_grad(q, q.requires_grad_(True))
    with torch.no_grad():
        assert not api._records_grad(q, None)
