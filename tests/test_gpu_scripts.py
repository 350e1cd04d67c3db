"""The GPU validation scripts (scripts/cuda_smoke.py, cuda_error_probe.py, gpu_session.sh) stay
runnable where no GPU is: CI never has one, and a lent GPU machine's minutes must not go to a
broken script."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **kw):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, **kw)


def test_cuda_smoke_runs_on_the_cpu():
    """The smoke driver's calls and checks, run CPU against CPU (must pass)."""
    r = _run([sys.executable, "scripts/cuda_smoke.py", "--device", "cpu", "--small"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failure(s)" in r.stdout


def test_cuda_smoke_checks_can_fail():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import cuda_smoke
    finally:
        sys.path.pop(0)
    import torch
    cuda_smoke.FAILURES.clear()
    cuda_smoke.check("off", torch.ones(3) * 1.01, torch.ones(3), torch.float32)
    cuda_smoke.check("shape", torch.ones(3), torch.ones(2), torch.float32)
    cuda_smoke.check("nan", torch.full((2,), float("nan")), torch.ones(2), torch.float64)
    cuda_smoke.check_bitwise("bits", [torch.ones(2, dtype=torch.float64)], [torch.ones(2, dtype=torch.float64) + 1e-12])
    cuda_smoke.check("fine", torch.ones(3) * (1 + 1e-5), torch.ones(3), torch.float32)
    assert [f.split(":")[0] for f in cuda_smoke.FAILURES] == ["off", "shape", "nan", "bits"]
    cuda_smoke.FAILURES.clear()


def test_error_probe_runs_on_the_cpu():
    """scripts/cuda_error_probe.py (the gpu_session `errors` stage) on its GPU-free cases: the
    op's and the contraction compiler's argument errors arrive as Python exceptions."""
    r = _run([sys.executable, "scripts/cuda_error_probe.py", "--cpu-only"])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(line.endswith(": raised") for line in lines), r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash script")
def test_gpu_session_refuses_unknown_stages(tmp_path):
    r = _run(["bash", "scripts/gpu_session.sh", "smoke", "no-such-stage"],
             env={**os.environ, "PYTHON": sys.executable, "LOGDIR": str(tmp_path / "logs")})
    assert r.returncode == 2
    assert "unknown stage: no-such-stage" in r.stderr
    assert not (tmp_path / "logs" / "smoke.log").exists()  # nothing ran


def test_gpu_session_returns_each_stages_summary(tmp_path):
    """The device tool returns what $OUT holds when a call ends, also when it is cut off at its
    limit: summary.txt and the last stage's log go there after every stage, not only at the end.
    (A python that fails stands in for the GPU machine's: the stage fails, its record stays.)"""
    out = tmp_path / "out"
    out.mkdir()
    r = _run(["bash", "scripts/gpu_session.sh", "smoke"],
             env={**os.environ, "PYTHON": "false", "LOGDIR": str(tmp_path / "logs"), "OUT": str(out)})
    assert r.returncode == 1, r.stdout + r.stderr  # one failed stage
    assert "smoke        rc=1" in (out / "summary.txt").read_text()
    assert "== smoke: false scripts/cuda_smoke.py" in (out / "last_stage.log").read_text()
    assert (out / "logs.tar.gz").exists() and (tmp_path / "logs.tar.gz").exists()
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "logs/smoke.log" in tar.getnames()


def test_gpu_session_is_valid_bash():
    assert _run(["bash", "-n", "scripts/gpu_session.sh"]).returncode == 0


def test_tensornet_benchmark_runs_as_the_gpu_stages_call_it(tmp_path):
    """benchmarks/tensornet_sliced.py with --device (the bench-tn-* stages pass cuda), on one
    quick configuration: every implementation gives a result, the achieved FLOP/s and the
    same-run matmul reference."""
    out = tmp_path / "tn.json"
    r = _run([sys.executable, "benchmarks/tensornet_sliced.py", "--device", "cpu", "--quick", "--only", "lattice",
              "--match", "256 KiB", "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["machine"]["device"] == "cpu" and data["machine"]["matmul_flops_per_s"]["float32"] > 0
    assert sorted(x["impl"] for x in data["results"]) == ["cotengra", "ours"]
    for x in data["results"]:
        assert "error" not in x, x
        assert x["spec"]["device"] == "cpu" and x["flops_per_s"] > 0 and x["peak_bytes"] > 0
    assert len(data["summary"]) == 1 and len(data["summary"][0]["matmul_fraction"]) == 2


@pytest.mark.parametrize("gone", [False, True])
@pytest.mark.parametrize("explicit", [True, False])
def test_libstdcxx_link_check_tells_the_links_apart(tmp_path, explicit, gone):
    """scripts/libstdcxx_link_check.py (the gpu_session `build` stage) relinks a logged link
    command with and without the explicit libstdc++.so.6: on a stand-in module linked with
    -static-libstdc++, without the path it must see a copy, with it none (exit status 1 when
    the command as built carries one). When the logged objects are gone (an editable install
    builds in a temporary folder), it links its own stand-in object with the logged flags."""
    import shutil
    cxx = shutil.which("c++")
    if cxx is None or shutil.which("nm") is None or shutil.which("readelf") is None:
        pytest.skip("needs a C++ compiler and binutils")
    src = tmp_path / "f.cpp"
    src.write_text('#include <sstream>\n#include <string>\n'
                   'std::string f(long n) { std::ostringstream s; s << n; return s.str(); }\n')
    obj = tmp_path / ("gone.o" if gone else "f.o")
    if not gone:
        subprocess.run([cxx, "-c", "-fPIC", str(src), "-o", str(obj)], check=True)
    so6 = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    line = f"{cxx} -shared {obj} -static-libstdc++ -o {tmp_path}/_C.cpython-312-x86_64-linux-gnu.so"
    log = tmp_path / "build.log"
    log.write_text("building\n  " + line + (f" -fopenmp {os.path.realpath(so6)}" if explicit else "") + "\ndone\n")
    r = _run([sys.executable, "scripts/libstdcxx_link_check.py", str(log)])
    lines = r.stdout.splitlines()
    assert r.returncode == (0 if explicit else 1), r.stdout + r.stderr
    assert lines[0].startswith("the logged objects are gone") == gone, lines
    lines = lines[1:] if gone else lines
    assert lines[0].startswith("as built") and lines[1].startswith("without the explicit")
    assert lines[0].endswith("True; libstdc++ symbols defined: 0") == explicit, lines
    assert not lines[1].endswith("defined: 0"), lines  # -static-libstdc++ alone pulls in a copy
