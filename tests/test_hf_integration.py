"""attn_implementation="fa2tune" in Hugging Face transformers: masks, padding, GQA, sliding windows and training,
against the same models under "sdpa" and in float64 (run through Triton's interpreter on the CPU).

Skipped when transformers is not installed (it is the optional `hf` extra)."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import masking_utils  # noqa: E402

from fa2tune.integrations import hf_masks  # noqa: E402
from fa2tune.integrations import transformers as fa2tune_hf  # noqa: E402

VOCAB = 61
# A mask fa2tune hands to SDPA warns (RuntimeWarning): an error here, except where a test expects one.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert fa2tune_hf.register() == "fa2tune"


# --- the mask function, one attention call at a time -------------------------------------------------------------

N = 21  # tokens per row, not a multiple of 16
# name -> (transformers' mask function, whether fa2tune keeps every query of a row or only its valid ones)
PATTERNS = {
    "causal": (masking_utils.causal_mask_function, False),
    "sliding4": (masking_utils.sliding_window_causal_mask_function(4), False),
    "bidirectional": (masking_utils.bidirectional_mask_function, True),
    "bidirectional_sliding3": (masking_utils.sliding_window_bidirectional_mask_function(3), True),
}


def _layout(name: str) -> tuple[torch.Tensor | None, int, int, int]:
    """(2-D padding mask over positions 0.., q_length, kv_length, q_offset) for a batch of 3 rows."""
    padding = torch.ones(3, N, dtype=torch.bool)
    if name == "full":
        return None, N, N, 0
    if name == "left":
        padding[0, :5] = padding[2, :1] = False
        return padding, N, N, 0
    if name == "right":
        padding[1, 13:] = padding[2, 20:] = False
        return padding, N, N, 0
    if name == "gap":  # padding between a row's tokens
        padding[1, 6:9] = False
        return padding, N, N, 0
    padding[0, :5] = False
    if name == "decode":  # the last 3 tokens, the others cached
        return padding, 3, N, N - 3
    if name == "static":  # a static cache: 6 slots past the tokens seen so far, 2 of them queried now
        return padding, 2, N + 6, N - 2
    raise ValueError(name)


LAYOUTS = ("full", "left", "right", "gap", "decode", "static")
# The cases fa2tune hands to SDPA: a sliding window over a gap; a bidirectional window over padding or a cache.
FALLBACKS = {("sliding4", "gap")} | {("bidirectional_sliding3", name) for name in LAYOUTS if name != "full"}


class _Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _reference(q, k, v, dense: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention under a (batch, 1, q_length, kv_length) boolean mask; (batch, q_length, heads, d)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~dense, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key: 0
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_mask_function_runs_each_pattern_and_layout_as_sdpas_mask(pattern, layout):
    mask_function, every_query = PATTERNS[pattern]
    padding, q_length, kv_length, q_offset = _layout(layout)
    arguments = dict(batch_size=3, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=0,
                     mask_function=mask_function, attention_mask=padding)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = hf_masks.fa2tune_mask(**arguments)
    falls_back = (pattern, layout) in FALLBACKS
    assert isinstance(plan, torch.Tensor) == falls_back and len(caught) == falls_back
    torch.manual_seed(len(pattern) * 7 + len(layout))
    q = torch.randn(3, 4, q_length, 16)
    k, v = (torch.randn(3, 2, kv_length, 16) for _ in range(2))
    out, weights = fa2tune_hf.attention_forward(_Layer(), q, k, v, plan, scaling=0.3)
    dense = masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False)
    want = _reference(q, k, v, dense, 0.3)
    # Queries at padded positions: fa2tune gives 0 (as flash_attention_2); their values are compared where fa2tune
    # keeps every query (bidirectional) or SDPA ran the call.
    kept = torch.ones(3, q_length, dtype=torch.bool)
    if not (every_query or falls_back) and padding is not None:
        kept = masking_utils.prepare_padding_mask(padding, kv_length, 0)[:, q_offset : q_offset + q_length]
        assert out[~kept].abs().max() == 0 if (~kept).any() else True
    assert weights is None and out.shape == (3, q_length, 4, 16)
    torch.testing.assert_close(out[kept].double(), want[kept], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("v_dim", [16, 40], ids=["narrower-v", "wider-v"])
@pytest.mark.parametrize("layout", ["full", "left"])
def test_a_value_head_dim_of_its_own_reaches_the_kernels_unpadded(layout, v_dim, monkeypatch):
    # MLA-style models (DeepSeek: 192 for q·k, 128 for v) hand value a head dim of its own; the kernels take it, so
    # it is passed through as it is: no zeros appended to v (or to q and k), no columns to compute and cut off.
    padding, q_length, kv_length, q_offset = _layout(layout)
    arguments = dict(batch_size=3, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=0,
                     mask_function=masking_utils.causal_mask_function, attention_mask=padding)  # fmt: skip
    plan = hf_masks.fa2tune_mask(**arguments)
    widths = []
    for name in ("attention", "attention_varlen"):
        real = getattr(fa2tune_hf, name)
        monkeypatch.setattr(fa2tune_hf, name, lambda q, k, v, *a, real=real, **kw: widths.append(
            (q.shape[-1], k.shape[-1], v.shape[-1])) or real(q, k, v, *a, **kw))  # fmt: skip
    torch.manual_seed(v_dim)
    q, k, v = torch.randn(3, 4, q_length, 24), torch.randn(3, 2, kv_length, 24), torch.randn(3, 2, kv_length, v_dim)
    out, _ = fa2tune_hf.attention_forward(_Layer(), q, k, v, plan, scaling=0.3)
    assert widths == [(24, 24, v_dim)] and out.shape == (3, q_length, 4, v_dim)
    want = _reference(q, k, v, masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False), 0.3)
    kept = torch.ones(3, q_length, dtype=torch.bool)
    if padding is not None:  # padded queries: 0, as flash_attention_2
        kept = masking_utils.prepare_padding_mask(padding, kv_length, 0)[:, q_offset : q_offset + q_length]
        assert out[~kept].abs().max() == 0
    torch.testing.assert_close(out[kept].double(), want[kept], atol=2e-5, rtol=2e-5)


def _step_layout(name: str) -> tuple[torch.Tensor, int, int, int]:
    """A padded batch's generation step: (2-D padding mask, q_length, kv_length, q_offset) for 3 rows."""
    padding = torch.ones(3, N, dtype=torch.bool)
    padding[0, :5] = padding[2, :1] = False  # left-padded prompts
    if name == "one_token":
        return padding, 1, N, N - 1
    if name == "gap":  # padding between a row's tokens too
        padding[1, 6:9] = False
        return padding, 2, N, N - 2
    if name == "static":  # 6 cache slots past the tokens seen so far
        return padding, 3, N + 6, N - 3
    raise ValueError(name)


def _strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """t's values, (batch, heads, length, d), in memory laid out as `how` says."""
    if how == "token_major":  # (batch, length, heads, d) memory, as a projection's output viewed per head
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "odd_rows":  # a row's stride no whole number of positions': no one-key page view
        batch, heads, length, d = t.shape
        buffer = torch.full((batch * (heads * length * d + 3),), float("nan"))
        view = buffer.as_strided(t.shape, (heads * length * d + 3, length * d, d, 1))
        return view.copy_(t)
    return t


@pytest.mark.parametrize("how", ["contiguous", "token_major", "odd_rows"])
@pytest.mark.parametrize("layout", ["one_token", "gap", "static"])
@pytest.mark.parametrize("pattern", ["causal", "sliding4", "bidirectional"])
def test_a_padded_generation_step_reads_the_cache_in_place(pattern, layout, how, monkeypatch):
    # A generation step of a padded batch: every query takes part, the padding is among the keys. The decode
    # kernels read K and V where they lie, through one-key pages, rather than a gathered copy of the whole cache;
    # where the strides allow no such view (odd_rows) the gather runs. Either way the values are the mask's.
    padding, q_length, kv_length, q_offset = _step_layout(layout)
    if pattern == "sliding4" and layout == "gap":
        pytest.skip("a sliding window over padding between tokens goes to SDPA")
    arguments = dict(batch_size=3, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=0,
                     mask_function=PATTERNS[pattern][0], attention_mask=padding)  # fmt: skip
    plan = hf_masks.fa2tune_mask(**arguments)
    calls = []
    for name in ("attention_varlen", "flash_attn_with_kvcache"):
        real = getattr(fa2tune_hf, name)
        monkeypatch.setattr(fa2tune_hf, name, lambda *a, name=name, real=real, **kw: calls.append(name) or real(
            *a, **kw))  # fmt: skip
    torch.manual_seed(len(pattern) + 3 * len(layout))
    q = torch.randn(3, 4, q_length, 16)
    k, v = (_strided(torch.randn(3, 2, kv_length, 16), how) for _ in range(2))
    with torch.no_grad():
        out, _ = fa2tune_hf.attention_forward(_Layer(), q, k, v, plan, scaling=0.3)
    assert calls == ["attention_varlen" if how == "odd_rows" else "flash_attn_with_kvcache"]
    want = _reference(q, k, v, masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False), 0.3)
    assert out.shape == (3, q_length, 4, 16)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_a_generation_step_with_a_gradient_to_come_gathers_for_the_backward(monkeypatch):
    padding, q_length, kv_length, q_offset = _step_layout("one_token")
    arguments = dict(batch_size=3, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=0,
                     mask_function=masking_utils.causal_mask_function, attention_mask=padding)  # fmt: skip
    plan = hf_masks.fa2tune_mask(**arguments)
    monkeypatch.setattr(fa2tune_hf, "flash_attn_with_kvcache", None)  # never called
    torch.manual_seed(6)
    q = torch.randn(3, 4, q_length, 16, requires_grad=True)
    k, v = torch.randn(3, 2, kv_length, 16), torch.randn(3, 2, kv_length, 16)
    out, _ = fa2tune_hf.attention_forward(_Layer(), q, k, v, plan, scaling=0.3)
    out.sum().backward()
    leaf = q.detach().double().requires_grad_()
    dense = masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False)
    _reference(leaf, k, v, dense, 0.3).sum().backward()
    torch.testing.assert_close(q.grad.double(), leaf.grad, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["batch_of_one", "storage_offset", "pages_past_int32"])
def test_a_generation_step_reads_in_place_at_the_view_s_edges(case, monkeypatch):
    # one batch row (no row stride to divide); K and V inside larger buffers (the views keep their storage offset);
    # page numbers past an int32 (here a lowered bound) gather instead
    padding, q_length, kv_length, q_offset = _step_layout("one_token")
    batch = 1 if case == "batch_of_one" else 3
    padding = padding[:batch].clone()
    padding[0, :4] = False
    arguments = dict(batch_size=batch, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=0,
                     mask_function=masking_utils.causal_mask_function, attention_mask=padding)  # fmt: skip
    plan = hf_masks.fa2tune_mask(**arguments)
    calls = []
    for name in ("attention_varlen", "flash_attn_with_kvcache"):
        real = getattr(fa2tune_hf, name)
        monkeypatch.setattr(fa2tune_hf, name, lambda *a, name=name, real=real, **kw: calls.append(name) or real(
            *a, **kw))  # fmt: skip
    if case == "pages_past_int32":
        monkeypatch.setattr(fa2tune_hf, "_MAX_PAGES", 2 * kv_length)
    torch.manual_seed(len(case))
    q = torch.randn(batch, 4, q_length, 16)
    if case == "storage_offset":  # rows 1..3 of a 5-row buffer, keys 2.. of a longer cache
        k, v = (torch.randn(batch + 2, 2, kv_length + 5, 16)[1 : 1 + batch, :, 2 : 2 + kv_length] for _ in range(2))
    else:
        k, v = torch.randn(batch, 2, kv_length, 16), torch.randn(batch, 2, kv_length, 16)
    with torch.no_grad():
        out, _ = fa2tune_hf.attention_forward(_Layer(), q, k, v, plan, scaling=0.3)
    assert calls == ["attention_varlen" if case == "pages_past_int32" else "flash_attn_with_kvcache"]
    want = _reference(q, k, v, masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False), 0.3)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_short_packed_sequences_in_inference_run_each_sequence_alone():
    # Sequences packed into one row (flash_attention_2's cu_seq_lens arguments) are not a padded batch's rows, however
    # few their tokens: they run as attention_varlen runs them, which checks their offsets
    torch.manual_seed(8)
    q, k, v = torch.randn(1, 4, 12, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        out, _ = fa2tune_hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                              max_length_q=7, max_length_k=7)  # fmt: skip
    sequence = torch.repeat_interleave(torch.arange(2), torch.tensor([5, 7]))
    dense = (sequence[:, None] == sequence[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(out.double(), _reference(q, k, v, dense[None, None], 0.3), atol=2e-5, rtol=2e-5)
    short = torch.tensor([0, 10], dtype=torch.int32)  # offsets that leave two tokens out
    with torch.no_grad(), pytest.raises(ValueError, match="cu_seqlens_q must end at the number of tokens"):
        fa2tune_hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3, cu_seq_lens_q=short, cu_seq_lens_k=short)


@pytest.mark.parametrize(
    ("shapes", "dtypes", "match"),
    [
        (((6, 16), (4, 16), (4, 16)), None, "multiple of k/v's heads"),
        (((4, 16), (2, 8), (2, 16)), None, "k's head_dim must equal q's"),
        (((4, 16), (2, 16), (2, 16)), (torch.float16, torch.float32), "share one dtype"),
    ],
    ids=["heads", "head_dim", "dtype"],
)
def test_a_generation_step_names_a_bad_input_as_attention_does(shapes, dtypes, match):
    padding, q_length, kv_length, q_offset = _step_layout("one_token")
    plan = hf_masks.fa2tune_mask(3, q_length, kv_length, q_offset, 0, masking_utils.causal_mask_function, padding)
    (hq, dq), (hk, dk), (hv, dv) = shapes
    q_dtype, kv_dtype = dtypes or (torch.float32, torch.float32)
    q = torch.randn(3, hq, q_length, dq, dtype=q_dtype)
    k, v = torch.randn(3, hk, kv_length, dk, dtype=kv_dtype), torch.randn(3, hv, kv_length, dv, dtype=kv_dtype)
    with torch.no_grad(), pytest.raises((ValueError, TypeError), match=match):
        fa2tune_hf.attention_forward(_Layer(), q, k, v, plan, scaling=0.3)


def test_flash_attention_2s_packed_sequence_arguments_run_each_sequence_alone():
    # cu_seq_lens_q/k and max_length_q/k (a flattening data collator's flash-attention arguments) with no mask built:
    # each packed sequence attends causally within itself, as under flash_attention_2.
    lengths = torch.tensor([7, 1, 12])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    out, _ = fa2tune_hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                          max_length_q=12, max_length_k=12)  # fmt: skip
    sequence = torch.repeat_interleave(torch.arange(3), lengths)
    dense = (sequence[:, None] == sequence[None, :]) & torch.ones(20, 20, dtype=torch.bool).tril()
    torch.testing.assert_close(out.double(), _reference(q, k, v, dense[None, None], 0.3), atol=2e-5, rtol=2e-5)


def test_the_window_of_a_sliding_window_mask_is_the_size_minus_one_to_the_left():
    # transformers' sliding_window counts the query's own key (q - w < kv <= q); fa2tune's window counts the keys
    # to its left, as flash_attn's window_size: (w - 1, 0). Bidirectional: |q - kv| <= w on either side, (w, w).
    found = hf_masks.recognize(masking_utils.sliding_window_causal_mask_function(7))
    assert found is not None and found[0].window() == (6, 0) and found[1] is None
    found = hf_masks.recognize(masking_utils.sliding_window_bidirectional_mask_function(7))
    assert found is not None and found[0].window() == (7, 7)
    chunked = masking_utils.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    assert hf_masks.recognize(chunked) is None
    assert hf_masks.recognize(lambda b, h, q, kv: kv <= q) is None  # unknown code: never guessed


# --- whole models -------------------------------------------------------------------------------------------------


def _model(kind: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                 attn_implementation="sdpa")  # fmt: skip
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    else:  # a sliding window shorter than the rows
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**sizes, sliding_window=5))
    return model.to(dtype).train()


def test_output_attentions_warns_at_the_line_that_asked():
    # fa2tune computes no attention weights: the warning says so at the user's line (the model's call, generate()),
    # not in fa2tune or transformers, whose frames in between vary by model and version
    model = _model("llama", torch.float32).eval()
    model.set_attn_implementation("fa2tune")
    input_ids = torch.randint(0, VOCAB, (1, 7))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids, output_attentions=True)  # the line each warning must name
        asked = [sys._getframe().f_lineno - 1]
        model.generate(input_ids, max_new_tokens=2, do_sample=False, output_attentions=True,
                       return_dict_in_generate=True)  # fmt: skip
        asked.append(sys._getframe().f_lineno - 2)
    ours = [w for w in caught if "no attention weights" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]
    assert {w.lineno for w in ours} == set(asked), ([w.lineno for w in ours], asked)


def _batch(length: int = 19) -> dict[str, torch.Tensor]:
    """Three rows: left-padded, right-padded, whole; padded positions labelled -100."""
    torch.manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (3, length))
    attention_mask = torch.ones(3, length, dtype=torch.long)
    attention_mask[0, :6] = 0
    attention_mask[1, length - 5 :] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _step(model, implementation: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(logits at the unpadded positions, loss, every parameter's gradient) of one training step."""
    model.set_attn_implementation(implementation)
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits[batch["attention_mask"].bool()].double(), out.loss.double(), grads


def _error(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_training_step_matches_sdpa_on_padded_rows(kind, dtype):
    # The same step under "sdpa" and "fa2tune", each measured against the model in float64 under "sdpa":
    # fa2tune's logits, loss and gradients may be off by a few times what SDPA's are, plus a per-dtype floor (in
    # bfloat16 fa2tune rounds P and dS to bfloat16 before their products, as FlashAttention does; the CPU's SDPA
    # keeps them in float32).
    model, batch = _model(kind, dtype), _batch()
    want = _step(copy.deepcopy(model).double(), "sdpa", batch)
    sdpa, ours = _step(model, "sdpa", batch), _step(model, "fa2tune", batch)
    floor = 1e-5 if dtype == torch.float32 else 5e-3
    assert _error(ours[0], want[0]) <= 4 * _error(sdpa[0], want[0]) + floor
    assert _error(ours[1], want[1]) <= 4 * _error(sdpa[1], want[1]) + floor
    assert want[2].keys() == ours[2].keys() and len(ours[2]) > 10
    for name, grad in want[2].items():
        assert _error(ours[2][name], grad) <= 4 * _error(sdpa[2][name], grad) + floor, name


def test_a_custom_name_without_the_mask_function_would_attend_to_padding():
    # Why register() adds a mask function: without one, transformers hands attention_mask=None to the attention
    # function, and the left-padded row's logits move. (The test above passing is what the mask function buys.)
    model, batch = _model("llama", torch.float32).eval(), _batch()
    transformers.AttentionInterface.register("fa2tune_no_mask", fa2tune_hf.attention_forward)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(**batch).logits
        model.set_attn_implementation("fa2tune_no_mask")
        got = model(**batch).logits
    left_padded = batch["attention_mask"][0].bool()
    assert (got[0, left_padded] - want[0, left_padded]).abs().max() > 1e-2


def test_packed_sequences_match_sdpa(monkeypatch):
    # Three sequences packed into one row by their position_ids (no padding mask), as padding-free training packs.
    # transformers finds packed sequences only without a cache (use_cache=False, as training runs): with one, every
    # backend attends across them, and agreeing with sdpa would prove nothing.
    model = _model("mistral", torch.float32).eval()
    lengths = (7, 9, 4)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    packed_calls = []
    run = fa2tune_hf._run
    monkeypatch.setattr(fa2tune_hf, "_run", lambda pattern, rows, *args: (packed_calls.append(rows), run(
        pattern, rows, *args))[1])  # fmt: skip
    logits = {}
    for implementation in ("sdpa", "fa2tune"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        if implementation == "sdpa":  # each sequence alone: what packing must give
            starts = torch.tensor((0, *lengths)).cumsum(0).tolist()
            with torch.no_grad():
                alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in itertools.pairwise(starts)], 1)
    assert packed_calls and all(rows is not None for rows in packed_calls), "fa2tune ran whole rows, not sequences"
    torch.testing.assert_close(logits["fa2tune"], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["fa2tune"], logits["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_from_left_padded_prompts_matches_sdpa(cache):
    # Greedy decoding through a cache (the sliding-window layers' too): prefill, then one query a step. A static
    # cache has slots past the tokens seen, and generate() builds its masks before each forward.
    model = _model("mistral", torch.float32).eval()
    prompt = _batch(11)  # rows 0 (left-padded) and 2
    prompt = dict(input_ids=prompt["input_ids"][0::2], attention_mask=prompt["attention_mask"][0::2])
    outputs = {}
    for implementation in ("sdpa", "fa2tune"):
        model.set_attn_implementation(implementation)
        outputs[implementation] = model.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                                 cache_implementation=cache, return_dict_in_generate=True,
                                                 output_logits=True)  # fmt: skip
    assert torch.equal(outputs["fa2tune"].sequences, outputs["sdpa"].sequences)
    for got, want in zip(outputs["fa2tune"].logits, outputs["sdpa"].logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_compiled_generation_step_reads_the_cache_in_place(monkeypatch):
    # transformers compiles a static cache's decode step; traced as an eager step runs, its padded rows would be
    # gathered into sizes that change every step (a new graph, and a new CUDA graph, each step). Given the 2-D
    # padding mask, the step's plan is built outside the graph and its attention runs in the graph on the plan's
    # fixed-size tensors (fa2tune::padded_step), reading the cache in place; the logits are SDPA's.
    model = _model("llama", torch.float32).eval()
    prompt = _batch(11)
    tables = []
    real = fa2tune_hf.flash_attn_with_kvcache
    monkeypatch.setattr(fa2tune_hf, "flash_attn_with_kvcache",
                        lambda *a, **kw: tables.append(kw["block_table"].shape) or real(*a, **kw))  # fmt: skip
    logits = {}
    for implementation in ("sdpa", "fa2tune"):
        torch._dynamo.reset()
        model.set_attn_implementation(implementation)
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        mask = prompt["attention_mask"]
        with torch.no_grad():
            out = model(**prompt, past_key_values=cache, cache_position=torch.arange(11))
            step = torch.compile(model.forward, backend="aot_eager")
            for position in (11, 12):
                token = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = step(input_ids=token, attention_mask=mask, past_key_values=cache,
                           cache_position=torch.tensor([position]))  # fmt: skip
        logits[implementation] = out.logits
    # every layer of both steps, each row's kept keys in a table as wide as the cache
    assert tables == [(3, 16)] * (2 * model.config.num_hidden_layers)
    torch.testing.assert_close(logits["fa2tune"], logits["sdpa"], atol=1e-5, rtol=1e-5)


# prompt rows (of _batch(11)) and padding: left-padded rows; a row whose padding stays inside mistral's window of 5
# for the first steps (its plan has rows, then whole rows once the padding leaves); a row with two padding tokens
# before its last prompt token, which the first step's window holds between tokens: fa2tune hands that mask to
# SDPA (a 4-D mask, SDPA's path in the graph)
GENERATE_CASES = {"left-padded": (slice(0, None, 2), None), "padding-in-window": (slice(0, 1), 7),
                  "gap-in-window": (slice(0, None, 2), None)}  # fmt: skip


@pytest.mark.parametrize("case", GENERATE_CASES)
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_generate_with_a_static_cache_compiles_without_breaks(model_type, case, monkeypatch):
    # generate() with a static cache builds each step's mask before the forward and compiles the forward
    # (fullgraph=True: a graph break raises). As many graphs serve the steps as serve SDPA's (a plan keeps its form
    # from step to step, whole rows or not); the sequences and logits are SDPA's.
    from torch._dynamo.utils import counters

    if case == "gap-in-window" and model_type == "llama":
        pytest.skip("without a window the gap is padding fa2tune runs; the 4-D case is mistral's")
    model = _model(model_type, torch.float32).eval()
    rows, left_pad = GENERATE_CASES[case]
    prompt = {name: t[rows].clone() for name, t in _batch(11).items()}
    if left_pad is not None:
        prompt["attention_mask"][:, :left_pad] = 0
    if case == "gap-in-window":
        prompt["attention_mask"][1, -3:-1] = 0
    steps = []
    real = fa2tune_hf.flash_attn_with_kvcache
    monkeypatch.setattr(fa2tune_hf, "flash_attn_with_kvcache", lambda *a, **kw: steps.append(1) or real(*a, **kw))
    outputs, graphs = {}, {}
    for implementation in ("sdpa", "fa2tune"):
        torch._dynamo.reset()
        counters.clear()
        model.set_attn_implementation(implementation)
        config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        config._compile_all_devices = True  # transformers compiles generation on accelerators only
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "fa2tune: .* is not a mask fa2tune runs", RuntimeWarning)
            outputs[implementation] = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                                     cache_implementation="static", compile_config=config,
                                                     return_dict_in_generate=True, output_logits=True)  # fmt: skip
        graphs[implementation] = counters["stats"]["unique_graphs"]
    # at most one graph more, where a step's mask went to SDPA (a 4-D mask, not a plan: a graph of its own)
    assert graphs["fa2tune"] <= graphs["sdpa"] + (case == "gap-in-window")
    # the steps after the prefill read the cache in place in every layer, but where the mask went to SDPA (the gap
    # case's first step; the next windows start at the padding, no longer between tokens)
    layers = model.config.num_hidden_layers
    assert len(steps) == (2 * layers if case == "gap-in-window" else 3 * layers)
    assert torch.equal(outputs["fa2tune"].sequences, outputs["sdpa"].sequences)
    for got, want in zip(outputs["fa2tune"].logits, outputs["sdpa"].logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_generation_under_inference_mode_matches_sdpa():
    # torch.inference_mode (as transformers' pipelines run): the padded prefill's offsets are inference tensors
    model = _model("llama", torch.float32).eval()
    prompt = _batch(11)
    outputs = {}
    for implementation in ("sdpa", "fa2tune"):
        model.set_attn_implementation(implementation)
        with torch.inference_mode():
            outputs[implementation] = model.generate(input_ids=prompt["input_ids"],
                                                     attention_mask=prompt["attention_mask"], max_new_tokens=2,
                                                     do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(outputs["fa2tune"], outputs["sdpa"])


# --- what fa2tune refuses -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        (dict(dropout=0.1), "attention dropout"),
        (dict(softcap=30.0), "soft-capping"),
        (dict(s_aux=torch.zeros(4)), "attention sinks"),
        (dict(position_bias=torch.zeros(1, 4, 5, 5)), "position bias"),
    ],
    ids=["dropout", "softcap", "s_aux", "position_bias"],
)
def test_what_fa2tune_does_not_compute_raises(arguments, match):
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(NotImplementedError, match=match):
        fa2tune_hf.attention_forward(_Layer(), q, k, v, None, **arguments)


def test_a_mask_of_the_wrong_kind_or_size_raises():
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="must be 4-D"):
        fa2tune_hf.attention_forward(_Layer(), q, k, v, torch.ones(1, 5, dtype=torch.bool))
    plan = hf_masks.fa2tune_mask(1, 6, 6, mask_function=masking_utils.causal_mask_function)
    with pytest.raises(ValueError, match="built for batch 1, 6 queries"):
        fa2tune_hf.attention_forward(_Layer(), q, k, v, plan)
    with pytest.raises(TypeError, match="attention_mask must be"):
        fa2tune_hf.attention_forward(_Layer(), q, k, v, "causal")


def test_register_is_idempotent_and_importing_the_module_imports_no_transformers():
    assert fa2tune_hf.register() == fa2tune_hf.register() == "fa2tune"
    assert transformers.AttentionInterface._global_mapping["fa2tune"] is fa2tune_hf.attention_forward
    assert masking_utils.AttentionMaskInterface._global_mapping["fa2tune"] is hf_masks.fa2tune_mask
    script = "import sys, fa2tune.integrations.transformers; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_register_names_the_install_when_transformers_is_missing_or_old(monkeypatch):
    real_import = fa2tune_hf.importlib.import_module

    def without_transformers(name, *args):
        if name.split(".")[0] == "transformers":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(fa2tune_hf.importlib, "import_module", without_transformers)
    with pytest.raises(ImportError, match=r"pip install 'fa2tune\[hf\]'"):
        fa2tune_hf.register()
    monkeypatch.setattr(fa2tune_hf.importlib, "import_module", real_import)
    # The module register() imports: sys.modules', which a model's step may have replaced since this file's import.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"needs transformers >= 5\.17 .*got 4\.57\.1"):
        fa2tune_hf.register()
