"""The command line (``python -m flashcupy info|check|precompile|bench``) and
:func:`flashcupy.precompile`, on any machine: GPU-less behaviour is forced where it
matters, and the precompile machinery runs against a fake device and compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flashcupy
import flashcupy.__main__ as cli
from flashcupy import interop
from flashcupy.cuda.spec import ARCH_SMEM, EVERY_OPTION, PLAIN, ScoreSet, select_backward, select_forward
from flashcupy.precompile import RECORD_NAME, kernels_for, load_records, record_path

PRECOMPILE = sys.modules["flashcupy.precompile"]  # the module; flashcupy.precompile is the function
PACKAGE_PARENT = str(Path(flashcupy.__file__).resolve().parent.parent)


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m flashcupy args`` on the flashcupy these tests import."""
    environ = {**os.environ, **(env or {})}
    extra = [environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else []
    environ["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT, *extra])
    return subprocess.run([sys.executable, "-m", "flashcupy", *args], capture_output=True, text=True, env=environ,
                          cwd=cwd, timeout=300)


# --------------------------------------------------------------------------- errors

BAD_ARGUMENTS = [
    ([], "the following arguments are required: COMMAND"),
    (["nope"], "invalid choice: 'nope'"),
    (["demo", "--D", "600"], "argument --D: expected an int in 1..512, received '600'"),
    (["demo", "--D", "0"], "argument --D: expected an int in 1..512, received '0'"),
    (["demo", "--L", "0"], "argument --L: expected a positive int, received '0'"),
    (["demo", "--L", "abc"], "argument --L: expected a positive int, received 'abc'"),
    (["demo", "--heads", "-2"], "argument --heads: expected a positive int, received '-2'"),
    (["demo", "--batch", "1.5"], "argument --batch: expected a positive int, received '1.5'"),
    (["demo", "--repeats", "0"], "argument --repeats: expected a positive int, received '0'"),
    (["demo", "--seed", "-1"], "argument --seed: expected an int >= 0, received '-1'"),
    (["demo", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
    (["check", "--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    (["check", "--bogus"], "unrecognized arguments: --bogus"),
    (["precompile", "--dtypes", "float8"], "argument --dtypes: invalid choice: 'float8'"),
    (["precompile", "--head-dims", "513"], "argument --head-dims: expected an int in 1..512, received '513'"),
    (["precompile", "--workers", "0"], "argument --workers: expected a positive int, received '0'"),
    (["precompile", "--device", "-1"], "argument --device: expected an int >= 0, received '-1'"),
    (["explain"], "the following arguments are required: --shape"),
    (["explain", "--shape", "2,0,64"], "argument --shape: expected a shape such as 2,16,4096,128, received '2,0,64'"),
    (["explain", "--shape", "2,8,64,64", "--window", "3,x"], "argument --window: expected LEFT,RIGHT"),
    (["explain", "--shape", "2,8,64,64", "--arch", "hopper"], "arch: expected a compute capability"),
    (["explain", "--shape", "2,8,64,600", "--arch", "90"], "q: expected a head dim in 1..512, received 600"),
    (["explain", "--shape", "2,8,64,64", "--kv-shape", "2,3,64,64", "--arch", "90"], "k: expected a number of heads dividing q's 8"),
    (["explain", "--shape", "1,1,64,512", "--dtype", "float64", "--arch", "80"],
     "no float64 backward kernel for padded head dim 512 fits"),  # no tile fits that GPU: not a traceback
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) or "none" for a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_and_exit_status_2(argv, message, capsys) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("python -m flashcupy") and ": error: " in captured.err
    assert message in captured.err


def test_explain_prints_the_kernels_and_rules_without_a_gpu() -> None:
    result = run_cli("explain", "--shape", "2,16,4096,128", "--arch", "sm_90", "--causal", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    forward = select_forward("bfloat16", 128, 128, 90, ARCH_SMEM[90])
    backward = select_backward("bfloat16", 128, 128, 90, ARCH_SMEM[90])
    assert forward.name_expression in result.stdout and backward.dkdv_name in result.stdout
    assert "rule 'wgmma16-overlap'" in result.stdout and "rule 'wgmma16'" in result.stdout
    result = run_cli("explain", "--shape", "1,8,300,64", "--kv-shape", "1,2,500,64", "--arch", "80", "--bias", "--mask",
                     "--alibi", "--softcap", "30", "--dropout", "0.1", "--window", "16,none", "--lengths",
                     "--dtype", "float32", "--deterministic")
    assert result.returncode == 0, result.stderr
    assert "ScoreMods: softcap, bias (float32), alibi, mask, dropout" in result.stdout and "dQ by its own kernel" in result.stdout and "sm_80" in result.stdout


def test_bad_arguments_never_print_a_traceback() -> None:
    # The issue's own example, as a user runs it: one line on stderr, exit status 2.
    result = run_cli("demo", "--D", "600")
    assert result.returncode == 2
    assert result.stderr == ("python -m flashcupy demo: error: argument --D: expected an int in 1..512, "
                             "received '600' (see python -m flashcupy demo --help)\n")
    assert result.stdout == ""


def test_demo_too_large_for_the_reference_is_a_usage_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "available_memory", lambda: 2**30)
    assert cli.main(["demo", "--L", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m flashcupy demo: error: --L 4096 --batch 2 --heads 8: the dense float64 "
                          "reference the demo checks against needs about 14.0 GiB, 1.0 GiB are available")
    assert err.count("\n") == 1


def test_checked_problem_turns_library_errors_into_usage_errors() -> None:
    pb = cli.checked_problem([(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)], np.dtype(np.float16), {"causal": True})
    assert (pb.num_heads_q, pb.num_heads_k, pb.causal) == (4, 2, "bottom_right")
    with pytest.raises(cli.UsageError, match=r"^k: expected a number of heads dividing q's 4 \(GQA/MQA\), received 3"):
        cli.checked_problem([(4, 8, 16), (3, 8, 16), (3, 8, 16)], np.dtype(np.float32), {})
    with pytest.raises(cli.UsageError, match=r"^window: expected"):
        cli.checked_problem([(4, 8, 16)] * 3, np.dtype(np.float32), {"window": (-1, 0)})


# --------------------------------------------------------------------------- demo


def test_demo_says_why_the_gpu_was_not_used(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "cuda_backend_available", lambda: False)
    monkeypatch.setattr(cli, "_gpus", lambda: ([], "CuPy is not installed"))
    assert cli.main(["demo", "--L", "32", "--heads", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("backend: cpu, because the GPU cannot be used: CuPy is not installed "
                      "(pip install 'flashcupy[cuda12]' or '[cuda13]' for the GPU backend)")
    assert out[-1] == "PASS"


def test_demo_without_a_gpu_names_the_backend_and_the_reason() -> None:
    result = run_cli("demo", "--L", "64", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    backend = result.stdout.splitlines()[1]
    if interop.gpu_usable():
        assert backend.startswith("backend: cuda (")
    else:
        assert backend.startswith("backend: cpu, because the GPU cannot be used: ")
        assert any(why in backend for why in ("CuPy is not installed", "NVIDIA driver", "no usable CUDA GPU"))


def test_demo_falls_back_to_the_cpu_when_no_kernel_fits(monkeypatch, capsys) -> None:
    """On a GPU whose shared memory no kernel of this head dim fits, the demo says so and runs on the CPU."""
    from types import SimpleNamespace

    from flashcupy.cuda.spec import NoKernelError

    fake_cupy = SimpleNamespace(asarray=np.asarray,
                                cuda=SimpleNamespace(get_current_stream=lambda: SimpleNamespace(synchronize=lambda: None)))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(cli, "_gpu_name", lambda: "Small GPU")
    real = flashcupy.flash_attention

    def attention(q, k, v, *, backend, **options):
        if backend == "cuda":
            raise NoKernelError("no float64 kernel for head dims (512, 512) fits this GPU's 48 KiB")
        return real(q, k, v, backend=backend, **options)

    monkeypatch.setattr(flashcupy, "flash_attention", attention)
    assert cli.main(["demo", "--dtype", "float64", "--D", "512", "--L", "16", "--heads", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "backend: cuda (Small GPU)"
    assert out[2] == ("backend: cpu instead, because no CUDA kernel fits: no float64 kernel for head dims "
                      "(512, 512) fits this GPU's 48 KiB")
    assert out[-1] == "PASS"


# --------------------------------------------------------------------------- info


def test_info_runs_and_names_the_kernel_path_of_each_dtype(tmp_path) -> None:
    result = run_cli("info", env={"CUPY_CACHE_DIR": str(tmp_path)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"flashcupy {flashcupy.__version__}" in out
    for label in ("NumPy", "SciPy", "ml_dtypes", "CuPy", "source hash", "CuPy kernel cache", str(tmp_path)):
        assert label in out, label
    for dtype in ("float16", "bfloat16", "float32", "float64", "float32 allow_tf32"):
        assert f"  {dtype} " in out, dtype
    if interop.gpu_usable():
        assert "mma16" in out or "simt" in out
    else:
        assert "cpu backend" in out
    assert "compile times: none recorded" in out


def test_info_json_has_every_fact() -> None:
    data = cli.collect_info()
    assert json.loads(json.dumps(data)) == data
    for key in ("flashcupy", "python", "numpy", "scipy", "ml_dtypes", "cupy", "cuda_runtime", "cuda_driver", "nvrtc",
                "gpus", "kernel_dir", "kernel_source_hash", "kernel_cache_dir", "kernel_cache_mib", "kernel_paths",
                "compile_records"):
        assert key in data, key
    assert len(data["kernel_paths"]) == 5


def test_kernel_paths_per_architecture() -> None:
    assert set(cli.kernel_paths(None).values()) == {"cpu backend"}
    paths = cli.kernel_paths(90)
    assert paths["float16"].startswith("mma16") and paths["bfloat16"].startswith("mma16")
    assert paths["float32"].startswith("tf32x3") and paths["float32 allow_tf32"].startswith("tf32:")
    assert paths["float64"].startswith("dmma")
    assert "wgmma_tf32x3" in paths["float32"] and "wgmma_tf32x3" not in cli.kernel_paths(80)["float32"]
    assert {p.split(":")[0] for p in cli.kernel_paths(75).values()} == {"simt"}


# --------------------------------------------------------------------------- check


def test_check_passes() -> None:
    result = run_cli("check")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    cases = [line for line in lines if line.startswith(("PASS  ", "FAIL  "))]
    assert len(cases) == len(cli.check_cases()) and all(line.startswith("PASS") for line in cases)
    assert lines[-1] == "PASS"
    for word in ("float16", "bfloat16", "float32", "float64", "causal", "mask", "bias", "dropout", "GQA", "varlen"):
        assert any(word in line for line in cases), word


def test_check_fails_on_a_wrong_result(monkeypatch, capsys) -> None:
    forward = flashcupy.flash_attention_forward

    def off_by_a_little(q, k, v, **options):
        out, lse = forward(q, k, v, **options)
        if q.dtype == np.float64:
            out = out + 1e-8  # above the 1e-9 bar of float64, far below the other dtypes' bounds
        return out, lse

    monkeypatch.setattr(flashcupy, "flash_attention_forward", off_by_a_little)
    assert cli.main(["check", "--backend", "cpu", "--verbose"]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL  ")]
    assert fails and all("float64" in line for line in fails)
    assert out.splitlines()[-1] == "FAIL"


def test_check_reports_a_raising_case_as_a_failure(monkeypatch, capsys) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(flashcupy, "flash_attention_backward", broken)
    assert cli.main(["check", "--backend", "cpu"]) == 1
    assert "RuntimeError: kernel exploded" in capsys.readouterr().out


def test_check_cuda_without_a_gpu_is_an_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "cuda_backend_available", lambda: False)
    monkeypatch.setattr(cli, "_gpus", lambda: ([], "CuPy is not installed"))
    assert cli.main(["check", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("python -m flashcupy check: error: --backend cuda: CuPy is not installed (pip install")


def test_check_says_why_the_gpu_was_not_used(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "cuda_backend_available", lambda: False)
    first = cli.check_cases()[:1]
    monkeypatch.setattr(cli, "check_cases", lambda: first)
    monkeypatch.setattr(cli, "_gpus", lambda: ([], "CUDARuntimeError: cudaErrorInsufficientDriver: too old"))
    assert cli.main(["check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("backend: cpu, because the GPU cannot be used: CuPy found no NVIDIA driver, or one older "
                        "than its CUDA runtime (CUDARuntimeError: cudaErrorInsufficientDriver: too old)")
    assert cli.main(["check", "--backend", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "backend: cpu, as asked (--backend cpu)"


# --------------------------------------------------------------------------- precompile


def test_precompile_without_a_gpu_raises(monkeypatch) -> None:
    monkeypatch.setattr(interop, "gpu_usable", lambda: False)
    with pytest.raises(RuntimeError, match="needs a usable CUDA GPU"):
        flashcupy.precompile()


@pytest.mark.skipif(interop.gpu_usable(), reason="a GPU is usable here")
def test_precompile_command_without_a_gpu_exits_1() -> None:
    result = run_cli("precompile", "--dtypes", "float16")
    assert result.returncode == 1
    assert "needs a usable CUDA GPU" in result.stderr


@pytest.mark.parametrize("kwargs", [{"dtypes": ("float8",)}, {"dtypes": (np.int32,)}, {"head_dims": (0,)},
                                    {"head_dims": (513,)}, {"head_dims": (64.0,)}, {"workers": 0}])
def test_precompile_rejects_bad_arguments(kwargs) -> None:
    with pytest.raises(ValueError):
        flashcupy.precompile(**kwargs)


def test_precompile_is_exported() -> None:
    assert "precompile" in flashcupy.__all__ and callable(flashcupy.precompile)


def test_kernels_for_covers_the_option_sets_asked_for() -> None:
    arch, smem = 90, ARCH_SMEM[90]
    kernels = kernels_for(["float16", "float32"], [64], arch, smem, options=[(), ("bias",), ("dropout", "mask")])
    names = {k.name for k in kernels}
    for dtype in ("float16", "float32"):
        for scores in (PLAIN, ScoreSet(("bias",), dtype), ScoreSet(("mask", "dropout"))):
            assert select_forward(dtype, 64, 64, arch, smem, scores=scores).name_expression in names
            assert select_backward(dtype, 64, 64, arch, smem, scores=scores).dkdv_name in names
    with pytest.raises(ValueError, match="options: expected option names among .* received 'bais'"):
        kernels_for(["float16"], [64], arch, smem, options=[("bais",)])


def test_kernels_for_lists_both_forward_variants_and_the_backward() -> None:
    arch, smem = 90, ARCH_SMEM[90]
    kernels = kernels_for(["float16", "float64"], [64, 128], arch, smem)
    names = {k.name for k in kernels}
    assert len(names) == len(kernels)
    for dtype in ("float16", "float64"):
        for d in (64, 128):
            assert select_forward(dtype, d, d, arch, smem, scores=PLAIN).name_expression in names
            assert select_forward(dtype, d, d, arch, smem, scores=EVERY_OPTION).name_expression not in names
            spec = select_backward(dtype, d, d, arch, smem)
            assert {spec.delta_name, spec.dq_name, spec.dkdv_name} <= names
    assert {k.family for k in kernels} == {"forward", "backward"}
    assert {k.family for k in kernels_for(["float32"], [64], arch, smem, backward=False)} == {"forward"}
    # allow_tf32 changes the float32 kernels only
    assert kernels_for(["float32"], [64], arch, smem, allow_tf32=True) != kernels_for(["float32"], [64], arch, smem)
    assert kernels_for(["float16"], [64], arch, smem, allow_tf32=True) == kernels_for(["float16"], [64], arch, smem)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """precompile on a pretend sm_90 device whose compiler records its calls; CuPy's
    cache directory in tmp_path."""
    import flashcupy.cuda.compile as cc

    calls = []
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(interop, "gpu_usable", lambda: True)
    monkeypatch.setattr(PRECOMPILE, "_device_info", lambda device: (device or 0, "Fake GPU", 90, ARCH_SMEM[90]))
    monkeypatch.setattr(cc, "get_function", lambda family, name, device_id, smem=0: calls.append(
        (family, name, device_id, smem)))
    return calls


def test_precompile_compiles_what_calls_select_and_records_the_times(fake_gpu, capsys) -> None:
    times = flashcupy.precompile(dtypes=("float16", "float64"), head_dims=(64,), progress=True)
    expected = kernels_for(["float16", "float64"], [64], 90, ARCH_SMEM[90])
    assert sorted(times) == sorted(k.name for k in expected)
    assert sorted(fake_gpu) == sorted((k.family, k.name, 0, k.smem_bytes) for k in expected)
    assert all(t >= 0 for t in times.values())
    assert f"{len(expected)}/{len(expected)}" in capsys.readouterr().err  # the counter, or tqdm's bar
    assert record_path().name == RECORD_NAME and record_path().is_file()
    record = load_records()["Fake GPU sm_90"]
    assert set(record["kernels"]) == set(times) and record["arch"] == 90
    # a second call for other dtypes adds to the record of the same sources
    more = flashcupy.precompile(dtypes=("float32",), head_dims=(128,), backward=False, device=0, progress=False)
    assert set(load_records()["Fake GPU sm_90"]["kernels"]) == set(times) | set(more)
    assert capsys.readouterr().err == ""
    info = run_cli("info", env={"CUPY_CACHE_DIR": os.environ["CUPY_CACHE_DIR"]})
    assert info.returncode == 0 and "compile times recorded by precompile" in info.stdout
    assert "Fake GPU sm_90" in info.stdout


def test_precompile_command_prints_the_times(fake_gpu, capsys) -> None:
    assert cli.main(["precompile", "--dtypes", "bfloat16", "--head-dims", "96", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"compiled {len(fake_gpu)} kernels") and str(record_path()) in out


def test_an_unreadable_record_counts_as_none(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    (tmp_path / RECORD_NAME).write_text("{not json")
    assert load_records() == {}


# --------------------------------------------------------------------------- bench


def test_find_bench_script(tmp_path) -> None:
    assert cli.find_bench_script([tmp_path]) is None
    script = tmp_path / "bench" / "bench_attention.py"
    script.parent.mkdir()
    script.write_text("")
    assert cli.find_bench_script([tmp_path / "nowhere", tmp_path]) == script


def test_bench_without_the_script_says_how_to_get_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "find_bench_script", lambda roots=None, relative=None: None)
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "clone the flashcupy repository" in err


def test_bench_passes_its_arguments_through(monkeypatch, tmp_path, capfd) -> None:
    script = tmp_path / "bench" / "bench_attention.py"
    script.parent.mkdir()
    script.write_text("import sys\nprint('ARGS', sys.argv[1:])\nsys.exit(3)\n")
    monkeypatch.setattr(cli, "find_bench_script", lambda roots=None, relative=None: script)
    assert cli.main(["bench", "--dtypes", "float16", "--help"]) == 3
    assert "ARGS ['--dtypes', 'float16', '--help']" in capfd.readouterr().out


def test_precompile_skips_what_no_kernel_of_the_gpu_serves(fake_gpu, monkeypatch) -> None:
    monkeypatch.setattr(PRECOMPILE, "_device_info", lambda device: (0, "Small GPU", 75, 48 * 1024))
    skipped: list[str] = []
    kernels = kernels_for(["float64"], [64, 512], 75, 48 * 1024, skipped=skipped)
    assert skipped and all("float64" in reason for reason in skipped)
    with pytest.warns(RuntimeWarning, match="CPU backend"):
        times = flashcupy.precompile(dtypes=["float64"], head_dims=[64, 512], progress=False)
    assert sorted(times) == sorted(k.name for k in kernels)
