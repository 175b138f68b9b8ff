"""flashcupy inside Hugging Face transformers models (tiny random configs, on the CPU here and
on the GPU where one is usable): logits, loss, gradients and greedy generation against the
library's own attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashcupy.integrations.transformers as flashcupy_hf  # noqa: E402

NAME = flashcupy_hf.register()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(kind: str, **extra):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, **extra)
        return transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    if kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=5, **extra)
        return transformers.MistralForCausalLM(config).to(DEVICE).eval()
    config = transformers.Gemma2Config(**common, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                       sliding_window=6, query_pre_attn_scalar=16, **extra)
    return transformers.Gemma2ForCausalLM(config).to(DEVICE).eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 14), generator=gen).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    return ids, mask


def _run(model, implementation: str):
    """Logits, the next-token loss over real tokens predicting real tokens, its gradients, and
    where the tokens are real. Pad queries see no real key: their rows are implementation
    defined (flashcupy: 0; eager: uniform), so neither their logits nor their predictions count."""
    model.set_attn_implementation(implementation)
    ids, mask = _batch()
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    pairs = real[:, :-1] & real[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][pairs], ids[:, 1:][pairs])
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return logits.detach(), loss.detach(), grads, real


@pytest.mark.parametrize("kind, reference", [("llama", "sdpa"), ("mistral", "sdpa"), ("gemma2", "eager")])
def test_logits_loss_and_gradients_match_the_library(kind, reference):
    model = _model(kind)
    logits, loss, grads, keep = _run(model, NAME)
    want_logits, want_loss, want_grads, _ = _run(model, reference)
    torch.testing.assert_close(logits[keep], want_logits[keep], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_generation_matches_sdpa(kind):
    model = _model(kind)
    ids, mask = _batch()
    tokens = {}
    for implementation in (NAME, "sdpa"):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                                do_sample=False, pad_token_id=0)
    assert torch.equal(tokens[NAME], tokens["sdpa"])


def test_register_refuses_flash_names():
    with pytest.raises(ValueError, match="without 'flash'"):
        flashcupy_hf.register("flashcupy")
    with pytest.raises(TypeError, match="name: expected a non-empty str"):
        flashcupy_hf.register("")
    assert NAME in transformers.AttentionInterface._global_mapping
    assert "flash" not in NAME


def test_gpt_oss_sinks_and_t5_position_bias_pass_through():
    """GPT-OSS hands its attention sinks over as s_aux, T5 its learned position bias as
    position_bias: both must reach the scores."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                       num_experts_per_tok=1, sliding_window=4, max_position_embeddings=64)
    model = transformers.GptOssForCausalLM(config).float().to(DEVICE).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    ids, _ = _batch()
    logits = {}
    for implementation in (NAME, "eager"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids).logits
    torch.testing.assert_close(logits[NAME], logits["eager"], rtol=1e-4, atol=1e-5)

    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64,
                                                                      num_layers=1, num_heads=4)).to(DEVICE).eval()
    decoder_ids = ids[:, :5]
    for implementation in (NAME, "sdpa"):
        t5.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = t5(input_ids=ids, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(logits[NAME], logits["sdpa"], rtol=1e-4, atol=1e-5)
