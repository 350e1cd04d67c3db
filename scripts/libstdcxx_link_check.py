"""Does this machine's default link put a copy of libstdc++ into the extension?

    python scripts/libstdcxx_link_check.py BUILD_LOG

Reads the link command of ``torch_gradops/_C*.so`` from a verbose build log (``pip install -v``
or ``setup.py build_ext``), and links twice into a temporary folder with that command's linker,
flags and libraries: as the command stands (setup.py adds the shared ``libstdc++.so.6`` by its
path, ``_shared_libstdcxx``) and without that path, as the build did before. It links the
logged objects where they still exist; an editable install builds in a temporary folder that is
gone afterwards, and then a stand-in object that formats a number into an ``ostringstream`` (what
crashed) takes their place. For each link it prints whether the result needs ``libstdc++.so.6``
and how many of libstdc++'s own symbols it defines (:func:`inspect`, also what
tests/test_build.py checks of the built module). On the GPU machine an argument error crashed
with SIGSEGV in libstdc++ code that the backtrace placed inside the module; a default link with
copies there confirms the cause. Exit status 0 when the command as built carries no copy.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile

# mangled-name prefixes of libstdc++'s own (non-template) classes: std::locale, std::ios_base,
# std::codecvt, and the explicitly instantiated ostream inserters. A module that defines any of
# them carries libstdc++'s archive code.
LIBSTDCXX_OWN = ("_ZNSt6locale", "_ZNKSt6locale", "_ZNSt8ios_base", "_ZNKSt7codecvt", "_ZNSo9_M_insert")


def link_command(log: str) -> list:
    """The last command line in ``log`` that links a shared ``_C*.so``."""
    found = [line for line in log.splitlines() if " -shared " in line and re.search(r"-o \S*_C[^/\s]*\.so", line)]
    if not found:
        raise SystemExit("no link command of _C*.so in the log (build with pip install -v)")
    return shlex.split(found[-1].strip())


def inspect(path: str) -> tuple:
    """(needs libstdc++.so.6, number of libstdc++'s own symbols defined) of a shared object."""
    dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    needs = "[libstdc++.so.6]" in dyn
    defined = set()
    for flags in (["--defined-only"], ["-D", "--defined-only"]):
        out = subprocess.run(["nm", *flags, path], capture_output=True, text=True).stdout
        defined |= {f[-1] for f in (line.split() for line in out.splitlines()) if len(f) == 3}
    return needs, sum(s.startswith(LIBSTDCXX_OWN) for s in defined)


STAND_IN = """#include <sstream>
#include <string>
std::string torch_gradops_stand_in(long n) { std::ostringstream s; s << "got " << n; return s.str(); }
"""


def with_stand_in(cmd: list, tmp: str) -> list:
    """``cmd`` with its object files replaced by one stand-in object compiled by its own driver."""
    src, obj = os.path.join(tmp, "stand_in.cpp"), os.path.join(tmp, "stand_in.o")
    with open(src, "w") as f:
        f.write(STAND_IN)
    subprocess.run([cmd[0], "-c", "-fPIC", "-O2", src, "-o", obj], check=True)
    first = next(i for i, a in enumerate(cmd) if a.endswith(".o"))
    return cmd[:first] + [obj] + [a for a in cmd[first:] if not a.endswith(".o")]


def main() -> int:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    cmd = link_command(open(sys.argv[1], errors="replace").read())
    explicit = [a for a in cmd if re.search(r"/libstdc\+\+\.so[.\d]*$", a)]
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        objects = [a for a in cmd if a.endswith(".o")]
        if not all(os.path.exists(a) for a in objects):
            print(f"the logged objects are gone ({len(objects)}, e.g. {objects[0] if objects else '-'}): "
                  "linking a stand-in object with the logged command's linker, flags and libraries")
            cmd = with_stand_in(cmd, tmp)
        for name, drop in (("as built", []), ("without the explicit libstdc++.so.6", explicit)):
            argv = [a for a in cmd if a not in drop]
            out_at = argv.index("-o") + 1
            argv[out_at] = os.path.join(tmp, "_C.so")
            r = subprocess.run(argv, capture_output=True, text=True)
            if r.returncode:
                print(f"{name}: link failed: {r.stderr.strip()[-500:]}")
                status = status or 2
                continue
            needs, copies = inspect(argv[out_at])
            print(f"{name:38s} needs libstdc++.so.6: {needs}; libstdc++ symbols defined: {copies}")
            if name == "as built" and (copies or not needs):
                status = 1
    print("explicit path in the link command:", explicit or "none")
    return status


if __name__ == "__main__":
    sys.exit(main())
