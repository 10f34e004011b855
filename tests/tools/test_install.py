"""tools/install.py and tools/dist.py: the pieces that need no build (what a wheel is built from, wheel lookup, argument errors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"toy_tool_{name}", ROOT / f"tools/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


install = _load("install")
dist = _load("dist")


def test_package_files_are_the_sources_without_tests():
    files = [p.relative_to(ROOT).as_posix() for p in install.package_files(["toy-ggml", "toy-core", "toy-cli"])]
    assert "packages/toy-core/pyproject.toml" in files
    assert "packages/toy-ggml/meson.build" in files
    assert "packages/toy-cli/src/toy_cli/main.py" in files
    assert not [f for f in files if f.split("/")[2] in ("tests", "benchmarks")]
    assert not [f for f in files if "/subprojects/ggml/" in f or f.endswith((".so", ".pyc"))]  # ignored: not inputs
    assert not [f for f in files if f.startswith("packages/toy-serve/")]


def test_no_wheel_carries_test_only_code(capsys):
    """The reference implementations and test helpers are the test-support package (tests/support/,
    ``toy_testsupport``): toy-core's wheel has no ``toy/reference``, and no wheel is built from tests/support."""
    from setuptools import find_namespace_packages

    every = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    assert "toy-core" in every and (ROOT / "tests/support/pyproject.toml").is_file()
    files = [p.relative_to(ROOT).as_posix() for p in install.package_files(every)]
    assert "packages/toy-core/src/toy/__init__.py" in files
    assert not [f for f in files if "/toy/reference/" in f or "toy_testsupport" in f]
    # what setuptools packs into toy-core's wheel ([tool.setuptools.packages.find] where = ["src"]; pyproject
    # configuration finds namespace packages too, so a leftover folder without __init__.py would count)
    found = find_namespace_packages(str(ROOT / "packages/toy-core/src"))
    assert "toy" in found and "toy.models" in found
    assert not [p for p in found if p == "toy.reference" or p.startswith("toy.reference.")], found
    # tools/dist.py builds the folders under packages/ only: tests/support is not one of them
    assert dist.main(["--out", "build/never", "support"]) == 1
    err = capsys.readouterr().err
    assert f"(have: {', '.join(every)})" in err and "support" not in err.split("(have:")[1]
    assert not (ROOT / "build/never").exists()


FIVE = ["x64", "haswell", "skylakex", "icelake", "zen4"]  # packages/toy-ggml/meson.options' cpu_variants


def test_each_package_has_its_own_digest():
    """The wheel cache key of a package is its own: toy-core's does not move with toy-ggml's build options."""
    a = install.package_digest("toy-cli")
    assert a == install.package_digest("toy-cli") and len(a) == 16
    assert a != install.package_digest("toy-core")
    assert install.package_digest("toy-core", ["x64"]) == install.package_digest("toy-core", FIVE)
    assert install.package_digest("toy-ggml", ["x64"]) != install.package_digest("toy-ggml", FIVE)
    assert install.package_digest("toy-ggml") == install.package_digest("toy-ggml", FIVE)


# /proc/cpuinfo flags lines of real machines, as Linux printed them (lscpu's "Flags:" is the same list).
ZEN4 = (  # AMD EPYC 9754 (Zen 4c, family 25 model 160)
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
    "mmxext fxsr_opt pdpe1gb rdtscp lm rep_good nopl cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 "
    "pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm "
    "cmp_legacy svm cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw perfctr_core invpcid_single ssbd ibrs ibpb "
    "stibp ibrs_enhanced vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx "
    "smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 "
    "clzero xsaveerptr wbnoinvd arat npt lbrv nrip_save tsc_scale vmcb_clean flushbyasid pausefilter pfthreshold "
    "v_vmsave_vmload vgif avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq la57 rdpid fsrm flush_l1d arch_capabilities"
)
ZEN3 = (  # AMD EPYC 7763 (Zen 3, family 25 model 1): AVX2, no AVX-512
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
    "mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl tsc_reliable nonstop_tsc cpuid extd_apicid "
    "aperfmperf pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor "
    "lahf_lm cmp_legacy svm cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single vmmcall "
    "fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves "
    "clzero xsaveerptr rdpru arat npt nrip_save tsc_scale vmcb_clean flushbyasid decodeassists pausefilter "
    "pfthreshold v_vmsave_vmload umip vaes vpclmulqdq rdpid fsrm"
)
EMERALD_RAPIDS = (  # Intel Xeon Gold 6530 (5th generation Xeon Scalable, family 6 model 207): AVX-512 and AMX
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse sse2 ss "
    "ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good nopl xtopology "
    "nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma "
    "cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm "
    "abm 3dnowprefetch cpuid_fault epb cat_l3 cat_l2 cdp_l3 intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp "
    "ibrs_enhanced tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm "
    "rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl "
    "xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local split_lock_detect user_shstk "
    "avx_vnni avx512_bf16 wbnoinvd dtherm ida arat pln pts hwp hwp_act_window hwp_epp hwp_pkg_req vnmi avx512vbmi "
    "umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 "
    "rdpid bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr ibt "
    "amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities ibpb_exit_to_user"
)
CORE2 = (  # Intel Core 2 Duo E8400: x86-64 without AVX (nor SSE4.2)
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse sse2 ss "
    "ht tm pbe syscall nx lm constant_tsc arch_perfmon pebs bts rep_good aperfmperf pni dtes64 monitor ds_cpl vmx smx "
    "est tm2 ssse3 cx16 xtpr pdcm sse4_1 lahf_lm tpr_shadow vnmi flexpriority"
)


@pytest.mark.parametrize(
    "flags, best, built",
    [
        # Expected sets from ggml's variant table (src/CMakeLists.txt, ggml_add_cpu_backend_variant) and its score
        # (cpu-feats.cpp: 0 if a feature is missing, else higher for a later level), read by hand:
        # Zen 4 has everything zen4 is compiled for (AVX512 + VBMI + VNNI + BF16): zen4 scores highest
        (ZEN4, "zen4", ["x64", "zen4"]),
        # Zen 3 has haswell's SSE42 AVX F16C FMA AVX2 BMI2 but no avx512f: skylakex and above score 0
        (ZEN3, "haswell", ["x64", "haswell"]),
        # Emerald Rapids has all of zen4's features too (its AMX level, sapphirerapids, is not in meson.options)
        (EMERALD_RAPIDS, "zen4", ["x64", "zen4"]),
        # no AVX: only the baseline runs, and it is built once
        (CORE2, "x64", ["x64"]),
    ],
    ids=["zen4", "zen3", "emerald-rapids", "core2-no-avx"],
)
def test_just_install_builds_this_cpus_best_variant_and_the_baseline(flags, best, built):
    got, why = install.cpu_variants(None, None, "x86_64", set(flags.split()))
    assert got == built
    assert why.startswith(f"this CPU: {best}; building ")
    assert "`--cpu-variants all` builds every one" in why
    assert install.cpu_variants("host", FIVE, "x86_64", set(flags.split())) == (got, why)  # host overrides the record


def test_the_cpu_variant_line():
    _, why = install.cpu_variants(None, None, "x86_64", set(ZEN4.split()))
    assert why == "this CPU: zen4; building zen4 + x64 (the baseline); `--cpu-variants all` builds every one"
    _, why = install.cpu_variants(None, None, "x86_64", set(CORE2.split()))
    assert why == "this CPU: x64; building x64 only (the baseline); `--cpu-variants all` builds every one"


def test_cpu_variants_where_the_cpu_cannot_be_read():
    # x86-64 without /proc/cpuinfo (macOS): every variant, said so
    got, why = install.cpu_variants(None, None, "x86_64", None)
    assert got == FIVE and why.startswith("no CPU flags in /proc/cpuinfo: building every CPU variant")
    # not x86-64: meson builds no variant whatever the list says; as before, the whole list and no line
    assert install.cpu_variants(None, None, "aarch64", None) == (FIVE, None)


def test_on_this_machine_the_choice_is_what_ggml_loads_here():
    """With no record, `just install` reads this machine's CPU; the development environment's toy_ggml
    carries all five variants and loads the one ggml's own score (cpuid) picks: the install builds that
    one and the baseline."""
    import toy_ggml as tg

    if tg.build_config.NATIVE or sorted(tg.build_config.CPU_VARIANTS) != sorted(FIVE):
        pytest.skip(f"the development build is not the portable five-variant one ({tg.build_config.CPU_VARIANTS})")
    got, why = install.cpu_variants(None, None)
    loaded = tg.cpu_variant().tag
    assert got == [t for t in FIVE if t in ("x64", loaded)]
    assert why.startswith(f"this CPU: {loaded}; ")


def test_cpu_variants():
    assert install.all_cpu_variants() == FIVE
    assert install.cpu_variants("all", None) == (FIVE, None)
    assert install.cpu_variants("all", ["x64"]) == (FIVE, None)
    assert install.cpu_variants("haswell, x64", None) == (["x64", "haswell"], None)  # meson.options' order
    got, why = install.cpu_variants(None, ["x64", "haswell"])  # as the environment was built: no recompile
    assert got == ["x64", "haswell"] and why.startswith("CPU variants x64,haswell, as last installed")
    assert install.cpu_variants(None, FIVE) == (FIVE, None)
    for bad, msg in [("x64,avx9", "unknown CPU variant 'avx9'"), (",", "no CPU variant named")]:
        with pytest.raises(install.InstallError, match=msg):
            install.cpu_variants(bad, None)


def test_an_unknown_cpu_variant_builds_nothing(tmp_path, capsys):
    rc = install.main(["--venv", str(tmp_path / "venv"), "--cache", str(tmp_path / "c"), "--cpu-variants", "x64,avx9"])
    assert rc == 1
    err = capsys.readouterr().err
    want = "error: --cpu-variants: unknown CPU variant 'avx9' (have: x64, haswell, skylakex, icelake, zen4, or all, or host)"
    assert want in err
    assert "building" not in err and "ggml source" not in err
    assert not (tmp_path / "venv").exists() and not (tmp_path / "c").exists()


def test_build_progress_comes_from_ninjas_lines(tmp_path):
    log = tmp_path / "toy-ggml.log"
    log.write_text("$ pip wheel ...\n  Preparing metadata (pyproject.toml): started\n")
    assert install.progress(log) == ""
    with open(log, "a") as f:  # as pip -v shows the backend's output: indented
        f.write("  [3/33] Building CXX object src/CMakeFiles/ggml-base.dir/ggml-backend.cpp.o\n")
        f.write("  [4/33] Building C object src/CMakeFiles/ggml-base.dir/ggml.c.o\n")
    assert install.progress(log) == "[4/33] compiling ggml"
    with open(log, "a") as f:
        f.write("  [7/9] Linking target src/toy_ggml/_core.cpython-311-x86_64-linux-gnu.so\n  some other line\n")
    assert install.progress(log) == "[7/9] linking the bindings"
    with open(log, "a") as f:
        f.write("  [12/12] /work/main/packages/toy-ggml/src/toy_ggml/py.typed\n")
    assert install.progress(log) == "[12/12] packing the wheel"
    assert install.progress(tmp_path / "missing.log") == ""


def test_the_record_before_per_package_digests_counts_as_installed(tmp_path):
    old = '{"digest": "ab", "packages": ["toy-ggml", "toy-core", "toy-cli", "toy-vit"]}'
    (tmp_path / ".toy-install.json").write_text(old)
    pkgs, extras, variants = install.read_stamp(tmp_path)
    assert pkgs == {"toy-ggml": None, "toy-core": None, "toy-cli": None, "toy-vit": None}
    assert extras == ["vit"] and variants is None
    assert install.read_stamp(tmp_path / "nothing") == ({}, [], None)


def test_cpu_variants_do_not_go_with_prebuilt_wheels(tmp_path, capsys):
    rc = install.main(["--venv", str(tmp_path / "venv"), "--wheels", str(tmp_path), "--cpu-variants", "x64"])
    assert rc == 1
    assert "error: --cpu-variants chooses what to build" in capsys.readouterr().err
    assert not (tmp_path / "venv").exists()


def test_find_wheels(tmp_path):
    for name in ("toy_ggml-0.1.0-cp311-cp311-linux_x86_64.whl", "toy_core-0.1.0-cp311-cp311-linux_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "toy_core-0.1.0.tar.gz").write_bytes(b"")
    got = install.find_wheels(tmp_path, ["toy-ggml", "toy-core"])
    assert [p.name.split("-")[0] for p in got] == ["toy_ggml", "toy_core"]
    with pytest.raises(install.InstallError, match="no wheel for toy-cli"):
        install.find_wheels(tmp_path, ["toy-cli"])
    (tmp_path / "toy_core-0.0.9-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    with pytest.raises(install.InstallError, match="2 wheels for toy-core"):
        install.find_wheels(tmp_path, ["toy-core"])


def test_install_from_a_folder_without_wheels_fails_cleanly(tmp_path, capsys):
    rc = install.main(["--venv", str(tmp_path / "venv"), "--wheels", str(tmp_path)])
    assert rc == 1
    assert "error: no wheel for toy-ggml" in capsys.readouterr().err


def test_dist_refuses_an_unknown_package(capsys):
    assert dist.main(["--out", "build/never", "toy-nothing"]) == 1
    assert "error: no such package under packages/: toy-nothing" in capsys.readouterr().err
    assert not (ROOT / "build/never").exists()


def test_vit_and_serve_ask_for_their_wheels(tmp_path, capsys):
    for name in ("toy_ggml", "toy_core", "toy_cli", "toy_serve"):
        (tmp_path / f"{name}-0.1.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    rc = install.main(["--venv", str(tmp_path / "venv"), "--wheels", str(tmp_path), "--serve", "--vit"])
    assert rc == 1
    assert "error: no wheel for toy-vit" in capsys.readouterr().err
    assert not (tmp_path / "venv").exists()  # the wheels are looked up before anything is created


def _wheel(folder: Path, dist: str, requires: list[str]) -> Path:
    """A wheel file with just the METADATA a build backend writes (what requirements_of reads)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-0.1.0-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.1.0\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}-0.1.0.dist-info/METADATA", meta)
    return path


CLI_REQUIRES = [
    "toy-core==0.1.0",
    "toy_ggml==0.1.0",
    "typer<0.29,>=0.16",
    'tomli>=2.0; python_version < "3.11"',
    'matplotlib>=3.8; extra == "plot"',
    'toy-serve==0.1.0; extra == "serve"',
    'toy-core[tensorboard]==0.1.0; extra == "tensorboard"',
    'tensorboardX>=2.6; extra == "tensorboard"',
]


def test_requirements_of_a_wheel(tmp_path):
    """toy's own packages are left out (they are installed from their wheels); an environment marker
    stays for pip to evaluate; a requirement of an extra comes only with that extra, without its marker."""
    w = _wheel(tmp_path, "toy_cli", CLI_REQUIRES)
    assert install.requirements_of(w, []) == ["typer<0.29,>=0.16", 'tomli>=2.0; python_version < "3.11"']
    assert install.requirements_of(w, ["plot", "serve"]) == [
        "typer<0.29,>=0.16",
        'tomli>=2.0; python_version < "3.11"',
        "matplotlib>=3.8",
    ]
    assert install.requirements_of(w, ["tensorboard"])[-1] == "tensorboardX>=2.6"


class _FakeBuilds:
    """tools/install.py's steps with no pip and no compiler: what build_all orders, and when.
    toy-ggml's build takes ``ggml_s`` seconds (it watches the stop event like the real one)."""

    def __init__(self, monkeypatch, tmp_path, ggml_s=1.0, fail=None):
        self.events: list[str] = []
        self.tmp = tmp_path
        self.ggml_s = ggml_s
        self.fail = fail
        self.stopped = False
        monkeypatch.setattr(install, "package_digest", lambda p, v=None: f"d-{p}")
        monkeypatch.setattr(install, "cached_wheel", lambda p, d, c: None)
        monkeypatch.setattr(install, "build_wheel", self.build_wheel)
        monkeypatch.setattr(install, "run", self.run)
        monkeypatch.setattr(install.venv, "EnvBuilder", self.env_builder)

    def log(self, what):
        self.events.append(what)

    def build_wheel(self, folder, dig, cache, logs, variants, stop=None):
        import time

        self.log(f"start {folder}")
        if folder == self.fail:
            raise install.InstallError(f"building the {folder} wheel failed")
        end = time.monotonic() + (self.ggml_s if folder == "toy-ggml" else 0.05)
        while time.monotonic() < end:
            if stop is not None and stop.is_set():
                self.stopped = True
                raise install.InstallError("stopped")
            time.sleep(0.01)
        self.log(f"built {folder}")
        requires = {"toy-core": ["toy-ggml==0.1.0", "numpy>=1.26", "jinja2>=3.1"], "toy-cli": CLI_REQUIRES}
        return _wheel(self.tmp / "wheels" / folder, install.dist_name(folder), requires.get(folder, ["numpy>=1.26"]))

    def run(self, cmd, what):
        self.log(what if "install" not in cmd else f"pip install {' '.join(cmd[cmd.index('-q') + 1 :])}")

    def env_builder(self, with_pip):
        fake = self

        class Builder:
            def create(self, env_dir):
                (Path(env_dir) / "bin").mkdir(parents=True)
                (Path(env_dir) / "bin" / "python").write_text("")
                fake.log("venv")

        return Builder()


def test_a_first_install_does_the_rest_while_ggml_compiles(monkeypatch, tmp_path):
    fake = _FakeBuilds(monkeypatch, tmp_path)
    env = tmp_path / "venv"
    wheels, digests = install.build_all(install.BASE, ["plot"], ["x64"], tmp_path, tmp_path, env, {}, [])
    assert [w.name.split("-")[0] for w in wheels] == ["toy_ggml", "toy_core", "toy_cli"]
    assert digests == {"toy-ggml": "d-toy-ggml", "toy-core": "d-toy-core", "toy-cli": "d-toy-cli"}
    ev = fake.events
    deps = 'pip install numpy>=1.26 jinja2>=3.1 typer<0.29,>=0.16 tomli>=2.0; python_version < "3.11" matplotlib>=3.8'
    assert deps in ev and "venv" in ev
    # the other wheels, the environment and the dependencies while toy-ggml's build runs (its end is last)
    assert ev.index("laying out ggml source") < ev.index("start toy-ggml")
    assert ev.index("built toy-core") < ev.index("built toy-cli") < ev.index("venv") < ev.index(deps)
    assert ev.index(deps) < ev.index("built toy-ggml") == len(ev) - 1


def test_nothing_changed_builds_nothing(monkeypatch, tmp_path):
    fake = _FakeBuilds(monkeypatch, tmp_path)
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    old = {p: f"d-{p}" for p in install.BASE}
    assert install.build_all(install.BASE, [], ["x64"], tmp_path, tmp_path, env, old, []) == ([], old)
    assert fake.events == ["laying out ggml source"]
    # toy-ggml alone changed: only it is built; the others' wheels come from the cache (here: built again)
    wheels, _ = install.build_all(install.BASE, [], ["x64"], tmp_path, tmp_path, env, {**old, "toy-ggml": "x"}, [])
    assert len(wheels) == 3 and "venv" not in fake.events and not [e for e in fake.events if e.startswith("pip")]


def test_a_failed_build_stops_the_ggml_compile(monkeypatch, tmp_path):
    import time

    fake = _FakeBuilds(monkeypatch, tmp_path, ggml_s=60.0, fail="toy-core")
    t0 = time.monotonic()
    with pytest.raises(install.InstallError, match="building the toy-core wheel failed"):
        install.build_all(install.BASE, [], ["x64"], tmp_path, tmp_path, tmp_path / "venv", {}, [])
    assert fake.stopped and time.monotonic() - t0 < 10
    assert not (tmp_path / "venv").exists()
