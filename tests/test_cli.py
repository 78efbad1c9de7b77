"""The `pagedrs` command: kv-size figures exact, bad arguments rejected, the demo runs."""

from __future__ import annotations

import json

import pytest

from pagedrs.cli import main


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_kv_size_reproduces_the_llama_70b_figures(capsys):
    code, out, _ = run(capsys, ["kv-size", "--model", "llama-3.1-70b", "--tokens", "4096", "--seqs", "256", "--json"])
    assert code == 0
    assert json.loads(out) == {
        "bytes_per_token": 327_680,  # 2 x 80 layers x 8 kv heads x 128 x 2 bytes
        "bytes_per_sequence": 1_342_177_280,  # about 1.34 GB
        "total_bytes": 343_597_383_680,  # about 344 GB for 256 users
    }


@pytest.mark.parametrize(
    "model, per_token",
    [("llama-3.1-8b", 131_072), ("llama-3.1-405b", 516_096), ("mistral-7b", 131_072),
     ("qwen2.5-7b", 57_344), ("smollm2-135m", 23_040)],
)
def test_kv_size_presets(capsys, model, per_token):
    code, out, _ = run(capsys, ["kv-size", "--model", model, "--tokens", "10", "--json"])
    assert code == 0 and json.loads(out)["bytes_per_token"] == per_token


def test_kv_size_reads_a_config_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}))
    code, out, _ = run(capsys, ["kv-size", "--model", str(tmp_path), "--tokens", "3", "--dtype", "float32", "--json"])
    assert code == 0 and json.loads(out) == {"bytes_per_token": 2 * 4 * 2 * 32 * 4,
                                             "bytes_per_sequence": 3 * 2048, "total_bytes": 3 * 2048}


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--model", "no-such-model", "--tokens", "4"], "neither a preset"),
        (["--model", "llama-3.1-8b", "--tokens", "0"], "tokens is 0"),
        (["--model", "llama-3.1-8b", "--tokens", "4", "--dtype", "int3"], "dtype is 'int3'"),
    ],
)
def test_kv_size_bad_arguments_exit_nonzero(capsys, argv, fragment):
    code, _, err = run(capsys, ["kv-size", *argv])
    assert code != 0 and fragment in err


def test_demo_runs_shortened(capsys):
    from pagedrs.demo import run_demo

    report = run_demo(max_tokens=3, num_questions=3)
    text = capsys.readouterr().out
    assert "report:" in text and "What is the capital of France?" in text
    assert report["requests"] == 3 and report["generated_tokens"] >= 3
    # Three chats share the system prompt: the second and third hit its cached blocks.
    assert report["prefix_hits"] >= 2 * 4
    assert 0 < report["kv_utilization"] <= 1
    assert report["preemptions"] == 0


def test_chat_repl_answers_and_quits(tiny_llama_dir):
    """`pagedrs chat` reads lines from the terminal, answers each, and quits on an empty line."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pagedrs.cli", "chat", "--model", str(tiny_llama_dir), "--max-tokens", "4"],
        input="hello\nand again\n\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("bot> ") == 2


def test_generate_command_prints_the_greedy_completion(tiny_llama_dir, capsys):
    from pagedrs import LLM, SamplingParams

    code = main(["generate", "The quick brown fox", "--model", str(tiny_llama_dir), "--max-tokens", "5"])
    printed = capsys.readouterr().out.rstrip("\n")
    expected = LLM(model=str(tiny_llama_dir)).generate("The quick brown fox", SamplingParams(max_tokens=5, temperature=0.0),
                                                      use_tqdm=False)[0].outputs[0].text
    assert code == 0 and printed == expected


def test_kv_size_per_device_under_tensor_parallelism(capsys):
    """The seeds' scenario: Llama 3.1 70B in float16 on four 80 GB A100s, 256 users of 4096 tokens."""
    code, out, _ = run(capsys, ["kv-size", "--model", "llama-3.1-70b", "--tokens", "4096", "--seqs", "256",
                                "--tensor-parallel-size", "4", "--json"])
    assert code == 0
    t = json.loads(out)["tensor_parallel"]
    assert t["weights_bytes_per_device"] == int(70.6e9 * 2 / 4)  # 35.3 GB
    assert t["kv_bytes_per_token_per_device"] == 327_680 // 4  # 8 KV heads split 2 per device
    slots = int((80e9 * 0.9 - 70.6e9 * 2 / 4) // 81_920)
    assert t["token_slots"] == slots and t["sequences_paged"] == slots // 4096 == 109
    assert t["sequences_contiguous"] == slots // 8192
    assert t["kv_bytes_wanted"] > t["kv_bytes_available"]  # 344 GB wanted, 147 GB held: the host tier's job
