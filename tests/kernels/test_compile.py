"""Every Triton kernel compiled ahead of time for the GPUs it targets, on the CPU (no GPU needed):
for sm_80 (A100), sm_90 (H100/H200) and sm_100 (B200), in every configuration its launcher can pick.

One child process compiles the cases (dlo.kernels.aot.compile_all, both cores) into a Triton cache
private to this run; the tests then read the results. The whole matrix (every case for 3 targets,
~100 CPU seconds) is marked `compile`: a CI step of its own (`pytest -m compile`), as it would take a
sixth of `make test`'s ten minutes; `make test` compiles each kernel's first case for sm_90."""

import importlib
import inspect
import pkgutil
import re

import pytest

import dlo.kernels
from dlo.kernels import aot

CASES = aot.all_cases()
IDS = [(case.name, arch) for case in CASES for arch in aot.TARGETS]


# make test's share: each kernel's first case (its launcher's first dtype and configuration), for sm_90
FIRST = list({aot.python_function(case.kernel): case.name for case in reversed(CASES)}.values())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return aot.compile_all(cache_dir=tmp_path_factory.mktemp("triton-cache"))


@pytest.fixture(scope="module")
def compiled_first(tmp_path_factory):
    return aot.compile_all(archs=(90,), cache_dir=tmp_path_factory.mktemp("triton-cache"), only=FIRST)


def within_limits(res: dict, arch: int) -> None:
    assert "error" not in res, res.get("error")
    assert res["smem"] <= aot.TARGETS[arch]["smem_block"], f"{res['smem']} B of shared memory per block"
    assert res["spill_stores"] == res["spill_loads"] == 0, f"register spills: {res}"
    assert res["regs"] <= 255


@pytest.mark.parametrize("name", FIRST)
def test_each_kernel_compiles_for_sm90(compiled_first, name):
    assert set(compiled_first) == {(n, 90) for n in FIRST}  # `only` compiled these and nothing else
    within_limits(compiled_first[name, 90], 90)


@pytest.mark.compile
@pytest.mark.parametrize("name,arch", IDS, ids=[f"{n}-sm{a}" for n, a in IDS])
def test_compiles_within_limits_without_spills(compiled, name, arch):
    within_limits(compiled[name, arch], arch)


def test_case_names_are_unique():
    names = [case.name for case in CASES]  # results are keyed by name: a duplicate would hide a case
    assert len(set(names)) == len(names)


def _jit_functions():
    """(qualified name, python function) of every triton.jit object defined in dlo.kernels."""
    found = {}
    for info in pkgutil.iter_modules(dlo.kernels.__path__):
        module = importlib.import_module(f"dlo.kernels.{info.name}")
        for obj in vars(module).values():
            fn = getattr(obj, "fn", None)
            if hasattr(obj, "run") and inspect.isfunction(fn) and fn.__module__ == module.__name__:
                found[f"{module.__name__}.{fn.__name__}"] = fn
    return found


def test_every_jit_function_is_compiled():
    """A kernel without a compile case fails here; a jit helper counts as compiled when a compiled
    kernel (or a helper it calls) calls it by name."""
    functions = _jit_functions()
    covered = {aot.python_function(case.kernel) for case in CASES}
    sources = [inspect.getsource(fn) for fn in covered]
    grew = True
    while grew:
        grew = False
        for fn in set(functions.values()) - covered:
            if any(re.search(rf"\b{fn.__name__}\(", src) for src in sources):
                covered.add(fn)
                sources.append(inspect.getsource(fn))
                grew = True
    missing = sorted(name for name, fn in functions.items() if fn not in covered)
    assert len(functions) >= 9 and not missing, f"jit functions without a compile case: {missing}"


def test_specialization_follows_the_launcher():
    case = next(c for c in CASES if c.name.startswith("_int8_gemm_kernel"))
    signature, constexprs, attrs = aot.specialization(case)
    assert signature["a_ptr"] == "*i8" and signature["M"] == "i32" and signature["BLOCK_M"] == "constexpr"
    assert attrs[(0,)] == [["tt.divisibility", 16]]  # pointers: torch allocations are 16-byte aligned
    ones = aot.CompileCase(case.kernel, {**case.args, "M": 1, "K": 24}, "decode")
    signature, constexprs, attrs = aot.specialization(ones)
    assert constexprs["M"] == 1 and signature["K"] == "i32" and (7,) not in attrs  # K=24: not divisible by 16
    with pytest.raises(ValueError, match="not the kernel's"):
        aot.specialization(aot.CompileCase(case.kernel, {"a_ptr": 0}, "bad"))


@pytest.mark.parametrize("ptx,family", [("wgmma.mma_async.sync.aligned.m64n128k32", "wgmma"),
                                        ("mma.sync.aligned.m16n8k16.row.col", "mma"),
                                        ("tcgen05.mma.cta_group::1", "tcgen05"), ("fma.rn.f32", "none")])
def test_tensor_core_family(ptx, family):
    assert aot.tensor_core(ptx) == family


def test_occupancy_by_hand():
    # 4 warps at 128 regs: 128*32 = 4096 regs per warp, 16384 per block -> 4 blocks -> 16/64 warps.
    assert aot.occupancy(128, 0, 4, 90) == 0.25
    # 100 KiB shared per block on a 164 KiB A100 SM: 1 block of 4 warps.
    assert aot.occupancy(32, 100 * 1024, 4, 80) == 4 / 64
    # 255 regs round up to 256 per thread (whole 256-register warp units): 1 block of 8 warps.
    assert aot.occupancy(255, 0, 8, 80) == 8 / 64


def test_every_autotune_configuration_is_compiled():
    """Each triton.autotune configuration a GPU launch may pick has a compile case with its blocks,
    warps and stages (for every dtype the kernel's other cases cover)."""
    tuned = []
    for info in pkgutil.iter_modules(dlo.kernels.__path__):
        module = importlib.import_module(f"dlo.kernels.{info.name}")
        tuned += [obj for obj in vars(module).values() if hasattr(obj, "configs") and hasattr(obj, "fn")]
    assert tuned, "the int8 GEMM is autotuned"
    for autotuner in tuned:
        fn = aot.python_function(autotuner.fn)
        cases = [c for c in CASES if aot.python_function(c.kernel) is fn]
        compiled = {(tuple(sorted((k, v) for k, v in c.args.items() if k in cfg.kwargs)), c.num_warps, c.num_stages)
                    for c in cases for cfg in autotuner.configs}
        for cfg in autotuner.configs:
            assert (tuple(sorted(cfg.kwargs.items())), cfg.num_warps, cfg.num_stages) in compiled, cfg


def test_unknown_target_is_refused_before_compiling():
    with pytest.raises(ValueError, match="no target sm_75; known: sm_80, sm_90, sm_100"):
        aot.compile_all(archs=(80, 75))


@pytest.mark.parametrize("module", ["int8_gemm", "weight_only_matmul"])
def test_decode_tiles_compile_for_one_token_and_sixteen(module):
    """The launcher makes M = 1 a constant (another compilation than M = 16, which is divisible by
    16): every decode configuration has a compile case at each."""
    mod = importlib.import_module(f"dlo.kernels.{module}")
    cases = [c for c in CASES if c.name.startswith(f"_{module}_kernel")]
    for config in mod.DECODE_CONFIGS:
        blocks = {k: v for k, v in config.items() if k.isupper()}
        ms = {c.args["M"] for c in cases if all(c.args[k] == v for k, v in blocks.items())
              and (c.num_warps, c.num_stages) == (config["num_warps"], config["num_stages"])}
        assert {1, mod.DECODE_MAX_M} <= ms, (config, ms)
