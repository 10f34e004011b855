"""tools/dist.py's manylinux step and package choice, and tools/index_check.py's report check, on small wheels
made here: shared libraries compiled with the system's C compiler, packed into a ``linux_x86_64`` wheel shaped like
toy-ggml's (an extension module that finds its own library through ``$ORIGIN``)."""

from __future__ import annotations

import base64
import ctypes
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="manylinux wheels are Linux wheels")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"toy_tool_{name}", ROOT / f"tools/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


dist = _load("dist")
index_check = _load("index_check")

DEP_C = "int dep_len(const char *s) { int n = 0; while (s[n]) n++; return n; }\n"
# ext_start calls pthread_create: glibc 2.34 moved it into libc under a new symbol version, so on a newer
# system the binary needs more than the oldest manylinux policy and the tag must say so
EXT_C = """#include <pthread.h>
#include <string.h>
int dep_len(const char *s);
int ext_twice(const char *s) { return dep_len(s) + (int)strlen(s); }
int ext_start(pthread_t *t, void *(*f)(void *)) { return pthread_create(t, 0, f, 0); }
"""


def _cc(tmp: Path, name: str, src: str, *flags: str) -> Path:
    (tmp / f"{name}.c").write_text(src)
    out = tmp / f"{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(out), str(tmp / f"{name}.c"), *flags], check=True)
    return out


def _wheel(folder: Path, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel of package ``pkg`` holding ``files`` (archive name -> bytes), tagged linux_x86_64."""
    tag = "cp311-cp311-linux_x86_64"
    info = "pkg-0.1.dist-info"
    files = {
        "pkg/__init__.py": b"",
        **files,
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 0.1\n"
        b"Description-Content-Type: text/plain\n\nA wheel made by a test.\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    path = folder / f"pkg-0.1-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def _needs_glibc(lib: Path) -> tuple[int, int]:
    """The newest GLIBC_x.y symbol version a library needs, read with binutils' objdump (not auditwheel)."""
    out = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True, check=True).stdout
    return max(((int(a), int(b)) for a, b in re.findall(r"GLIBC_(\d+)\.(\d+)", out)), default=(2, 5))


@pytest.fixture
def libs(tmp_path):
    if shutil.which("cc") is None or shutil.which("objdump") is None:
        pytest.skip("needs a C compiler and objdump (what building toy-ggml needs too)")
    build = tmp_path / "build"
    build.mkdir()
    dep = _cc(build, "libdep", DEP_C)
    ext = _cc(build, "ext", EXT_C, f"-L{build}", "-ldep", "-Wl,-rpath,$ORIGIN")  # toy-ggml's layout
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(dep, outside / "libdep.so")
    ext_out = _cc(build, "ext_out", EXT_C, f"-L{outside}", "-ldep", f"-Wl,-rpath,{outside}")  # finds it outside
    return {"dep": dep, "ext": ext, "ext_out": ext_out, "tmp": tmp_path}


def test_repair_retags_manylinux_without_grafting_what_the_wheel_ships(libs):
    tmp = libs["tmp"]
    whl = _wheel(tmp, {"pkg/ext.so": libs["ext"].read_bytes(), "pkg/libdep.so": libs["dep"].read_bytes()})
    r = dist.repair(whl, (), tmp / "aw.log", dict(os.environ))
    assert not whl.exists() and r.wheel.is_file() and r.wheel.parent == tmp
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", r.policy)
    assert m, r.policy
    # the tag promises the glibc the binaries need: at least the newest GLIBC version objdump sees
    assert (int(m.group(1)), int(m.group(2))) >= max(_needs_glibc(libs["ext"]), _needs_glibc(libs["dep"]))
    assert r.policy in r.wheel.name and r.grafted == []
    assert r.constraint.startswith("GLIBC ")
    with zipfile.ZipFile(r.wheel) as z:
        names = z.namelist()
        wheel_meta = z.read("pkg-0.1.dist-info/WHEEL").decode()
        z.extractall(tmp / "unpacked")
    assert not [n for n in names if ".libs/" in n], names
    assert f"Tag: cp311-cp311-{r.policy}" in wheel_meta
    # the repaired extension still finds the wheel's own libdep.so ($ORIGIN) and runs
    lib = ctypes.CDLL(str(tmp / "unpacked/pkg/ext.so"))
    lib.ext_twice.restype = ctypes.c_int
    assert lib.ext_twice(b"hello") == 10
    # and twine accepts it (what an index checks on upload)
    assert subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(r.wheel)]).returncode == 0


def test_repair_refuses_a_second_copy_of_a_shipped_library(libs):
    """An extension that finds libdep.so outside the wheel, in a wheel that ships libdep.so too: auditwheel
    would graft a renamed copy (two of the same library in one process); repair refuses."""
    tmp = libs["tmp"]
    whl = _wheel(tmp, {"pkg/ext.so": libs["ext_out"].read_bytes(), "pkg/libdep.so": libs["dep"].read_bytes()})
    with pytest.raises(dist.RepairError, match=r"second copy.*libdep"):
        dist.repair(whl, (), tmp / "aw.log", dict(os.environ))
    assert whl.is_file()  # the original is left as it was


def test_repair_leaves_out_excluded_libraries(libs):
    """The CUDA plugin's case: a library found at run time elsewhere (toy_ggml's libggml-base.so, NVIDIA's
    wheels) is excluded by soname pattern and not copied in, whether the build machine has it or not."""
    tmp = libs["tmp"]
    whl = _wheel(tmp, {"pkg/ext.so": libs["ext_out"].read_bytes()})
    r = dist.repair(whl, ("libde*.so",), tmp / "aw.log", dict(os.environ))
    assert r.grafted == [] and r.policy.startswith("manylinux_")
    assert "--exclude libde*.so" in (tmp / "aw.log").read_text()
    # the library nowhere to be found (as libggml-base.so is when the plugin's wheel is built): without the
    # exclusion auditwheel cannot make a manylinux wheel; with it, it can
    shutil.rmtree(tmp / "outside")
    again = tmp / "again"
    again.mkdir()
    whl = _wheel(again, {"pkg/ext.so": libs["ext_out"].read_bytes()})
    with pytest.raises(dist.RepairError, match="auditwheel repair failed"):
        dist.repair(whl, (), again / "aw.log", dict(os.environ))
    r = dist.repair(whl, ("libdep.so",), again / "aw.log", dict(os.environ))
    assert r.grafted == [] and r.policy in r.wheel.name


def test_repair_retags_a_wheel_without_extension_modules_py3_none(libs):
    """The CUDA plugin has compiled code but no Python extension module: one wheel for every Python 3."""
    tmp = libs["tmp"]
    whl = _wheel(tmp, {"pkg/libdep.so": libs["dep"].read_bytes(), "pkg/ext.so": libs["ext"].read_bytes()})
    r = dist.repair(whl, (), tmp / "aw.log", dict(os.environ), any_python=True)
    assert r.wheel.name == f"pkg-0.1-py3-none-{r.policy}.whl" and not whl.exists()
    with zipfile.ZipFile(r.wheel) as z:
        tags = re.findall(r"^Tag: (.+)$", z.read("pkg-0.1.dist-info/WHEEL").decode(), re.M)
        record = z.read("pkg-0.1.dist-info/RECORD").decode()
    assert tags == [f"py3-none-{r.policy}"]
    assert "pkg/libdep.so,sha256=" in record
    assert subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(r.wheel)]).returncode == 0
    # a wheel with an extension module is tied to its CPython: refused, the original kept
    whl = _wheel(tmp, {"pkg/_core.cpython-311-x86_64-linux-gnu.so": libs["dep"].read_bytes()})
    with pytest.raises(dist.RepairError, match="extension modules"):
        dist.repair(whl, (), tmp / "aw2.log", dict(os.environ), any_python=True)
    assert whl.is_file()
    assert dist.ANY_PYTHON == {"toy-ggml-cuda"}


def test_the_cuda_plugin_is_built_only_when_asked():
    every = ["toy-cli", "toy-core", "toy-ggml", "toy-ggml-cuda", "toy-serve", "toy-vit"]
    names, note = dist.select(every, [], cuda=False)
    assert "toy-ggml-cuda" not in names and len(names) == 5
    assert note and "toy-ggml-cuda" in note and "--cuda" in note
    assert dist.select(every, [], cuda=True) == (every[:3] + every[4:] + ["toy-ggml-cuda"], None)
    assert dist.select(every, ["toy-ggml-cuda"], cuda=False) == (["toy-ggml-cuda"], None)
    assert dist.select(every, ["toy-core"], cuda=False) == (["toy-core"], None)  # named: no line
    assert dist.select(every[:3] + every[4:], [], cuda=False)[1] is None  # no plugin folder: nothing to say
    # the plugin's excluded sonames: what it finds at run time outside its wheel
    ex = dist.EXCLUDE["toy-ggml-cuda"]
    assert {"libcudart.so.13", "libggml-base.so", "libcuda.so.1"} <= set(ex) and "libcublas*.so.13" in ex


def test_newest_symbol_versions():
    got = dist._newest_versions(
        {
            "libc.so.6": ["GLIBC_2.2.5", "GLIBC_2.14", "GLIBC_2.34"],
            "libstdc++.so.6": ["GLIBCXX_3.4.9", "GLIBCXX_3.4.30", "CXXABI_1.3"],
            "libm.so.6": ["GLIBC_2.29"],
        }
    )
    assert got == "CXXABI 1.3, GLIBC 2.34, GLIBCXX 3.4.30"  # 2.34 > 2.29 > 2.14 numerically, not as text
    assert dist._newest_versions({}) == "no versioned symbols"


def _report(tmp: Path, urls: dict[str, str]) -> Path:
    items = [{"metadata": {"name": n}, "download_info": {"url": u}} for n, u in urls.items()]
    items.append({"metadata": {"name": "numpy"}, "download_info": {"url": "https://files.example/numpy.whl"}})
    p = tmp / "report.json"
    p.write_text(json.dumps({"version": "1", "install": items}))
    return p


def test_index_check_reads_pips_report(tmp_path):
    index = "http://127.0.0.1:4321"
    many = "cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64"
    urls = {
        "toy-ggml": f"{index}/packages/toy_ggml-0.1.0-{many}.whl#sha256=00",
        "toy_core": f"{index}/packages/toy_core-0.1.0-{many}.whl",
        "toy-cli": f"{index}/packages/toy_cli-0.1.0-py3-none-any.whl",
        "toy-serve": f"{index}/packages/toy_serve-0.1.0-py3-none-any.whl",
        "Toy.Vit": f"{index}/packages/toy_vit-0.1.0-py3-none-any.whl",
    }
    assert len(index_check.check_report(_report(tmp_path, urls), index)) == 5
    bad = dict(urls, **{"toy-cli": "https://files.example/toy_cli-0.1.0-py3-none-any.whl"})
    with pytest.raises(index_check.CheckError, match="toy-cli came from https://files.example"):
        index_check.check_report(_report(tmp_path, bad), index)
    bad = dict(urls, **{"toy-ggml": f"{index}/packages/toy_ggml-0.1.0-cp311-cp311-linux_x86_64.whl"})
    with pytest.raises(index_check.CheckError, match="not manylinux-tagged"):
        index_check.check_report(_report(tmp_path, bad), index)
    bad = dict(urls, **{"toy-core": f"{index}/packages/toy_core-0.1.0.tar.gz"})
    with pytest.raises(index_check.CheckError, match="not a wheel"):
        index_check.check_report(_report(tmp_path, bad), index)
    bad = {k: v for k, v in urls.items() if k != "Toy.Vit"}
    with pytest.raises(index_check.CheckError, match="did not install toy-vit"):
        index_check.check_report(_report(tmp_path, bad), index)
    # a port that only starts like the index's is another index
    with pytest.raises(index_check.CheckError, match="not from the local index"):
        index_check.check_report(_report(tmp_path, urls), "http://127.0.0.1:432")
