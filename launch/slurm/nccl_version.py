"""Print the version of the NCCL library this Python's torch runs with, as major.minor.patch.

train_with_sglang.sbatch runs it in the trainer's image and in the servers' before a
weight_sync=distributed job: NCCL's communicator init compares every peer's version code, patch
level included ("Mismatched NCCL version"). Standalone (stdlib + torch): the servers' image has
no gspo_megatron.

Why not `torch.cuda.nccl.version()`: that is the NCCL header torch was *compiled* with
(torch/csrc/cuda/nccl.cpp version(): NCCL_MAJOR/NCCL_MINOR/NCCL_PATCH), while what counts is the
libnccl loaded at run time, which images replace (SGLang's pip-installs its own
nvidia-nccl-cu12; NCCL_LIBRARY / LD_LIBRARY_PATH can point elsewhere). So: import torch (which
loads its libnccl: torch/__init__.py preloads the CUDA libraries, libtorch_cuda needs it), find
that library among this process's mappings, and ask it (ncclGetVersion). A torch that links NCCL
statically answers from libtorch_cuda itself.

Exit 1 with one line when no NCCL is loaded (a CPU build of torch) or it does not answer."""
from __future__ import annotations

import ctypes
import os
import sys


def mapped_libraries(maps_path: str = "/proc/self/maps") -> list[str]:
    """The shared objects mapped into this process, in order of first mapping."""
    out: list[str] = []
    with open(maps_path) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6:
                path = parts[5].strip()
                if ".so" in os.path.basename(path) and path not in out:
                    out.append(path)
    return out


def version_string(code: int) -> str:
    """NCCL's version code: major*10000 + minor*100 + patch since 2.9 (NCCL_VERSION_CODE),
    major*1000 + minor*100 + patch before."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def runtime_version(libraries: list[str]) -> tuple[str, str]:
    """(version, the library that answered): a libnccl among `libraries` first, else a library
    of torch's that has NCCL linked in."""
    nccl = [p for p in libraries if os.path.basename(p).startswith("libnccl")]
    torch_libs = [p for p in libraries if os.path.basename(p).startswith("libtorch_cuda")]
    for path in nccl + torch_libs:
        try:
            fn = ctypes.CDLL(path).ncclGetVersion
        except (OSError, AttributeError):
            continue
        v = ctypes.c_int(0)
        rc = fn(ctypes.byref(v))
        if rc != 0:
            raise RuntimeError(f"ncclGetVersion of {path} returned {rc}")
        return version_string(v.value), path
    raise RuntimeError("no NCCL library is loaded by this torch (a CPU build?); mapped: "
                       + (", ".join(os.path.basename(p) for p in libraries[:8]) or "none"))


def main() -> int:
    import torch  # noqa: F401 - loads the libnccl torch runs with

    try:
        version, path = runtime_version(mapped_libraries())
    except RuntimeError as e:
        print(f"nccl_version.py: {e}", file=sys.stderr)
        return 1
    print(f"nccl_version.py: {path}", file=sys.stderr)
    print(version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
