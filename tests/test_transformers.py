"""The transformers integration: a randomly initialised small Llama (no downloads) with attn_implementation="fagen"
against "sdpa": logits and one training step's gradients agree, with transformers' own right-padding mask."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")

import fagen.integrations.transformers as fagen_hf  # noqa: E402
from _env import DEVICE, ON_GPU  # noqa: E402

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = dict(atol=3e-2, rtol=3e-2) if ON_GPU else dict(atol=2e-4, rtol=2e-4)


def _models():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(copy.deepcopy(config)).to(DEVICE, DTYPE)
    sdpa = transformers.LlamaForCausalLM(copy.deepcopy(config)).to(DEVICE, DTYPE)  # a config each: the
    sdpa.load_state_dict(ours.state_dict())  # attention implementation is a field of the config
    ours.set_attn_implementation(fagen_hf.register())
    sdpa.set_attn_implementation("sdpa")
    assert (ours.config._attn_implementation, sdpa.config._attn_implementation) == ("fagen", "sdpa")
    return ours, sdpa


@pytest.mark.parametrize("padded", [False, True])
def test_logits_and_gradients_match_sdpa(padded):
    ours, sdpa = _models()
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 9:] = 0  # right padding: sequence 1 has 9 tokens
    logits = {}
    for name, model in (("fagen", ours), ("sdpa", sdpa)):
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        logits[name] = (out.logits, out.loss)
    valid = mask.bool()
    torch.testing.assert_close(logits["fagen"][0][valid], logits["sdpa"][0][valid], **TOL)
    torch.testing.assert_close(logits["fagen"][1], logits["sdpa"][1], **TOL)
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), sdpa.named_parameters()):
        scale = max(1.0, p_ref.grad.abs().max().item())
        torch.testing.assert_close(p.grad / scale, p_ref.grad / scale, **TOL, msg=lambda m: f"{name}: {m}")


def test_left_padding_is_a_clear_error():
    ours, _ = _models()
    ids = torch.randint(0, 97, (2, 8), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(fagen_hf.UnsupportedAttention, match="padding must be on the right"):
        ours(input_ids=ids, attention_mask=mask)


def _against_eager(cls, config):
    """Logits and every gradient (the sinks' included) of a small model, fagen against transformers' eager."""
    torch.manual_seed(0)
    ours = cls(copy.deepcopy(config)).to(DEVICE, DTYPE)
    eager = cls(copy.deepcopy(config)).to(DEVICE, DTYPE)
    eager.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(fagen_hf.register())
    eager.set_attn_implementation("eager")
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    logits = []
    for model in (ours, eager):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        logits.append(out.logits)
    torch.testing.assert_close(logits[0], logits[1], **TOL)
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), eager.named_parameters()):
        assert p.grad is not None, name
        scale = max(1.0, p_ref.grad.abs().max().item())
        torch.testing.assert_close(p.grad / scale, p_ref.grad / scale, **TOL, msg=lambda m: f"{name}: {m}")
    return ours


def test_gemma2_softcap_and_sliding_window_match_eager():
    config = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=2.0,
                                       query_pre_attn_scalar=16)
    _against_eager(transformers.Gemma2ForCausalLM, config)


def test_gpt_oss_sinks_and_sliding_window_match_eager():
    config = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, sliding_window=4, num_local_experts=4,
                                       num_experts_per_tok=2)
    model = _against_eager(transformers.GptOssForCausalLM, config)
    assert any(name.endswith("sinks") for name, _ in model.named_parameters())
