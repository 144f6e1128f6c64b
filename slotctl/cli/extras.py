"""The optional extras: whether llama-cpp-python (the ``[llama]`` extra) is installed, found without importing
it, and what to install when it is not. Below ``common`` and ``errors`` (both read it; it imports neither)."""

from __future__ import annotations

from slotctl.errors import SlotctlError


def llama_available() -> bool:
    """Whether llama-cpp-python is installed (found without importing it: importing loads llama.cpp)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_install() -> str:
    """The pip command that adds llama-cpp-python, pinned as slotctl's ``[llama]`` extra pins it."""
    req = "llama-cpp-python"
    try:
        import importlib.metadata

        for r in importlib.metadata.requires("slotctl") or []:
            spec = r.partition(";")[0]  # the [llama] extra's pin (or, in older metadata, a plain dependency)
            if spec.strip().startswith("llama-cpp-python"):
                req = spec.strip()
                break
    except Exception:  # noqa: BLE001 - not installed as a distribution (PYTHONPATH): the bare name
        pass
    return f"pip install '{req}'"


def require_llama(what: str) -> None:
    """A usage error (exit 2) naming what to install when llama-cpp-python is missing."""
    if not llama_available():
        raise SlotctlError(llama_missing(what))


def llama_missing(what: str) -> str:
    return f"{what} runs llama.cpp, and llama-cpp-python is not installed: {llama_hint()}"


def llama_hint() -> str:
    """How to install llama-cpp-python and what that takes."""
    return f"{llama_install()} (slotctl's [llama] extra; it compiles llama.cpp: a C/C++ compiler and a few minutes)"

