"""The CUDA backend plugin (toy-ggml-cuda): finding it, loading it, and what happens when that fails.

Every test here but the last group runs in CI, where the plugin is not built: a fake ``toy_ggml_cuda``
package (on PYTHONPATH of a child process, since toy_ggml loads plugins once, at import) whose library
cannot be loaded shows that the failure is recorded with the loader's reason, that ``toy devices`` shows
it, and that the CPU path computes as before. The last group checks the real plugin when ``just cuda``
has installed it: it loads, finds no device on a machine without a GPU, and its library has the run
path and dependencies the wheel promises (compared with ``readelf -d``, an independent reader).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg
from toy_ggml import _dispatch

HERE = Path(__file__).resolve().parent
BUILD_GGML = HERE.parent / "build_tools" / "build_ggml.py"
RPATH = "$ORIGIN:$ORIGIN/../nvidia/cu13/lib"
NOT_ELF = b"this is not a shared library, and longer than an ELF header would be.\n" * 4

# In the child: the plugins toy_ggml recorded, the devices, and a small op on the CPU runtime (a matrix
# product and a sum), whose values the parent compares with NumPy.
PROBE = """
import json, sys
import numpy as np
import toy_ggml as tg
a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
b = np.arange(8, dtype=np.float32).reshape(2, 4) / 5
with tg.Runtime("auto", threads=1) as rt, tg.Context(max_tensors=16) as ctx:
    ta = ctx.tensor(tg.GGMLType.F32, a.shape)
    tb = ctx.tensor(tg.GGMLType.F32, b.shape)
    out = ctx.mul_mat(ta, tb)
    g = tg.Graph(ctx).build_forward(out)
    ctx.allocate(rt)
    ta.set(a)
    tb.set(b)
    rt.compute(g)
    got = out.numpy().tolist()
    device = rt.device
print(json.dumps({"plugins": [p.to_dict() for p in tg.plugins()], "devices": [d.name for d in tg.devices()],
                  "device": device, "mul_mat": got}))
"""


def _build_ggml():
    spec = importlib.util.spec_from_file_location("toy_build_ggml", BUILD_GGML)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env(extra_path: Path | None = None, **kv: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TOY_GGML_CUDA"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(extra_path), env.get("PYTHONPATH", "")) if x)
    env.update(kv)
    return env


def _probe(env: dict[str, str]) -> tuple[dict, str]:
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def _stamp_info() -> dict:
    """build-info.json as the plugin built from toy_ggml's own ggml source would carry it."""
    stamp = getattr(tg.build_config, "_STAMP", None)
    if isinstance(stamp, dict):
        patches = [dict(p) for p in stamp["patches"]]  # copies: tests change them
    else:
        patches = [{"name": n, "sha256": None} for n in tg.build_config.PATCHES]
    return {
        "archs": ["89"],
        "cuda_version": "13.0",
        "no_vmm": True,
        "ggml_version": tg.build_config.GGML_VERSION,
        "source": tg.build_config.SOURCE,
        "patches": patches,
    }


def _fake_plugin(root: Path, library: bytes | Path, info: dict | None = None) -> Path:
    pkg = root / "toy_ggml_cuda"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('toy_ggml must not import the plugin package')\n")
    if isinstance(library, Path):
        shutil.copy(library, pkg / "libggml-cuda.so")
    else:
        (pkg / "libggml-cuda.so").write_bytes(library)
    (pkg / "build-info.json").write_text(json.dumps(info if info is not None else _stamp_info()))
    return pkg / "libggml-cuda.so"


def _expected_mul_mat() -> list:
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    b = np.arange(8, dtype=np.float32).reshape(2, 4) / 5
    return (b @ a.T).tolist()  # ggml's mul_mat(a, b): rows of b against rows of a


def _assert_cpu_unchanged(out: dict) -> None:
    assert out["devices"] == [d.name for d in tg.devices() if d.backend != "CUDA"]
    assert out["device"] == "CPU"
    np.testing.assert_allclose(out["mul_mat"], _expected_mul_mat(), rtol=1e-6)


# --- (a) the loader, with fake plugins (CI) ---------------------------------------


def test_a_library_that_is_not_elf_is_recorded_and_the_cpu_runs_as_before(tmp_path):
    lib = _fake_plugin(tmp_path, NOT_ELF)
    out, err = _probe(_env(tmp_path))
    (p,) = out["plugins"]
    assert p["name"] == "toy-ggml-cuda" and p["path"] == str(lib)
    assert p["loaded"] is False and p["devices"] == [] and p["backend"] is None
    assert p["reason"].startswith("cannot open it: ") and "invalid ELF header" in p["reason"], p["reason"]
    assert p["archs"] == ["89"] and p["cuda_version"] == "13.0"  # read from build-info.json
    _assert_cpu_unchanged(out)
    # logged once, as a warning of the toy_ggml logger; nothing else on stderr (no ggml error line)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "toy-ggml-cuda" in lines[0] and "invalid ELF header" in lines[0], err


def test_a_library_whose_cuda_runtime_is_missing_says_which_wheel(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to make an ELF library with a missing dependency")
    # a stand-in for libcudart.so.13 (under a name no system has) to link against, removed before the plugin is loaded
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    (stub_dir / "cudart.c").write_text("int toy_cudart_stub(void) { return 13; }\n")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-Wl,-soname,libcudart_toytest.so.13", "-o", str(stub_dir / "libcudart_toytest.so.13"),
         str(stub_dir / "cudart.c")],
        check=True,
    )  # fmt: skip
    (stub_dir / "mod.c").write_text("int toy_cudart_stub(void);\nint toy_mod(void) { return toy_cudart_stub(); }\n")
    built = stub_dir / "libmod.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(built), str(stub_dir / "mod.c"), str(stub_dir / "libcudart_toytest.so.13")],
        check=True,
    )
    root = tmp_path / "site"
    _fake_plugin(root, built)
    shutil.rmtree(stub_dir)
    out, err = _probe(_env(root))
    (p,) = out["plugins"]
    assert p["loaded"] is False
    assert "libcudart_toytest.so.13: cannot open shared object file" in p["reason"], p["reason"]
    assert "nvidia-cuda-runtime" in p["reason"]
    _assert_cpu_unchanged(out)
    assert "libcudart_toytest.so.13" in err and len([ln for ln in err.splitlines() if ln.strip()]) == 1, err


def test_toy_ggml_cuda_0_skips_the_plugin_quietly(tmp_path):
    lib = _fake_plugin(tmp_path, b"not loaded at all\n")
    out, err = _probe(_env(tmp_path, TOY_GGML_CUDA="0"))
    (p,) = out["plugins"]
    assert (p["path"], p["loaded"], p["reason"]) == (str(lib), False, "skipped: TOY_GGML_CUDA=0")
    _assert_cpu_unchanged(out)
    assert err.strip() == ""  # an info line: not on stderr


def test_a_plugin_built_from_another_ggml_is_not_loaded(tmp_path):
    info = _stamp_info()
    dropped = info["patches"].pop()["name"]
    info["patches"].append({"name": "9999-elsewhere.patch", "sha256": "0" * 64})
    _fake_plugin(tmp_path, b"never opened\n", info)
    out, _ = _probe(_env(tmp_path))
    (p,) = out["plugins"]
    assert p["loaded"] is False
    assert "built from another ggml source" in p["reason"]
    assert f"patches it lacks: {dropped}" in p["reason"] and "patches only it has: 9999-elsewhere.patch" in p["reason"]
    assert "cannot open" not in p["reason"]  # the library was not opened
    _assert_cpu_unchanged(out)


def test_a_plugin_without_its_build_record_is_not_loaded(tmp_path):
    lib = _fake_plugin(tmp_path, b"never opened\n")
    (lib.parent / "build-info.json").unlink()
    out, _ = _probe(_env(tmp_path))
    (p,) = out["plugins"]
    assert p["loaded"] is False and "cannot read its build-info.json" in p["reason"]


def test_toy_devices_shows_the_plugin_and_its_reason(tmp_path):
    lib = _fake_plugin(tmp_path, NOT_ELF)
    env = _env(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "toy_cli", "devices", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    (plug,) = json.loads(p.stdout)["plugins"]
    assert plug["name"] == "toy-ggml-cuda" and plug["path"] == str(lib) and plug["loaded"] is False
    assert "invalid ELF header" in plug["reason"]
    p = subprocess.run(
        [sys.executable, "-m", "toy_cli", "devices"], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert f"plugin toy-ggml-cuda ({lib}, built for sm 89, CUDA 13.0): not loaded: cannot open it:" in p.stderr


def test_not_installed_is_a_reason_too(monkeypatch):
    monkeypatch.setattr(_dispatch, "_plugin_folder", lambda package: None)
    p = _dispatch._load_cuda_plugin(Path(tg.cpu_variant().path).parent)
    assert (p.name, p.path, p.loaded) == ("toy-ggml-cuda", None, False)
    assert p.reason.startswith("not installed (pip install 'toy-cli[cuda]'")


def test_device_cuda_names_the_first_cuda_device_or_says_why_there_is_none():
    cuda = [d.name for d in tg.devices() if d.backend == "CUDA"]
    assert tg.device_name("cpu") == "cpu" and tg.device_name("auto") == "auto"
    if cuda:
        assert tg.device_name("cuda") == cuda[0] == "CUDA0"
        assert tg.device_name("CUDA") == cuda[0]
    else:
        plugin = tg.plugins()[0]
        with pytest.raises(ValueError, match="device 'cuda': there is no CUDA device") as e:
            tg.device_name("cuda")
        assert plugin.reason in str(e.value)
        with pytest.raises(ValueError, match="device 'cuda': there is no CUDA device"):
            tg.resolve_device("cuda")
    assert tg.device_name("cuda1") == "cuda1"  # a device's own name goes to Runtime as given


# --- the build script's CUDA mode (CI: no nvcc run) --------------------------------


def test_the_cuda_cmake_line_is_the_reference_one(tmp_path):
    """The CMake line of docs/reference/build.md ("The CUDA plugin"), which build/cuda/ggml-cmake was
    configured with by hand: a folder configured with it is reused, not configured again."""
    bg = _build_ggml()
    cu = tmp_path / "nvidia" / "cu13"
    inc = tmp_path / "cublas-include"
    got = bg.cuda_plugin_defines("80;86;89;90", cu, inc, "ccache")
    want = {
        "GGML_BUILD_TESTS": "OFF", "GGML_BUILD_EXAMPLES": "OFF", "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "ON", "GGML_BACKEND_DL": "ON", "GGML_NATIVE": "OFF", "GGML_CPU_ALL_VARIANTS": "OFF",
        "GGML_CPU_VARIANTS": "", "GGML_CUDA": "ON", "GGML_CUDA_NO_VMM": "ON", "GGML_CUDA_NCCL": "OFF",
        "GGML_RPC": "OFF", "GGML_OPENMP": "OFF", "GGML_LLAMAFILE": "ON", "GGML_CCACHE": "OFF",
        "CMAKE_CUDA_ARCHITECTURES": "80;86;89;90", "CMAKE_CUDA_COMPILER_LAUNCHER": "ccache",
        "CMAKE_C_COMPILER_LAUNCHER": "ccache", "CMAKE_CXX_COMPILER_LAUNCHER": "ccache",
        "CMAKE_PLATFORM_NO_VERSIONED_SONAME": "ON", "CMAKE_BUILD_WITH_INSTALL_RPATH": "ON",
        "CMAKE_INSTALL_RPATH": RPATH,
        "CUDA_cublas_LIBRARY": f"{cu}/lib/libcublas.so.13", "CUDA_cublasLt_LIBRARY": f"{cu}/lib/libcublasLt.so.13",
        "CMAKE_CUDA_FLAGS": f"-I{inc}", "CMAKE_CXX_FLAGS": f"-I{inc}",
    }  # fmt: skip
    assert got == want
    assert "CMAKE_CUDA_COMPILER_LAUNCHER" not in bg.cuda_plugin_defines("89", cu, inc, None)


def test_cuda_archs_come_from_the_option_then_the_environment(monkeypatch):
    bg = _build_ggml()
    monkeypatch.delenv("TOY_CUDA_ARCHS", raising=False)
    assert bg.cuda_archs("") == "80;86;89;90"
    monkeypatch.setenv("TOY_CUDA_ARCHS", "89, 90a")
    assert bg.cuda_archs("") == "89;90a"
    assert bg.cuda_archs("86") == "86"
    with pytest.raises(SystemExit, match=r"CUDA archs '8\.9'.*bad: 8\.9"):
        bg.cuda_archs("8.9")


def test_the_cublas_include_folder_links_the_cublas_headers_only(tmp_path):
    bg = _build_ggml()
    inc = tmp_path / "cu13" / "include"
    inc.mkdir(parents=True)
    for h in ("cublas_v2.h", "cublas_api.h", "cublasLt.h", "cuda_runtime.h", "cuComplex.h"):
        (inc / h).write_text(f"/* {h} */\n")
    folder = bg.cublas_include(tmp_path / "cublas-include", tmp_path / "cu13")
    (folder / "stale.h").write_text("")
    bg.cublas_include(folder, tmp_path / "cu13")  # a second run keeps the links and drops the rest
    assert sorted(p.name for p in folder.iterdir()) == ["cublasLt.h", "cublas_api.h", "cublas_v2.h"]
    assert all(p.is_symlink() and p.resolve() == (inc / p.name).resolve() for p in folder.iterdir())


def test_the_elf_reader_reads_the_cpu_variant():
    """readelf's view of a module whose dependencies are known: every CPU variant needs libggml-base.so and
    finds it through $ORIGIN (build_ggml.py sets both); a file that is not ELF is an error."""
    bg = _build_ggml()
    got = bg.elf_dynamic(Path(tg.cpu_variant().path))
    assert "libggml-base.so" in got["NEEDED"] and got["RUNPATH"] == ["$ORIGIN"]
    assert not any(n.startswith("libcuda") for n in got["NEEDED"])
    with pytest.raises(ValueError, match="not an ELF file"):
        bg.elf_dynamic(BUILD_GGML)


def _readelf_field(text: str, tag: str, label: str) -> list[str]:
    return [ln.split(f"{label}: [", 1)[1].rsplit("]", 1)[0] for ln in text.splitlines() if f"({tag})" in ln]


# --- the plugin's package: meson configure and the sdist's contents (CI) -----------------

PLUGIN_PKG = HERE.parent.parent / "toy-ggml-cuda"
GGML_TREE = HERE.parent / "subprojects" / "ggml"


def test_the_plugin_configures_from_the_checkout(tmp_path):
    """meson setup of packages/toy-ggml-cuda (no compile): the build step is build_ggml.py's CUDA mode on
    toy-ggml's ggml tree, into the CMake folder the option names."""
    meson = shutil.which("meson", path=str(Path(sys.executable).parent)) or shutil.which("meson")
    if meson is None:
        pytest.skip("meson is not installed")
    cmake_dir = tmp_path / "ggml-cmake"
    p = subprocess.run(
        [meson, "setup", str(tmp_path / "b"), str(PLUGIN_PKG), f"-Dcmake_build_dir={cmake_dir}", "-Darchs=89"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    ninja = (tmp_path / "b" / "build.ninja").read_text()
    line = next(ln for ln in ninja.splitlines() if "--cuda-plugin" in ln)
    assert "toy-ggml-cuda/../toy-ggml/build_tools/build_ggml.py --cuda-plugin" in line, line
    assert "--source " + str(PLUGIN_PKG / ".." / "toy-ggml" / "subprojects" / "ggml") in line, line
    assert f"--build {cmake_dir}" in line and "--archs 89" in line
    assert "libggml-cuda.so build-info.json" in line


def test_the_sdist_script_carries_the_ggml_tree_and_the_build_script(tmp_path):
    if not (GGML_TREE / ".toy-stamp.json").is_file():
        pytest.skip("the ggml tree is not laid out (python tools/fetch_ggml.py)")
    env = dict(os.environ, MESON_PROJECT_SOURCE_ROOT=str(PLUGIN_PKG), MESON_PROJECT_DIST_ROOT=str(tmp_path))
    p = subprocess.run(
        [sys.executable, str(PLUGIN_PKG / "build_tools" / "dist_plugin.py")], env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "build_tools" / "build_ggml.py").read_bytes() == BUILD_GGML.read_bytes()
    tree = tmp_path / "subprojects" / "ggml"
    assert (tree / ".toy-stamp.json").read_bytes() == (GGML_TREE / ".toy-stamp.json").read_bytes()
    backends = sorted(d.name for d in (tree / "src").iterdir() if d.is_dir() and d.name.startswith("ggml-"))
    assert backends == ["ggml-cpu", "ggml-cuda"]
    assert (tree / "src" / "ggml-cuda" / "ggml-cuda.cu").read_bytes() == (
        GGML_TREE / "src" / "ggml-cuda" / "ggml-cuda.cu"
    ).read_bytes()


# --- (b) the real plugin, once `just cuda` has installed it ---------------------------

_installed = _dispatch._plugin_folder("toy_ggml_cuda")
_real_lib = _installed / "libggml-cuda.so" if _installed is not None else None
needs_plugin = pytest.mark.skipif(
    _real_lib is None or not _real_lib.is_file(), reason="toy-ggml-cuda is not installed (just cuda)"
)
_has_gpu = Path("/dev/nvidia0").exists()


@needs_plugin
def test_the_installed_plugin_loads():
    (p,) = tg.plugins()
    assert p.path == str(_real_lib) and p.loaded and p.backend == "CUDA", p
    assert p.built_for["cuda_version"].startswith("13.") and p.built_for["archs"]
    cuda = [d for d in tg.devices() if d.backend == "CUDA"]
    assert [d.name for d in cuda] == list(p.devices)
    if not _has_gpu:  # no driver, no GPU: the registry is there, with no device
        assert p.devices == () and p.reason.startswith("no device"), p.reason
    else:
        assert cuda and all(d.kind == "gpu" for d in cuda)


@needs_plugin
def test_the_cpu_path_is_unchanged_with_the_plugin():
    out, err = _probe(_env())
    (p,) = out["plugins"]
    assert p["loaded"] is True
    if not _has_gpu:
        _assert_cpu_unchanged(out)
        assert err.strip() == "", err  # ggml's "no CUDA-capable device" line went to the logger's debug level
    # the same computation with the plugin skipped gives the same bits
    skipped, _ = _probe(_env(TOY_GGML_CUDA="0"))
    if not _has_gpu:
        assert skipped["mul_mat"] == out["mul_mat"]


@needs_plugin
def test_the_plugin_library_has_the_promised_run_path_and_dependencies():
    readelf = shutil.which("readelf")
    bg = _build_ggml()
    dyn = bg.elf_dynamic(_real_lib)
    if readelf is not None:  # the independent reading
        out = subprocess.run([readelf, "-d", str(_real_lib)], capture_output=True, text=True, check=True).stdout
        assert dyn["NEEDED"] == _readelf_field(out, "NEEDED", "Shared library")
        assert dyn["RUNPATH"] == _readelf_field(out, "RUNPATH", "Library runpath")
    assert dyn["RUNPATH"] == [RPATH] and dyn["RPATH"] == []
    needed = set(dyn["NEEDED"])
    assert {"libggml-base.so", "libcudart.so.13", "libcublas.so.13"} <= needed  # cublas brings cublasLt
    assert not any(n.startswith(("libcuda.so", "libggml-cpu", "libggml.so")) for n in needed), needed
    # the libraries the run path points at are NVIDIA's wheels, beside the package
    site = _real_lib.parent.parent
    for n in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"):
        assert (site / "nvidia" / "cu13" / "lib" / n).is_file(), n
