"""HF model directories (config.json + *.safetensors + tokenizer.json) through
the same architecture code, vs HF transformers on the same directory; and the
tokenizer.json wrapper vs `tokenizers` / transformers."""

import json

import pytest
import torch

from imp.text.hf_tokenizer import HFTokenizer
from imp.model.runner import ModelRunner
from imp.text.tokenizer import IncrementalDetokenizer
from tests.test_model_archs import check, hf_steps, run_steps

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\r\n",
    "naïve café, 東京タワー, 😀👩‍👩‍👧 and 1234567 numbers",
    "   leading spaces\t\ttabs\n\n\nnewlines",
    "<|im_start|>user typed this<|im_end|>",
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE trained on the corpus, saved the way transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(CORPUS * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    d = tmp_path_factory.mktemp("hfdir")
    fast.save_pretrained(d)
    return d, fast


def test_hf_tokenizer_matches_transformers(tok_dir):
    d, fast = tok_dir
    tok = HFTokenizer.from_dir(d)
    assert tok.vocab_size == len(fast)
    assert tok.eos_id == fast.eos_token_id and tok.eos_id in tok.eos_ids
    for text in CORPUS:
        ids = tok.encode(text)
        ref = fast(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert ids == ref, text
        assert tok.decode(ids) == text
        # streamed one id at a time: no U+FFFD for split characters, same text at the end
        det = IncrementalDetokenizer(tok)
        parts = [det.push([i]) for i in ids] + [det.flush()]
        assert "".join(parts) == text and all("\ufffd" not in p for p in parts)
    # control tokens only from trusted text
    lit = tok.encode("<|im_start|>")
    assert tok.bos_id not in lit and len(lit) > 1
    assert tok.encode("<|im_start|>", parse_special=True) == [tok.bos_id]
    assert tok.encode_chat([("<|im_start|>user\n", True), ("<|im_end|>", False)])[0] == tok.bos_id
    assert tok.is_special(tok.eos_id) and tok.id_to_piece(tok.eos_id) == "<|im_end|>"


def _tiny(model_type, vocab):
    from transformers import AutoConfig

    extra = dict(
        llama={},
        qwen2=dict(),
        qwen3=dict(head_dim=32),
        gemma3_text=dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"]),
    )[model_type]
    return AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        **extra)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_hf_dir_matches_transformers(tok_dir, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    src, fast = tok_dir
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny(model_type, len(fast)), dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits norms to 1 (gemma: 0) and biases to 0: make them matter
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    prompt = HFTokenizer.from_dir(tmp_path).encode(CORPUS[0])
    steps = hf_steps(model, prompt)
    r = ModelRunner.load(str(tmp_path), num_blocks=64, block_size=4, weights="f32")
    assert r.config.arch == model_type.removesuffix("_text")
    check(steps, run_steps(r, steps, list(range(16))), 1e-3, label=model_type)
    r8 = ModelRunner.load(str(tmp_path), num_blocks=64, block_size=4)  # default int8
    check(steps, run_steps(r8, steps, list(range(16))), 0.5, tie_margin=0.1, label=model_type)
    assert r.metadata["tokenizer.chat_template"] == CHATML
    assert r.fingerprint == ModelRunner.load(str(tmp_path), num_blocks=4).fingerprint


def test_load_engine_picks_hf_tokenizer_for_dir(tok_dir, tmp_path):
    from imp.config import ServerConfig
    from imp.server import load_engine

    src, fast = tok_dir
    torch.manual_seed(0)
    model_cfg = _tiny("llama", len(fast))
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(model_cfg).save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    _, tm = load_engine(ServerConfig(model=str(tmp_path), kv_cache_tokens=256))
    assert isinstance(tm.tokenizer, HFTokenizer)
    assert tm.tokenizer.eos_ids == {0, 2}
    text = tm.template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
