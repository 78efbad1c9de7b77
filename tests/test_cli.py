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


# Engine flags: one definition shared by generate, chat and serve (cli_args.py).

_ENGINE_ARGV = [
    "--model", "m", "--device", "cpu", "--dtype", "bfloat16", "--weight-dtype", "int8", "--block-size", "8",
    "--num-gpu-blocks", "64", "--kv-cache-memory", "1000000", "--gpu-memory-utilization", "0.5",
    "--swap-space-gb", "2", "--max-num-seqs", "7", "--max-num-batched-tokens", "333", "--max-model-len", "99",
    "--allow-long-max-model-len", "--preemption-mode", "swap", "--admission-policy", "prompt_only", "--no-prefill-first", "--kv-layout", "contiguous",
    "--no-prefix-caching", "--cpu-threads", "3", "--tensor-parallel-size", "2", "--kv-host-cache-gb", "0.5",
    "--kv-disk-path", "/tmp/x", "--kv-disk-gb", "1.5",
]


def _offline_kwargs(command, argv):
    from pagedrs.cli import build_parser
    from pagedrs.cli_args import engine_kwargs

    return engine_kwargs(build_parser().parse_args([command, *(["p"] if command == "generate" else []), *argv]))


def _serve_kwargs(argv):
    from pagedrs.server.cli import build_parser, engine_kwargs

    return engine_kwargs(build_parser().parse_args(argv))


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_offline_commands_and_serve_map_every_engine_flag_alike(command):
    offline = _offline_kwargs(command, _ENGINE_ARGV)
    served = _serve_kwargs(_ENGINE_ARGV)
    assert {k: v for k, v in served.items() if k not in ("seed", "skip_tokenizer_init")} == offline
    assert offline["admission_policy"] == "prompt_only" and offline["prefill_first"] is False
    assert offline["enable_prefix_caching"] is False and offline["max_num_batched_tokens"] == 333
    assert offline["allow_long_max_model_len"] is True and _serve_kwargs([])["allow_long_max_model_len"] is False


def test_every_engine_field_has_a_flag_or_is_an_api_only_knob():
    """A new EngineArgs field must get a flag (or be listed here as API-only on purpose)."""
    import dataclasses

    from pagedrs.engine_args import EngineArgs

    # pad_decode: the padded decode path without CUDA graphs, a testing knob (graphs turn it on by themselves)
    api_only = {"watermark", "aging_steps", "max_n", "contiguous_reserve", "host_cache_evicted", "pad_decode"}
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(_serve_kwargs([])) | api_only == fields
    assert set(_offline_kwargs("generate", [])) | api_only | {"prefill_first", "seed", "skip_tokenizer_init"} == fields


def test_unset_flags_take_engine_args_defaults_and_serve_keeps_its_own():
    import dataclasses

    from pagedrs.engine_args import EngineArgs

    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    offline = _offline_kwargs("generate", [])
    assert offline == {k: defaults[k] for k in offline}
    assert "prefill_first" not in offline  # the field's default (off) applies offline
    served = _serve_kwargs([])
    assert served["prefill_first"] is True and served["cpu_threads"] >= 1  # serve on the CPU: prefill first, every core
    assert _serve_kwargs(["--device", "cuda"])["prefill_first"] is False


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("argv, fragment", [
    (["--max-num-seqs", "-3"], "max_num_seqs is -3"),
    (["--kv-disk-gb", "nan"], "kv_disk_gb is nan"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
])
def test_offline_commands_refuse_a_bad_engine_value_before_loading(capsys, command, argv, fragment):
    with pytest.raises(SystemExit) as exc:
        main([command, *(["p"] if command == "generate" else []), "--model", "/nonexistent/model", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"pagedrs {command}: error: " in err and fragment in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_offline_commands_refuse_a_max_model_len_past_the_model_without_a_traceback(capsys, monkeypatch,
                                                                                   tiny_llama_dir, command):
    """Only the loaded model knows its context length, so this refusal comes after the load: exit 2
    naming the field and how to allow it, not a traceback."""
    monkeypatch.delenv("PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    argv = [command, *(["p"] if command == "generate" else []), "--model", str(tiny_llama_dir), "--max-model-len", "999"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"pagedrs {command}: cannot start the engine: max_model_len is 999" in err and "--allow-long-max-model-len" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, fragment", [(["--max-tokens", "-3"], "SamplingParams.max_tokens=-3"),
                                            (["--temperature", "nan"], "SamplingParams.temperature=nan")])
def test_generate_refuses_a_bad_sampling_value_before_loading(capsys, argv, fragment):
    """A traceback before; now exit 2 naming the value, with no model loaded (the path does not exist)."""
    assert main(["generate", "p", "--model", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err
    assert "pagedrs generate: error: " in err and fragment in err and "Traceback" not in err


@pytest.mark.parametrize("argv, fragment", [
    (["", "--max-tokens", "3"], "the prompt is empty"),
    (["ab " * 400, "--max-tokens", "3"], "max_model_len is"),
    (["\udced", "--max-tokens", "3"], "not valid Unicode text"),  # argv that is not UTF-8 (surrogateescape)
    (["hi", "--num-gpu-blocks", "1", "--max-tokens", "100"], "the pool holds 1 blocks"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_generate_refuses_a_request_the_engine_refuses_without_a_traceback(tiny_llama_dir, capsys, argv, fragment,
                                                                           stream):
    """What only the loaded engine refuses (a black-box probe's finds): a traceback and exit 1 before; now
    exit 2 and one line naming the reason."""
    extra = ["--stream"] if stream else []
    assert main(["generate", *argv[:1], "--model", str(tiny_llama_dir), *argv[1:], *extra]) == 2
    err = capsys.readouterr().err
    assert "pagedrs generate: error: " in err and fragment in err and "Traceback" not in err


def test_chat_outlives_a_history_past_max_model_len_and_a_turn_the_engine_refuses(tiny_llama_dir):
    """The session died with a traceback on the turn whose history outgrew max_model_len, on one message
    too long alone, and on a turn the pool could never hold; the conversation was lost. Now the oldest turns
    go (said), a too-long message is refused (said), and the session goes on to answer the next line."""
    import subprocess
    import sys

    def chat(lines: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pagedrs.cli", "chat", "--model", str(tiny_llama_dir), *flags],
                              input=lines, capture_output=True, text=True, timeout=180)

    grown = chat("hello there\nhow are you doing\ntell me more\nand more\n\n", "--max-tokens", "20",
                 "--max-model-len", "64")
    assert grown.returncode == 0 and "Traceback" not in grown.stderr, grown.stderr[-2000:]
    assert "the oldest 1 turn(s) were dropped" in grown.stdout and grown.stdout.count("bot> ") == 4
    long = chat("ab " * 200 + "\nhi\n\n", "--max-tokens", "3")
    assert long.returncode == 0 and "max_model_len is 256: send a shorter one" in long.stdout
    assert long.stdout.count("bot> ") == 1  # the next line is answered
    small = chat("hello\nagain\n\n", "--num-gpu-blocks", "1")
    assert small.returncode == 0 and small.stdout.count("[this turn failed: ") == 2, small.stdout[-2000:]
    # a byte the terminal cannot decode (a lone surrogate in the line): a TypeError from the tokenizers
    # library ended the session
    raw = subprocess.run([sys.executable, "-m", "pagedrs.cli", "chat", "--model", str(tiny_llama_dir), "--max-tokens",
                          "3"], input=b"a\xffb\nhi\n\n", capture_output=True, timeout=180)
    out = raw.stdout.decode("utf-8", "replace")
    assert raw.returncode == 0 and b"Traceback" not in raw.stderr, raw.stderr[-2000:]
    assert "[your message was refused: the text is not valid Unicode" in out and out.count("bot> ") == 1
