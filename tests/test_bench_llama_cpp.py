"""`pagedrs bench decode --llama-bench`: llama.cpp's llama-bench parsed, run and reported beside our rows.

llama.cpp is not built in `make test` (a cmake build of minutes); a fake ``llama-bench`` that prints
the real tool's JSON shape (captured from llama.cpp build 11434 on the embedded GGUF) stands in,
and checks the arguments it was given.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from pagedrs import bench
from pagedrs.bench.decode import _llama_cpp_note, _llama_cpp_rows
from pagedrs.bench.llama_cpp import gguf_of, parse_llama_bench, run_llama_bench


def _test(n_prompt: int, n_gen: int, ts: float) -> dict:
    return {"build_commit": "abc1234", "build_number": 11434, "model_type": "llama 256M Q4_1", "n_threads": 2,
            "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0, "avg_ts": ts, "stddev_ts": 1.5}


def _fake_llama_bench(tmp_path: Path, tests: list[dict], rc: int = 0) -> Path:
    """An executable that records its argv and prints ``tests`` as llama-bench's JSON."""
    script = tmp_path / "llama-bench"
    argv_file = tmp_path / "argv.json"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"open({str(argv_file)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"print({json.dumps(json.dumps(tests))})\n"
        f"sys.stderr.write('model failed to load\\n')\n"
        f"sys.exit({rc})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_parse_takes_the_prompt_and_generation_tests() -> None:
    r = parse_llama_bench(json.dumps([_test(32, 0, 363.3), _test(0, 64, 158.4)]))
    assert (r.prefill_tok_per_s, r.decode_tok_per_s, r.decode_stddev) == (363.3, 158.4, 1.5)
    assert r.build == "abc1234 (11434)"


@pytest.mark.parametrize("stdout", ["", "| model | size |", json.dumps([_test(32, 0, 1.0)]),
                                    json.dumps([_test(0, 64, 1.0), _test(0, 64, 2.0), _test(32, 0, 1.0)])])
def test_parse_refuses_what_is_not_one_prompt_and_one_generation_test(stdout: str) -> None:
    with pytest.raises(RuntimeError, match="llama-bench"):
        parse_llama_bench(stdout)


def test_run_passes_model_threads_and_lengths_and_no_gpu_layers(tmp_path: Path) -> None:
    fake = _fake_llama_bench(tmp_path, [_test(32, 0, 300.0), _test(0, 16, 120.0)])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    r = run_llama_bench(str(fake), gguf, threads=2, prompt=32, gen=16, repetitions=2)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv == ["-m", str(gguf), "-t", "2", "-p", "32", "-n", "16", "-r", "2", "-ngl", "0", "-o", "json"]
    assert r.decode_tok_per_s == 120.0 and str(fake) in r.command


def test_run_reports_the_tools_failure_with_its_stderr(tmp_path: Path) -> None:
    fake = _fake_llama_bench(tmp_path, [], rc=3)
    with pytest.raises(RuntimeError, match="exited 3: model failed to load"):
        run_llama_bench(str(fake), tmp_path / "m.gguf", threads=1, prompt=8, gen=8)
    with pytest.raises(FileNotFoundError, match="no such file"):
        run_llama_bench(str(tmp_path / "missing"), tmp_path / "m.gguf", threads=1, prompt=8, gen=8)


def test_only_a_gguf_model_can_be_compared(tmp_path: Path) -> None:
    assert gguf_of("smollm2-135m").suffix == ".gguf"  # the embedded preset resolves to its file
    with pytest.raises(ValueError, match="needs a GGUF model.*'/no/such/folder'"):
        gguf_of("/no/such/folder")


def test_rows_use_the_gguf_rows_bound_and_the_note_gives_ratios(tmp_path: Path, monkeypatch) -> None:
    from pagedrs.bench import engine_runner

    monkeypatch.setattr(engine_runner, "_BENCH_THREADS", 2)  # what `--threads 2` sets
    fake = _fake_llama_bench(tmp_path, [_test(32, 0, 300.0), _test(0, 16, 100.0)])
    ours = [{"weights": "gguf", "batch": 1, "prompt": 32, "decode_tok_per_s": 80.0, "weight_bytes": 100e6},
            {"weights": "int4", "batch": 1, "prompt": 32, "decode_tok_per_s": 60.0, "weight_bytes": 120e6},
            {"weights": "gguf", "batch": 16, "prompt": 32, "decode_tok_per_s": 900.0, "weight_bytes": 100e6}]
    lc = _llama_cpp_rows(str(fake), gguf_of("smollm2-135m"), (32,), 16, 20e9, ours)
    assert json.loads((tmp_path / "argv.json").read_text())[3] == "2"  # --threads
    (row,) = lc["rows"]
    assert row["stream_bound"] == pytest.approx(200.0) and row["ratio_to_bound"] == pytest.approx(0.5)
    note = _llama_cpp_note({"rows": ours + lc["rows"], "llama_cpp": lc})
    assert "gguf prompt 32: 0.80x" in note and "int4 prompt 32: 0.60x" in note and "2 threads" in note
    assert "900" not in note  # batch 16 has no llama.cpp row to compare with


@pytest.mark.parametrize("argv, message", [
    (["spec", "--weight-dtype", "gguf,int4"], "decode bench only"),
    (["serve", "--llama-bench", "/bin/true"], "decode bench only"),
])
def test_decode_only_options_are_refused_elsewhere(argv: list[str], message: str, capsys) -> None:
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["gguf,gguf", "q4", "int4,"])
def test_weight_dtype_list_names_each_allowed_format(value: str, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main(["decode", "--weight-dtype", value])
    assert "comma-separated" in capsys.readouterr().err


def test_each_system_gets_the_runs_threads_not_what_the_last_engine_left(monkeypatch) -> None:
    """A GGUF engine sets torch's pool to 1 thread; the next system of the run must still get --threads."""
    import torch

    from pagedrs.bench import engine_runner

    monkeypatch.setattr(engine_runner, "_BENCH_THREADS", 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what hand_cpu_threads_to_gemv leaves behind
        assert engine_runner.bench_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_wrong_model_or_binary_is_refused_before_the_grid_runs(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The grid takes minutes: a folder model or a missing / non-executable binary fails first."""
    fake = _fake_llama_bench(tmp_path, [])
    with pytest.raises(ValueError, match="needs a GGUF model"):
        bench.main(["decode", "--quick", "--model", str(tiny_llama_dir), "--llama-bench", str(fake)])
    with pytest.raises(FileNotFoundError, match="no such file"):
        bench.main(["decode", "--quick", "--llama-bench", str(tmp_path / "missing")])
    fake.chmod(0o644)
    with pytest.raises(PermissionError, match="not executable"):
        bench.main(["decode", "--quick", "--llama-bench", str(fake)])


def test_garbled_output_or_a_hang_is_a_clear_error(tmp_path: Path) -> None:
    """Output that is not UTF-8 (a wrong binary) is 'printed no JSON'; a binary that hangs is stopped."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    garbled = tmp_path / "garbled"
    garbled.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.buffer.write(b'\\xff\\xfe[{{')\n")
    garbled.chmod(0o755)
    with pytest.raises(RuntimeError, match="printed no JSON"):
        run_llama_bench(str(garbled), gguf, threads=1, prompt=8, gen=8)
    hang = tmp_path / "hang"
    hang.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    hang.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"ran past 0.5 s; stopped"):
        run_llama_bench(str(hang), gguf, threads=1, prompt=8, gen=8, timeout_s=0.5)
