"""The compiled module links libstdc++ the way torch does: the shared libstdc++.so.6, no copy of
its own. A static copy mixed with the shared one crashed the process (SIGSEGV) on the first error
message that formats a number (the GPU machine, 2026-11-27; setup.py's _shared_libstdcxx)."""
import importlib.util
import shutil
import subprocess

import pytest

import torch_gradops  # noqa: F401  (loads the compiled module, as users do)

MODULE = importlib.util.find_spec("torch_gradops._C").origin  # the compiled module's file

# mangled-name prefixes of libstdc++'s own (non-template) classes: std::locale, std::ios_base,
# std::codecvt, and the explicitly instantiated ostream inserters. A module that defines any of
# them carries libstdc++'s archive code.
LIBSTDCXX_OWN = ("_ZNSt6locale", "_ZNKSt6locale", "_ZNSt8ios_base", "_ZNKSt7codecvt", "_ZNSo9_M_insert")


def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (binutils) is not installed")
    return path


def _needed(path):
    out = subprocess.run([_tool("readelf"), "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def _libstdcxx_copies(path):
    """libstdc++'s own symbols that the shared object ``path`` defines."""
    nm = _tool("nm")
    defined = []
    for flags in (["--defined-only"], ["-D", "--defined-only"]):  # the symbol table, or the dynamic one if stripped
        out = subprocess.run([nm, *flags, path], capture_output=True, text=True).stdout
        defined += [line.split()[-1] for line in out.splitlines() if len(line.split()) == 3]
    assert defined, f"nm listed no symbols of {path}"
    return sorted({s for s in defined if s.startswith(LIBSTDCXX_OWN)})


def test_extension_needs_the_shared_libstdcxx():
    assert "libstdc++.so.6" in _needed(MODULE)


def test_extension_carries_no_copy_of_libstdcxx():
    own = _libstdcxx_copies(MODULE)
    assert not own, f"{len(own)} libstdc++ symbols defined in {MODULE}, e.g. {own[:5]}"


@pytest.mark.parametrize("static", [False, True])
def test_the_checks_tell_a_static_copy(tmp_path, static):
    """The two checks above on a three-line library that formats a number, linked with and without
    -static-libstdc++: they must tell the two apart."""
    cxx = shutil.which("c++") or pytest.skip("no C++ compiler")
    src = tmp_path / "f.cpp"
    src.write_text('#include <sstream>\n#include <string>\n'
                   'std::string f(long n) { std::ostringstream s; s << n; return s.str(); }\n')
    lib = tmp_path / "libf.so"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(lib)] + (["-static-libstdc++"] if static else []),
                   check=True)
    assert bool(_libstdcxx_copies(str(lib))) == static
    assert ("libstdc++.so.6" in _needed(str(lib))) != static
