import copy

import pytest
import torch

from capsense.core.ablation import HeadAblator, ablation_identity, compute_head_means, scale_heads, zero_heads_in_weights
from capsense.core.arch import arch_spec, head_layout, out_projections, projection_weight
from capsense.core.heads import HeadSet
from capsense.errors import CapsenseError
from conftest import EXTRA_ARCHS, make_tiny_model, tiny_inputs

HEADS = "L0H1+L1H3+L2H0+L2H2"


def _hook_count(model) -> int:
    return sum(len(p._forward_pre_hooks) for p in out_projections(model))


def _check_hook_equals_zeroed_columns(model) -> None:
    """The hook's ablation equals zeroing the heads' input columns of the output projection."""
    x = tiny_inputs()
    with torch.no_grad():
        base = model(x).logits
        with HeadAblator(model).apply(HEADS):
            hooked = model(x).logits
        edited = copy.deepcopy(model)
        zero_heads_in_weights(edited, HEADS)
        zeroed = edited(x).logits
    assert (hooked - zeroed).abs().max().item() <= 1e-5
    assert (hooked - base).abs().max().item() > 1e-3  # the ablation did something
    assert _hook_count(model) == 0


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hook_equals_zeroed_columns(arch, attn):
    try:
        model = make_tiny_model(arch, attn)
    except ValueError as e:  # transformers 5 has no sdpa kernel for Gemma 2
        pytest.skip(f"{arch} has no {attn} attention here: {str(e)[:80]}")
    _check_hook_equals_zeroed_columns(model)


@pytest.mark.parametrize("arch", EXTRA_ARCHS)
def test_hook_equals_zeroed_columns_more_families(arch):
    """The same exactness on the families outside ``ARCHS``, with sdpa (the kernel 8B-70B runs use)
    where the family has it (gpt_oss, with attention sinks, has only eager here)."""
    try:
        model = make_tiny_model(arch, "sdpa")
    except ValueError:
        model = make_tiny_model(arch, "eager")
    _check_hook_equals_zeroed_columns(model)


def test_zeroing_touches_the_right_slice(arch):
    model = make_tiny_model(arch)
    layout = head_layout(model)
    edited = copy.deepcopy(model)
    zero_heads_in_weights(edited, "L1H3")
    w0 = projection_weight(out_projections(model)[1])
    w1 = projection_weight(out_projections(edited)[1])
    sl = slice(3 * layout.head_dim, 4 * layout.head_dim)
    if arch_spec(model).transposed:
        w0, w1 = w0.T, w1.T
    assert torch.all(w1[:, sl] == 0)
    assert torch.equal(w1[:, : sl.start], w0[:, : sl.start])


def test_batched_masks_equal_one_at_a_time(arch):
    model = make_tiny_model(arch)
    layout = head_layout(model)
    ablator = HeadAblator(model)
    g = torch.Generator().manual_seed(3)
    ko = torch.rand(4, layout.n_layers, layout.n_heads, generator=g) < 0.3
    ko[0] = False  # one all-keep row among them
    x = tiny_inputs(batch=1, seq=9).repeat(4, 1)
    with torch.no_grad():
        with ablator.apply(ko):
            batched = model(x).logits
        for r in range(4):
            with ablator.apply(ko[r : r + 1]):
                single = model(x[r : r + 1]).logits
            assert (batched[r] - single[0]).abs().max().item() <= 1e-5
    assert _hook_count(model) == 0


def test_all_keep_is_bit_identical(arch):
    model = make_tiny_model(arch)
    layout = head_layout(model)
    x = tiny_inputs()
    with torch.no_grad():
        base = model(x).logits
        with HeadAblator(model).apply(torch.zeros(1, layout.n_layers, layout.n_heads, dtype=torch.bool)):
            kept = model(x).logits
        with HeadAblator(model).apply(HeadSet()):
            empty = model(x).logits
    assert torch.equal(base, kept) and torch.equal(base, empty)


def test_hooks_removed_on_error():
    model = make_tiny_model("llama")
    with pytest.raises(RuntimeError, match="boom"):
        with HeadAblator(model).apply(HEADS):
            assert _hook_count(model) == 3
            raise RuntimeError("boom")
    assert _hook_count(model) == 0


def test_rows_must_match_batch():
    model = make_tiny_model("llama")
    ko = torch.zeros(2, 3, 4, dtype=torch.bool)
    ko[:, 0, 0] = True
    with pytest.raises(CapsenseError, match="2 rows but the batch has 3"):
        with HeadAblator(model).apply(ko):
            model(tiny_inputs(batch=3))


def test_bad_mode_and_shape():
    model = make_tiny_model("llama")
    with pytest.raises(CapsenseError, match="unknown `ablation` mode 'half': valid modes are zero, mean"):
        HeadAblator(model, ablation="half")
    with pytest.raises(CapsenseError, match="shape"):
        with HeadAblator(model).apply(torch.zeros(1, 5, 4, dtype=torch.bool)):
            pass


def test_mean_ablation_replaces_slice_by_its_mean(arch):
    model = make_tiny_model(arch)
    layout = head_layout(model)
    projections = out_projections(model)
    ref = tiny_inputs(batch=4, seq=7, seed=5)

    # By hand: capture each projection's input over the reference tokens and average it.
    captured = {}
    handles = [p.register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a[0].detach().clone()))
               for i, p in enumerate(projections)]
    with torch.no_grad():
        model(ref)
    for h in handles:
        h.remove()
    means = {i: t.reshape(-1, t.shape[-1]).mean(0) for i, t in captured.items()}

    heads = HeadSet.parse("L0H2+L2H1")
    x = tiny_inputs(batch=2, seq=6, seed=9)
    replaced = {}

    def replace(layer):
        def hook(m, a):
            y = a[0].clone()
            for h in heads.by_layer().get(layer, []):
                sl = slice(h * layout.head_dim, (h + 1) * layout.head_dim)
                y[..., sl] = means[layer][sl]
            replaced[layer] = True
            return (y,)
        return hook

    handles = [p.register_forward_pre_hook(replace(i)) for i, p in enumerate(projections)]
    with torch.no_grad():
        expected = model(x).logits
    for h in handles:
        h.remove()

    with torch.no_grad():
        with HeadAblator(model, "mean", means).apply(heads):
            got = model(x).logits
    assert (got - expected).abs().max().item() <= 1e-5


def test_compute_head_means_matches_hand_average():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(128)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="w0", eos_token="w2")
    model = make_tiny_model("llama")
    texts = ["w5 w6 w7 w8", "w9 w10", "w11 w12 w13"]
    means = compute_head_means(model, tok, texts, batch_size=2)
    captured = []
    h = out_projections(model)[1].register_forward_pre_hook(lambda m, a: captured.append(a[0][0]))
    with torch.no_grad():
        for t in texts:
            model(tok(t, return_tensors="pt")["input_ids"])
    h.remove()
    expected = torch.cat(captured).mean(0)
    assert (means[1] - expected).abs().max().item() <= 1e-5


def test_scale_per_row_equals_each_row_scaled_alone():
    """A [rows, layers, heads] scale multiplies each batch row by its own multipliers."""
    model = make_tiny_model("llama")
    ids = tiny_inputs(batch=3)
    scales = torch.rand(3, 3, 4, generator=torch.Generator().manual_seed(0)) * 2
    with torch.no_grad(), scale_heads(model, scales):
        rows = model(ids).logits
    for r in range(3):
        with torch.no_grad(), scale_heads(model, scales[r]):
            alone = model(ids[r : r + 1]).logits
        torch.testing.assert_close(rows[r : r + 1], alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(CapsenseError, match="2 rows but the batch has 3"):
        with torch.no_grad(), scale_heads(model, scales[:2]):
            model(ids)
    with pytest.raises(CapsenseError, match=r"shape \[3, 4\] or \[rows, 3, 4\]"):
        with scale_heads(model, torch.ones(2, 2, 3, 4)):
            pass


def test_ablation_identity_is_the_reference_texts_not_their_path(tmp_path):
    """A run folder and a validation's finished conditions are identified by it: a moved reference file is the same
    reference, an edited one is not."""
    a, b = tmp_path / "a.txt", tmp_path / "moved" / "b.txt"
    a.write_text("The library opens at nine.\n")
    b.parent.mkdir()
    b.write_text(a.read_text())
    assert ablation_identity("zero") is None and ablation_identity("mean") == "mean (capsense.tasks.prose.PASSAGES)"
    assert ablation_identity("mean", a) == ablation_identity("mean", b) != ablation_identity("mean")
    b.write_text("Rain fell all night.\n")
    assert ablation_identity("mean", a) != ablation_identity("mean", b)
