"""omnistage: a serving engine for omni-modal models.

Public names are imported on first use (PEP 562), so `import omnistage` and light CLI
commands do not pay for torch/transformers until they need them.
"""

import importlib

from omnistage.version import __version__  # noqa: F401  (re-exported)

_EXPORTS = {
    "Omni": "omnistage.entrypoints.omni",
    "AsyncOmni": "omnistage.entrypoints.async_omni",
    "SamplingParams": "omnistage.sampling_params",
    "OmniOutput": "omnistage.outputs",
    "CompletionOutput": "omnistage.outputs",
    "Delta": "omnistage.outputs",
    "OutputOptions": "omnistage.engine_api",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'omnistage' has no attribute {name!r}")
