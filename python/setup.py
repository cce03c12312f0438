"""Builds dgps_torch's operator library with CMake against the installed PyTorch (see docs/python.md).

Environment: DGPS_TORCH_CUDA=0/1 (default: 1 when torch has CUDA and nvcc is found), DGPS_CUDA_GENCODE
(nvcc -gencode flags, default sm_90a), DGPS_TORCH_DYNAMIC=1 (compile every model combination; slow),
DGPS_TORCH_DYNAMIC_LIB=path/libdgps_dynamic.a (reuse one from a build tree), DGPS_TORCH_BUILD_DIR (keep
the CMake build tree there between builds), DGPS_TORCH_JOBS (parallel jobs).
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _flag(name, default):
    v = os.environ.get(name)
    return default if v is None or v == "" else v not in ("0", "OFF", "off", "false", "False")


def _nvcc():
    for c in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and Path(c).exists():
            return c
    return None


def _paths(fn, cuda):
    """torch.utils.cpp_extension's include_paths / library_paths: `cuda=` before PyTorch 2.6, `device_type=` after."""
    import inspect
    if "device_type" in inspect.signature(fn).parameters:
        return fn(device_type="cuda" if cuda else "cpu")
    return fn(cuda=cuda)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch
        import torch.utils.cpp_extension as ce

        nvcc = _nvcc()
        cuda = _flag("DGPS_TORCH_CUDA", torch.version.cuda is not None and nvcc is not None)
        build = Path(os.environ.get("DGPS_TORCH_BUILD_DIR") or (Path(self.build_temp).resolve() / "cmake"))
        build.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake", "-S", str(HERE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            "-DTORCH_INCLUDE_DIRS=" + ";".join(_paths(ce.include_paths, cuda)),
            "-DTORCH_LIBRARY_DIRS=" + ";".join(_paths(ce.library_paths, cuda)),
            "-DTORCH_CXX11_ABI=" + str(int(torch.compiled_with_cxx11_abi())),
            "-DDGPS_TORCH_CUDA=" + ("ON" if cuda else "OFF"),
            "-DDGPS_TORCH_DYNAMIC=" + ("ON" if _flag("DGPS_TORCH_DYNAMIC", False) else "OFF"),
            "-DDGPS_TORCH_DYNAMIC_LIB=" + os.environ.get("DGPS_TORCH_DYNAMIC_LIB", ""),
        ]
        if cuda and nvcc:
            args.append("-DCMAKE_CUDA_COMPILER=" + nvcc)
        if os.environ.get("DGPS_CUDA_GENCODE"):
            args.append("-DDGPS_CUDA_GENCODE=" + os.environ["DGPS_CUDA_GENCODE"])
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        subprocess.check_call(args)
        jobs = os.environ.get("DGPS_TORCH_JOBS") or str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", str(build), "--target", "dgps_torch_ops", "-j", jobs])
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build / "_C.so", out)


setup(ext_modules=[Extension("dgps_torch._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
